"""The saves that PostgreSQL makes in one statement for an unkeyed chain (plpgsql
functions created with the tables by :mod:`.chained_postgres` and :mod:`.sealed_postgres`;
:mod:`.chained_postgres` calls them; a keyed chain saves through the functions of
:mod:`.keyed_append`; the client links and seals itself only where they are absent or
forbidden, which needs INSERT on the tables: the schema owner's role, or a schema of an
earlier release).

Every one of them is ``SECURITY DEFINER`` (owned by the schema owner, ``search_path``
pinned, its arguments checked): the request-serving role writes the history only
through them and holds no INSERT, UPDATE, DELETE or TRUNCATE on any table
(docs/operations.md). Positions come from the events table's sequence, never from the
caller; a snapshot is written only at an event of the same call.

``<events>_append(ids, versions, topics, states, lock_timeout)`` takes the events
table's lock, inserts the events, links them and notifies. ``<events>_append_with_
snapshots(..., snapshot ids, versions, topics, states)`` does the same and then writes
the snapshots taken at those events with their seals, which it computes from the links
it just made: a save that passes a snapshotting interval is then one statement too,
where it was two round trips (the links' digests back to the client, the sealed
snapshots sent after them) with the events table's lock held in between. Both compute
their digests byte for byte as :class:`~secondbox_scheduler.domain.audit.chain.Chain` does
(SHA-256; every field length-prefixed or fixed-width, big-endian); ``audit verify``
recomputes every one of them in Python.
"""

from __future__ import annotations

from typing import Any

from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composed, Identifier, Literal


def append_function(events_table: str) -> str:
    return f"{events_table}_append"


def checked_events_sql() -> str:
    """plpgsql that refuses malformed events arrays (``ids``, ``versions``, ``topics``,
    ``states``) and lock timeout: a ``SECURITY DEFINER`` function checks what its
    caller passes."""
    return (
        "  IF ids IS NULL OR versions IS NULL OR topics IS NULL OR states IS NULL "
        "OR cardinality(versions) <> cardinality(ids) OR cardinality(topics) <> cardinality(ids) "
        "OR cardinality(states) <> cardinality(ids) OR array_position(ids, NULL) IS NOT NULL "
        "OR array_position(topics, NULL) IS NOT NULL "
        "OR array_position(states, NULL) IS NOT NULL "
        "OR EXISTS (SELECT FROM unnest(versions) AS v WHERE v IS NULL OR v < 1) THEN\n"
        "    RAISE EXCEPTION 'secondbox: malformed events (arrays of one length, no null, "
        "versions from 1)';\n"
        "  END IF;\n"
        "  IF lock_timeout IS NULL OR length(lock_timeout) > 20 "
        "OR lock_timeout !~ '^[0-9]+(\\.[0-9]+)?(ms|s)?$' THEN\n"
        "    RAISE EXCEPTION 'secondbox: malformed lock timeout';\n"
        "  END IF;\n"
    )


def checked_snapshots_sql(arrays: str = "") -> str:
    """plpgsql that refuses malformed snapshot arrays (and ``seals``, when named)."""
    names = ["snapshot_ids", "snapshot_versions", "snapshot_topics", "snapshot_states"]
    if arrays:
        names.append(arrays)
    nulls = " OR ".join(f"{n} IS NULL OR array_position({n}, NULL) IS NOT NULL" for n in names)
    lengths = " OR ".join(f"cardinality({n}) <> cardinality(snapshot_ids)" for n in names[1:])
    return (
        f"  IF {nulls} OR {lengths} THEN\n"
        "    RAISE EXCEPTION 'secondbox: malformed snapshots (arrays of one length, no null)';\n"
        "  END IF;\n"
    )


APPEND_ARGUMENTS = "uuid[], bigint[], text[], bytea[], text"  # the function's signature


