"""The batch's lookups read the events table through its primary key even before the
table has statistics.

A young store (a new deployment, the first minute after a large import: autovacuum has
not analysed the table yet) has no statistics, and the planner then guesses hundreds of
events per stream. Written as joins over a list of streams, the batch's lookups were
planned as a hash of the whole events table: 14 to 55 ms each at 35,000 to 100,000
events, a quarter of the batched bench's time. Each is now written so that it can only
probe the index; these tests read the plans on a table the planner knows nothing about.
On the old statements the events-after test fails at 16 and 64 streams and the
last-versions test at 64; the chain-digests lookup was planned through the indexes
before its rewrite too (its test guards the new form, prepared with constant text).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.sql import SQL, Composed, Identifier

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.store.chain_tables import chain_table
from secondbox_scheduler.infrastructure.store.fast_forward import select_after_statement
from secondbox_scheduler.infrastructure.store.postgres_chain_sql import chain_digests_statement
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from secondbox_scheduler.projections.event_log import last_versions_statement
from tests.conftest import PostgresSchema

EVENTS = "schedulerapplication_events"
FILLER = 40_000  # streams of one event each


@pytest.fixture
def unanalysed(postgres_schema: PostgresSchema) -> Iterator[psycopg.Connection[Any]]:
    """The scheduler's tables with 40,000 events and links, never analysed."""
    SchedulerApplication(env=postgres_schema.env()).close()  # creates the tables
    schema = Identifier(postgres_schema.name)
    events, chain = Identifier(EVENTS), Identifier(chain_table(EVENTS))
    with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
        for table in (events, chain):
            conn.execute(
                SQL("ALTER TABLE {}.{} SET (autovacuum_enabled = off)").format(schema, table)
            )
        conn.execute(
            SQL(
                "INSERT INTO {}.{} (originator_id, originator_version, topic, state) "
                "SELECT md5(n::text)::uuid, 1, 'filler', '\\x00'::bytea "
                "FROM generate_series(1, %s) AS n"
            ).format(schema, events),
            (FILLER,),
        )
        conn.execute(
            SQL(
                "INSERT INTO {}.{} SELECT notification_id, notification_id - 1, '\\x00'::bytea "
                "FROM {}.{}"
            ).format(schema, chain, schema, events)
        )
        yield conn


def _plan(conn: psycopg.Connection[Any], statement: Composed, params: list[Any]) -> str:
    row = conn.execute(SQL("EXPLAIN (FORMAT JSON) ") + statement, params).fetchone()
    assert row is not None
    return json.dumps(row[0])


def _streams(count: int) -> list[uuid.UUID]:
    return [uuid.UUID(hex=uuid.uuid4().hex) for _ in range(count)]


@pytest.mark.parametrize("streams", [16, 64])
def test_the_events_after_cached_versions_are_read_through_the_index(
    unanalysed: psycopg.Connection[Any], postgres_schema: PostgresSchema, streams: int
) -> None:
    statement = select_after_statement(postgres_schema.name, EVENTS)
    plan = _plan(unanalysed, statement, [_streams(streams), [1] * streams])
    assert "Seq Scan" not in plan
    assert f'"{EVENTS}_pkey"' in plan


@pytest.mark.parametrize("streams", [16, 64])
def test_the_chain_digests_of_saved_events_are_read_through_the_indexes(
    unanalysed: psycopg.Connection[Any], postgres_schema: PostgresSchema, streams: int
) -> None:
    names = {
        "schema": Identifier(postgres_schema.name),
        "events": Identifier(EVENTS),
        "chain": Identifier(chain_table(EVENTS)),
    }
    plan = _plan(unanalysed, chain_digests_statement(names), [_streams(streams), [1] * streams])
    assert "Seq Scan" not in plan


@pytest.mark.parametrize("streams", [16, 64])
def test_the_last_versions_of_streams_are_read_through_the_index(
    unanalysed: psycopg.Connection[Any], postgres_schema: PostgresSchema, streams: int
) -> None:
    statement = last_versions_statement(postgres_schema.name, EVENTS)
    plan = _plan(unanalysed, statement, [_streams(streams)])
    assert "Seq Scan" not in plan
    assert f'"{EVENTS}_pkey"' in plan


SNAPSHOTS = "schedulerapplication_snapshots"


def _rows_read(node: dict[str, Any], relation: str) -> float:
    """Rows the plan read from ``relation`` (all loops), from EXPLAIN ANALYZE."""
    own = 0.0
    if node.get("Relation Name") == relation:
        own = float(node.get("Actual Rows", 0)) * float(node.get("Actual Loops", 1))
    return own + sum(_rows_read(child, relation) for child in node.get("Plans", []))


def test_the_latest_snapshot_of_a_long_history_is_read_alone_with_statistics(
    postgres_schema: PostgresSchema,
) -> None:
    """A runner with 3,000 snapshots (30,000 events), the tables analysed as autovacuum
    would: the cold load's latest-snapshot query (and the batch loader's) read one
    snapshot row, not all of the stream's joined to their events before the limit
    (what a full bench found: 42 ms for a runner with 100,000 events, not 0.8)."""
    app = SchedulerApplication(env=postgres_schema.env())
    try:
        schema = Identifier(postgres_schema.name)
        stream = uuid.uuid4()
        names = {
            "events": Identifier(EVENTS),
            "chain": Identifier(chain_table(EVENTS)),
            "snapshots": Identifier(SNAPSHOTS),
        }
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            conn.execute(
                SQL(
                    "INSERT INTO {s}.{events} (originator_id, originator_version, topic, state) "
                    "SELECT %s, n, 'filler', '\\x00'::bytea FROM generate_series(1, 30000) n"
                ).format(s=schema, **names),
                (stream,),
            )
            conn.execute(
                SQL(
                    "INSERT INTO {s}.{chain} SELECT notification_id, notification_id - 1, "
                    "'\\x00'::bytea FROM {s}.{events}"
                ).format(s=schema, **names)
            )
            conn.execute(
                SQL(
                    "INSERT INTO {s}.{snapshots} (originator_id, originator_version, topic, "
                    "state) SELECT %s, n * 10, 'snap', '\\x00'::bytea "
                    "FROM generate_series(1, 3000) n"
                ).format(s=schema, **names),
                (stream,),
            )
            conn.execute(SQL("ANALYZE {s}.{events}, {s}.{snapshots}").format(s=schema, **names))
            assert app.snapshots is not None
            recorder = app.snapshots.recorder
            assert isinstance(recorder, SealedPostgresSnapshots)
            statement, params = recorder.select_statement(stream, desc=True, limit=1)
            for query, values in (
                (statement, params),
                (SQL(recorder._statements["latest_and_after"].decode()), [[stream], [stream]]),
            ):
                row = conn.execute(
                    SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + query, values
                ).fetchone()
                assert row is not None
                assert _rows_read(row[0][0]["Plan"], SNAPSHOTS) <= 1
    finally:
        app.close()
