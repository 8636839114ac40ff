"""Persistence: the chained recorders and sealed snapshots (``event_chain``), the server
functions (``server_append``), encoding, roles, start-up, probing, fast-forward loads,
and the seed's ``PostgresStore`` facade."""