def append_function_statement(
    schema: Identifier,
    events: Identifier,
    chain: Identifier,
    lock: Identifier,
    append: Identifier,
    channel: str,
) -> Composed:
    """``<events>_append(ids, versions, topics, states, lock_timeout)``: the save of an
    unkeyed chain in one statement. It takes the events table's lock, inserts the events
    (their notification ids in input order: the lock serialises the sequence), computes
    each link exactly as :meth:`~secondbox_scheduler.domain.audit.chain.Chain.digest` does with
    SHA-256 (every field length-prefixed or fixed-width, big-endian), inserts the links,
    and returns each event's position and digest. The lock is then held for one round
    trip and the commit, not for two round trips and the client's hashing in between. A
    keyed chain never sends its key to the server: it saves through :mod:`.keyed_append`.
    ``SECURITY DEFINER``: the caller needs EXECUTE on it, no privilege on the tables."""
    return SQL(
        "CREATE OR REPLACE FUNCTION {schema}.{append}("
        "ids uuid[], versions bigint[], topics text[], states bytea[], lock_timeout text) "
        "RETURNS TABLE (appended bigint, link bytea) "
        "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $BODY$\n"
        "DECLARE\n"
        "  positions bigint[]; previous bigint[]; digests bytea[];\n"
        "  prior_position bigint; prior bytea; topic bytea;\n"
        "BEGIN\n"
        + checked_events_sql()
        + "  PERFORM set_config('lock_timeout', lock_timeout, true);\n"
        "  PERFORM {schema}.{lock}();\n"
        "  SELECT c.position, c.digest INTO prior_position, prior FROM {schema}.{chain} c "
        "ORDER BY c.position DESC LIMIT 1;\n"
        "  IF NOT FOUND THEN prior_position := 0; prior := decode(repeat('00', 32), 'hex'); "
        "END IF;\n"
        "  WITH inserted AS (INSERT INTO {schema}.{events} "
        "(originator_id, originator_version, topic, state) "
        "SELECT u.i, u.v, u.t, u.s FROM unnest(ids, versions, topics, states) "
        "WITH ORDINALITY AS u(i, v, t, s, n) ORDER BY u.n RETURNING notification_id) "
        "SELECT array_agg(notification_id ORDER BY notification_id) INTO positions "
        "FROM inserted;\n"
        "  FOR i IN 1 .. coalesce(array_length(positions, 1), 0) LOOP\n"
        "    topic := convert_to(topics[i], 'UTF8');\n"
        "    previous[i] := prior_position;\n"
        "    prior := sha256(convert_to('secondbox-chain-v1', 'UTF8') || prior "
        "|| int8send(prior_position) || int8send(positions[i]) "
        "|| int8send(16::bigint) || uuid_send(ids[i]) || int8send(versions[i]) "
        "|| int8send(octet_length(topic)::bigint) || topic "
        "|| int8send(octet_length(states[i])::bigint) || states[i]);\n"
        "    digests[i] := prior;\n"
        "    prior_position := positions[i];\n"
        "  END LOOP;\n"
        "  INSERT INTO {schema}.{chain} SELECT * FROM unnest(positions, previous, digests);\n"
        "  PERFORM pg_notify({channel}, '');\n"
        "  RETURN QUERY SELECT * FROM unnest(positions, digests);\n"
        "END;$BODY$"
    ).format(
        schema=schema,
        append=append,
        lock=lock,
        chain=chain,
        events=events,
        channel=Literal(channel),
    )


def append_with_snapshots_function(events_table: str) -> str:
    return f"{events_table}_append_with_snapshots"


# the function's signature: the events' four arrays, the lock timeout, the snapshots' four
APPEND_WITH_SNAPSHOTS_ARGUMENTS = f"{APPEND_ARGUMENTS}, uuid[], bigint[], text[], bytea[]"


