"""The saves that PostgreSQL makes in one statement for an unkeyed chain (plpgsql
functions created with the tables by :mod:`.chained_postgres` and :mod:`.sealed_postgres`;
:mod:`.chained_postgres` calls them, and links or seals in the client where they are
absent, forbidden or the chain is keyed).

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
    keyed chain never sends its key to the server: it links in the client."""
    return SQL(
        "CREATE OR REPLACE FUNCTION {schema}.{append}("
        "ids uuid[], versions bigint[], topics text[], states bytea[], lock_timeout text) "
        "RETURNS TABLE (appended bigint, link bytea) "
        "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $BODY$\n"
        "DECLARE\n"
        "  positions bigint[]; previous bigint[]; digests bytea[];\n"
        "  prior_position bigint; prior bytea; topic bytea;\n"
        "BEGIN\n"
        "  PERFORM set_config('lock_timeout', lock_timeout, true);\n"
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
    link. Returns what ``<events>_append`` returns. ``SECURITY INVOKER``: it writes with
    the caller's own privileges. A snapshot or a seal whose (id, version) is taken
    already (a row planted ahead) is skipped, not the save: the events commit, and the
    mismatched pair is refused when read (:mod:`.sealed_snapshots`)."""
    return SQL(
        "CREATE OR REPLACE FUNCTION {schema}.{append_with_snapshots}("
        "ids uuid[], versions bigint[], topics text[], states bytea[], lock_timeout text, "
        "snapshot_ids uuid[], snapshot_versions bigint[], snapshot_topics text[], "
        "snapshot_states bytea[]) "
        "RETURNS TABLE (appended bigint, link bytea) "
        "LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $BODY$\n"
        "DECLARE\n"
        "  positions bigint[]; digests bytea[];\n"
        "BEGIN\n"
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
