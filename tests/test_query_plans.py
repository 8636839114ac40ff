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

from secondbox_scheduler.domain.values import Requirements
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.store.chain_tables import chain_table
from secondbox_scheduler.infrastructure.store.fast_forward import select_after_statement
from secondbox_scheduler.infrastructure.store.postgres_chain_sql import chain_digests_statement
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from secondbox_scheduler.projections.event_log import last_versions_statement
from secondbox_scheduler.projections.runner_snapshots import POOL_SAMPLE
from secondbox_scheduler.projections.unmatched import (
    lookup_statement,
    pool_checks,
    unmatched_refusal,
)
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


RUNNERS = 20_000  # one pool's runner snapshots
NOBODY = "sha256:no-runner-has"


@pytest.mark.parametrize("analysed", [False, True])
@pytest.mark.parametrize(
    ("overrides", "index"),
    [
        ({"preferred_artifact_digests": ("sha256:r", NOBODY)}, "materializations"),
        ({"required_capabilities": frozenset({"gpu"})}, "capabilities"),
    ],
)
def test_a_requirement_no_runner_has_is_found_absent_through_a_gin_index(
    postgres_schema: PostgresSchema, analysed: bool, overrides: dict[str, Any], index: str
) -> None:
    """20,000 runners, every one with the prerequisites and a materialization of
    ``sha256:r``/``sha256:t``: the lookups of ``projections/unmatched.py`` find the
    toolchain (or capability) asked for absent by its GIN index after the pool's first
    64 rows, with or without statistics (without, the planner read the whole pool
    through its btree index until the containment was fenced off); so create_sandbox
    refuses without paging through the pool."""
    app = SchedulerApplication(env=postgres_schema.env())
    try:
        assert app.read_models is not None
        view = app.read_models.runners
        table = SQL(view._format("{table}"))
        capabilities = '["cleanup","compute","local-workspace","network-policy","storage"]'
        materializations = (
            '[{"architecture":"x86_64","backend_kind":"firecracker","digest":"sha256:m",'
            '"runtime_digest":"sha256:r","toolchain_digest":"sha256:t"}]'
        )
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            conn.execute(SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(table))
            conn.execute(
                SQL(
                    "INSERT INTO {} SELECT 'r-' || n, md5(n::text), md5('l' || n), 'big', "
                    "'firecracker', 'x86_64', %s, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 'active', "
                    "'2030-01-01T00:00:00.000000Z', '[]', %s, '[\"default\"]', 1, 3, 0, 1, 1 "
                    "FROM generate_series(1, %s) AS n"
                ).format(table),
                (capabilities, materializations, RUNNERS),
            )
            if analysed:
                conn.execute(SQL("ANALYZE {}").format(table))
            requirements = Requirements(
                pool_name="big", architecture="x86_64", guest_protocol_generation=2, **overrides
            )
            checks = pool_checks(view, requirements)
            statement, params = lookup_statement(checks)
            row = conn.execute(
                SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + SQL(view._format(statement)), params
            ).fetchone()
            assert row is not None
            plan = row[0][0]["Plan"]
            assert f'"runner_snapshots_{index}_gin"' in json.dumps(plan)
            # the pool's first rows, then the index: never the pool's 20,000 rows
            assert _rows_read(plan, "runner_snapshots") <= POOL_SAMPLE * len(checks)
            assert unmatched_refusal(view, requirements) is not None
    finally:
        app.close()