def append_with_snapshots_statement(
    schema: Identifier,
    append: Identifier,
    append_with_snapshots: Identifier,
    snapshots: Identifier,
    seals: Identifier,
) -> Composed:
    """``<events>_append_with_snapshots(ids, versions, topics, states, lock_timeout,
    snapshot_ids, snapshot_versions, snapshot_topics, snapshot_states)``: the events
    saved by ``<events>_append`` (lock, links, notification), then the snapshots and the
    seal of each one taken at an event of this save, computed as
    :meth:`~secondbox_scheduler.domain.audit.chain.Chain.seal` does from that event's new
    link. Returns what ``<events>_append`` returns. ``SECURITY DEFINER``; it refuses a
    snapshot that is not at an event of the same call (found by the red team: under
    ``SECURITY INVOKER`` with INSERT on the snapshots, the application role stored a
    runner's snapshot with nothing reserved, sealed from public data, and a fresh replica
    acted on it). A snapshot or a seal whose (id, version) is
    taken already (a row planted ahead) is skipped, not the save: the events commit, and
    the mismatched pair is refused when read (:mod:`.sealed_snapshots`)."""
    return SQL(
        "CREATE OR REPLACE FUNCTION {schema}.{append_with_snapshots}("
        "ids uuid[], versions bigint[], topics text[], states bytea[], lock_timeout text, "
        "snapshot_ids uuid[], snapshot_versions bigint[], snapshot_topics text[], "
        "snapshot_states bytea[]) "
        "RETURNS TABLE (appended bigint, link bytea) "
        "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $BODY$\n"
        "DECLARE\n"
        "  positions bigint[]; digests bytea[];\n"
        "BEGIN\n"
        + checked_snapshots_sql()
        + "  IF EXISTS (SELECT FROM unnest(snapshot_ids, snapshot_versions) AS u(i, v) "
        "WHERE NOT EXISTS (SELECT FROM unnest(ids, versions) AS e(i, v) "
        "WHERE e.i = u.i AND e.v = u.v)) THEN\n"
        "    RAISE EXCEPTION 'secondbox: a snapshot not at an event of this save';\n"
        "  END IF;\n"
        "  SELECT array_agg(a.appended ORDER BY a.appended), "
        "array_agg(a.link ORDER BY a.appended) INTO positions, digests "
        "FROM {schema}.{append}(ids, versions, topics, states, lock_timeout) AS a;\n"
        "  INSERT INTO {schema}.{snapshots} (originator_id, originator_version, topic, state) "
        "SELECT u.i, u.v, u.t, u.st FROM unnest(snapshot_ids, snapshot_versions, "
        "snapshot_topics, snapshot_states) AS u(i, v, t, st) ON CONFLICT DO NOTHING;\n"
        "  INSERT INTO {schema}.{seals} (originator_id, originator_version, seal) "
        "SELECT u.i, u.v, sha256(convert_to('secondbox-snapshot-seal-v1', 'UTF8') "
        "|| int8send(octet_length(e.link)::bigint) || e.link "
        "|| int8send(16::bigint) || uuid_send(u.i) || int8send(u.v) "
        "|| int8send(octet_length(convert_to(u.t, 'UTF8'))::bigint) || convert_to(u.t, 'UTF8') "
        "|| int8send(octet_length(u.st)::bigint) || u.st) "
        "FROM unnest(snapshot_ids, snapshot_versions, snapshot_topics, snapshot_states) "
        "AS u(i, v, t, st) JOIN unnest(ids, versions, digests) AS e(i, v, link) "
        "ON e.i = u.i AND e.v = u.v ON CONFLICT DO NOTHING;\n"
        "  RETURN QUERY SELECT * FROM unnest(positions, digests);\n"
        "END;$BODY$"
    ).format(
        schema=schema,
        append=append,
        append_with_snapshots=append_with_snapshots,
        snapshots=snapshots,
        seals=seals,
    )


def usable_in_server(datastore: Any, signature: str) -> bool:
    """Whether the server can make links and seals exactly as the client does (a UTF8
    database: ``convert_to(topic, 'UTF8')`` from another server encoding is not always
    Python's ``str.encode()``, some EUC_JP and EUC_KR characters convert differently)
    and this role may execute the function of ``signature`` (a schema an earlier
    release created, under a role that may not create it, has none)."""
    with datastore.get_connection() as conn, conn.cursor(row_factory=tuple_row) as curs:
        curs.execute(
            "SELECT current_setting('server_encoding') = 'UTF8' AND coalesce("
            "has_function_privilege(to_regprocedure(%s), 'EXECUTE'), false)",
            (signature,),
        )
        row = curs.fetchone()
    return bool(row is not None and row[0])


def writes_tables_itself(datastore: Any, table: str) -> bool:
    """Whether this role may INSERT into ``table`` of the store's schema itself (the
    schema owner may; the request-serving role, which writes only through the
    functions, may not: a save of its without them cannot succeed)."""
    with datastore.get_connection() as conn, conn.cursor(row_factory=tuple_row) as curs:
        curs.execute(
            "SELECT coalesce(has_table_privilege(to_regclass(%s), 'INSERT'), false)",
            (f'"{datastore.schema}"."{table}"',),
        )
        row = curs.fetchone()
    return bool(row is not None and row[0])
