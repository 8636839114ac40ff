"""The saves of a keyed chain through functions of the schema owner (plpgsql, created
with the tables by :mod:`.chained_postgres`; ``SECURITY DEFINER``, ``search_path``
pinned, arguments checked).

A keyed chain's links are HMACs whose key never reaches the server, and each link
covers its event's position, which only the server assigns (from the events table's
sequence). So a keyed save is two calls in one transaction, pipelined (two round trips,
as the client's own linking was):

- ``<events>_insert(ids, versions, topics, states, lock_timeout)`` takes the events
  table's lock, inserts the events, notifies, and returns each new position with the
  chain's head (position and digest) before them;
- ``<events>_link(positions, previous, digests, prior, snapshot ids, versions,
  topics, states, seals)`` stores the links the client computed, after checking that
  they continue the chain: the first names the stored head (its position as
  ``previous``, its digest as ``prior``), each next one names the one before, and the
  positions are exactly the events stored after the head, every one of them. It then
  stores the snapshots taken at those events with the seals the client computed
  (a snapshot at any other event is refused).

The server cannot check an HMAC; ``audit verify`` does, with the key. What it refuses
is what no key can excuse: a link at a position with no event (the red team's one
far-future link made verify report false "deleted" findings and stop checking digests),
a link that does not continue the head, and snapshots at old events.
"""

from __future__ import annotations

from psycopg.sql import SQL, Composed, Identifier, Literal

from secondbox_scheduler.infrastructure.store.server_append import (
    checked_events_sql,
    checked_snapshots_sql,
)

INSERT_ARGUMENTS = "uuid[], bigint[], text[], bytea[], text"
LINK_ARGUMENTS = "bigint[], bigint[], bytea[], bytea, uuid[], bigint[], text[], bytea[], bytea[]"


def insert_function(events_table: str) -> str:
    return f"{events_table}_insert"


def link_function(events_table: str) -> str:
    return f"{events_table}_link"


def insert_function_statement(
    schema: Identifier,
    events: Identifier,
    chain: Identifier,
    lock: Identifier,
    insert: Identifier,
    channel: str,
) -> Composed:
    """``<events>_insert``: lock, the chain's head, the events, the notification."""
    return SQL(
        "CREATE OR REPLACE FUNCTION {schema}.{insert}("
        "ids uuid[], versions bigint[], topics text[], states bytea[], lock_timeout text) "
        "RETURNS TABLE (appended bigint, head_position bigint, head bytea) "
        "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $BODY$\n"
        "DECLARE\n"
        "  prior_position bigint; prior bytea;\n"
        "BEGIN\n"
        + checked_events_sql()
        + "  PERFORM set_config('lock_timeout', lock_timeout, true);\n"
        "  PERFORM {schema}.{lock}();\n"
        "  SELECT c.position, c.digest INTO prior_position, prior FROM {schema}.{chain} c "
        "ORDER BY c.position DESC LIMIT 1;\n"
        "  PERFORM pg_notify({channel}, '');\n"
        "  RETURN QUERY WITH inserted AS (INSERT INTO {schema}.{events} "
        "(originator_id, originator_version, topic, state) "
        "SELECT u.i, u.v, u.t, u.s FROM unnest(ids, versions, topics, states) "
        "WITH ORDINALITY AS u(i, v, t, s, n) ORDER BY u.n RETURNING notification_id) "
        "SELECT notification_id, prior_position, prior FROM inserted ORDER BY notification_id;\n"
        "END;$BODY$"
    ).format(
        schema=schema, insert=insert, lock=lock, chain=chain, events=events,
        channel=Literal(channel),
    )  # fmt: skip


