"""Persistence: the chain's tables (``chain_tables``), the chained recorders
(``chained_sqlite``, ``chained_postgres``), the sealed snapshots (``sealed_snapshots``,
``sealed_sqlite``, ``sealed_postgres``), their shared PostgreSQL statements
(``postgres_chain_sql``), the saves through the server functions (``saves_in_server``,
``server_append``), LZ4 states (``state_compression``), the audit's reads of the chain
(``chain_reads``), encoding, roles, start-up, probing, fast-forward loads, and the
seed's ``PostgresStore`` facade."""