def link_function_statement(
    schema: Identifier,
    events: Identifier,
    chain: Identifier,
    lock: Identifier,
    link: Identifier,
    snapshots: Identifier,
    seals: Identifier,
) -> Composed:
    """``<events>_link``: the client's links, checked to continue the stored head, and
    the snapshots at their events with the client's seals."""
    return SQL(
        "CREATE OR REPLACE FUNCTION {schema}.{link}("
        "positions bigint[], previous bigint[], digests bytea[], prior bytea, "
        "snapshot_ids uuid[], snapshot_versions bigint[], snapshot_topics text[], "
        "snapshot_states bytea[], seals bytea[]) RETURNS void "
        "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $BODY$\n"
        "DECLARE\n"
        "  n integer; head_position bigint; head bytea; floor_position bigint;\n"
        "BEGIN\n"
        "  n := coalesce(cardinality(positions), 0);\n"
        "  IF n = 0 OR previous IS NULL OR digests IS NULL OR cardinality(previous) <> n "
        "OR cardinality(digests) <> n OR array_position(positions, NULL) IS NOT NULL "
        "OR array_position(previous, NULL) IS NOT NULL "
        "OR EXISTS (SELECT FROM unnest(digests) AS d WHERE d IS NULL OR octet_length(d) <> 32) "
        "THEN\n"
        "    RAISE EXCEPTION 'secondbox: malformed links';\n"
        "  END IF;\n"
        + checked_snapshots_sql("seals")
        + "  PERFORM {schema}.{lock}();\n"
        "  SELECT c.position, c.digest INTO head_position, head FROM {schema}.{chain} c "
        "ORDER BY c.position DESC LIMIT 1;\n"
        "  IF NOT FOUND THEN head_position := 0; head := NULL; END IF;\n"
        "  IF previous[1] <> head_position OR prior IS DISTINCT FROM head THEN\n"
        "    RAISE EXCEPTION 'secondbox: the links do not continue the chain (its head is "
        "at position %)', head_position;\n"
        "  END IF;\n"
        "  FOR i IN 1 .. n LOOP\n"
        "    IF positions[i] <= (CASE WHEN i = 1 THEN head_position ELSE positions[i - 1] END) "
        "OR (i > 1 AND previous[i] <> positions[i - 1]) THEN\n"
        "      RAISE EXCEPTION 'secondbox: the links do not follow one another';\n"
        "    END IF;\n"
        "  END LOOP;\n"
        # the events after the head, every one of them (no head: from before the chain)
        "  floor_position := CASE WHEN head_position > 0 THEN head_position "
        "ELSE positions[1] - 1 END;\n"
        "  IF (SELECT count(*) FROM {schema}.{events} e WHERE e.notification_id > floor_position "
        "AND e.notification_id <= positions[n]) <> n OR (SELECT count(*) FROM "
        "{schema}.{events} e WHERE e.notification_id = ANY(positions)) <> n THEN\n"
        "    RAISE EXCEPTION 'secondbox: the links are not those of the events after the head';\n"
        "  END IF;\n"
        "  INSERT INTO {schema}.{chain} SELECT * FROM unnest(positions, previous, digests);\n"
        "  IF cardinality(snapshot_ids) > 0 THEN\n"
        "    IF (SELECT count(*) FROM unnest(snapshot_ids, snapshot_versions) AS u(i, v) "
        "JOIN {schema}.{events} e ON e.originator_id = u.i AND e.originator_version = u.v "
        "WHERE e.notification_id = ANY(positions)) <> cardinality(snapshot_ids) THEN\n"
        "      RAISE EXCEPTION 'secondbox: a snapshot not at an event of this save';\n"
        "    END IF;\n"
        "    INSERT INTO {schema}.{snapshots} (originator_id, originator_version, topic, state) "
        "SELECT * FROM unnest(snapshot_ids, snapshot_versions, snapshot_topics, "
        "snapshot_states);\n"
        "    INSERT INTO {schema}.{seals} (originator_id, originator_version, seal) "
        "SELECT * FROM unnest(snapshot_ids, snapshot_versions, seals);\n"
        "  END IF;\n"
        "END;$BODY$"
    ).format(
        schema=schema, link=link, lock=lock, chain=chain, events=events,
        snapshots=snapshots, seals=seals,
    )  # fmt: skip
