"""Runner snapshots projection: one row per runner with every RunnerSnapshot field.

Fed by the Runner stream (registration, reservations, drain, allocatable,
deregistration) and the RunnerLease stream (heartbeats and evidence). Indexed by
(pool_name, architecture), which is how ``create_sandbox`` asks for candidates, and for
a refusal over a large pool (projections/unmatched.py) by the columns the refusal
compares, on SQLite by the artifact digests too, with a side table of the
materializations' digests kept by triggers. No index reads a column that a placement, a
release or a liveness heartbeat sets (recorded evidence changes the materializations,
which PostgreSQL's GIN index already read). Every
other event class is ignored with a reason (``IGNORED``); an event of an unknown class
is counted (:mod:`projections.unknown_events`).
"""

from __future__ import annotations

import json
from functools import singledispatchmethod
from typing import Any, ClassVar

from secondbox_scheduler.domain.access_tokens import ACCESS_TOKEN_EVENTS
from secondbox_scheduler.domain.cell_claims import CELL_CLAIM_EVENTS
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.ids import lease_uuid
from secondbox_scheduler.domain.lease import RunnerLease, materialization_snapshots
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    RunnerSnapshot,
)
from secondbox_scheduler.projections.row_changes import Insert, RowChange, Update
from secondbox_scheduler.projections.sql_view import (
    PostgresSqlView,
    Query,
    SQLiteSqlView,
    SqlProjection,
    SqlView,
    text_time,
    time_text,
    to_json,
)

DIMENSIONS = Capacity.DIMENSIONS
ALLOCATABLE = [f"allocatable_{dim}" for dim in DIMENSIONS]
RESERVED = [f"reserved_{dim}" for dim in DIMENSIONS]
_ALLOCATABLE_OF = tuple(zip(ALLOCATABLE, DIMENSIONS, strict=True))
_RESERVED_OF = tuple(zip(RESERVED, DIMENSIONS, strict=True))


class RunnerSnapshotsView(SqlView):
    projection_name = "runner_snapshots"
    table = "runner_snapshots"
    ddl: ClassVar[tuple[str, ...]] = (
        "CREATE TABLE IF NOT EXISTS {table} ("
        "runner_id TEXT PRIMARY KEY, stream_id TEXT NOT NULL UNIQUE, "
        "lease_id TEXT NOT NULL UNIQUE, pool_name TEXT NOT NULL, "
        "backend_kind TEXT NOT NULL, architecture TEXT NOT NULL, capabilities TEXT NOT NULL, "
        + "".join(f"{column} BIGINT NOT NULL, " for column in ALLOCATABLE + RESERVED)
        + "drain_phase TEXT NOT NULL, last_heartbeat_at TEXT, artifact_digests TEXT NOT NULL, "
        "materializations TEXT NOT NULL, supported_egress_contexts TEXT NOT NULL, "
        "guest_protocol_minimum BIGINT NOT NULL, guest_protocol_maximum BIGINT NOT NULL, "
        "deregistered INTEGER NOT NULL, version BIGINT NOT NULL, lease_version BIGINT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS runner_snapshots_pool_arch "
        "ON {table} (pool_name, architecture)",
    )
    keys = (("stream_id",), ("lease_id",))  # Runner events, RunnerLease events
    encoders = {
        "capabilities": to_json,
        "artifact_digests": to_json,
        "materializations": to_json,
        "supported_egress_contexts": to_json,
        "last_heartbeat_at": time_text,
    }

    def snapshots(
        self, pool_name: str | None = None, architecture: str | None = None
    ) -> list[RunnerSnapshot]:
        """Registered runners (of a pool, of an architecture), sorted by id."""
        where, params = ["deregistered = 0"], []
        if pool_name is not None:
            where.append("pool_name = %s")
            params.append(pool_name)
        if architecture is not None:
            where.append("architecture = %s")
            params.append(architecture)
        rows = self.query(
            f"SELECT * FROM {{table}} WHERE {' AND '.join(where)} ORDER BY runner_id", params
        )
        return [row_to_snapshot(row) for row in rows]

    # Dialect of the candidate queries (projections/candidates.py).
    id_order: ClassVar[str] = "runner_id"  # ordered like Python's str (code points)
    contains: ClassVar[str] = "INSTR({column}, %s) > 0"  # case-sensitive substring test
    # A subquery the planner must not merge into the outer query (its expressions are
    # computed once per row), and text compared byte by byte (projections/unmatched.py).
    subquery_fence: ClassVar[str] = " LIMIT -1 OFFSET 0"
    byte_collation: ClassVar[str] = ""  # SQLite's default, BINARY
    parallel_reads: ClassVar[bool] = False  # two reads at once gain nothing here

    def snapshot(self, runner_id: str) -> RunnerSnapshot | None:
        rows = self.query(
            "SELECT * FROM {table} WHERE runner_id = %s AND deregistered = 0", [runner_id]
        )
        return row_to_snapshot(rows[0]) if rows else None

    def rows(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM {table} ORDER BY runner_id")

    # The numbers 1 to %s as a table ``n(i)`` (copy_row).
    series: ClassVar[str] = (
        "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < %s) "
        "SELECT i FROM n) AS n"
    )

    def copy_row(self, runner_id: str, prefix: str, count: int, *, instances: int) -> None:
        """Write ``count`` copies of a runner's row, ids ``prefix1`` to ``prefix<count>``,
        offering ``instances``: rows of no stream, for the benchmark's large pool only
        (``projections verify`` reports them)."""
        columns = [
            column
            for column in (
                "pool_name",
                "backend_kind",
                "architecture",
                "capabilities",
                *ALLOCATABLE,
                *RESERVED,
                "drain_phase",
                "last_heartbeat_at",
                "artifact_digests",
                "materializations",
                "supported_egress_contexts",
                "guest_protocol_minimum",
                "guest_protocol_maximum",
                "deregistered",
                "version",
                "lease_version",
            )
            if column != "allocatable_instances"
        ]
        with self.datastore.transaction(commit=True) as cursor:  # type: ignore[attr-defined]
            cursor.execute(
                self._sql(
                    self._format(
                        "INSERT INTO {table} (runner_id, stream_id, lease_id, "
                        f"allocatable_instances, {', '.join(columns)}) "
                        "SELECT CAST(%s AS TEXT) || n.i, 'copy-' || CAST(%s AS TEXT) || n.i, "
                        "'copy-lease-' || CAST(%s AS TEXT) || n.i, "
                        f"%s, {', '.join(columns)} FROM {{table}}, {self.series} "
                        "WHERE runner_id = %s"
                    )
                ),
                (prefix, prefix, prefix, instances, count, runner_id),
            )

    def materialization_test(self, runtime: str, toolchain: str) -> tuple[str, list[Any]]:
        """SQL true whenever a row's materializations hold an item of these runtime and
        toolchain digests (a necessary condition of the materialization rule), and its
        params: on SQLite both digests' JSON strings in the text."""
        test = self.contains.format(column="materializations")
        return f"{test} AND {test}", [json.dumps(runtime), json.dumps(toolchain)]

    def materialized_nowhere(self, runtime: str, toolchain: str) -> bool:
        """True when provably no row holds a materialization of these digests (one
        index look-up); False when one may (then ``materialization_test`` decides)."""
        return False

    def materialization_digests(self) -> dict[str, list[tuple[str, str]]] | None:
        """Per runner id, the (runtime, toolchain) digests of its materializations as
        the side table of :meth:`materialized_nowhere` holds them (``projections
        verify`` compares them with the rows); None where there is no such table."""
        return None

    # The columns the rules left to Python read (projections/unmatched.py), in the order
    # of the SQLite index that answers :meth:`alike_in_pool`.
    ALIKE: ClassVar[tuple[str, ...]] = (
        "backend_kind",
        "architecture",
        "capabilities",
        "materializations",
        "supported_egress_contexts",
    )

    def alike_in_pool(self, pool_name: str, query: Query) -> tuple[str, ...] | None:
        """The :attr:`ALIKE` values when every registered runner of the pool has the same
        (two index look-ups by ``query``); None when they differ, the pool is empty, or
        no index answers it here (then projections/unmatched.py compares them in its
        survey)."""
        return None

    def one_locality_in_pool(self, pool_name: str, query: Query) -> bool:
        """True when every registered runner of the pool has the same artifact digests
        (two index look-ups by ``query``: then one locality bound for all); False when
        they differ or no index answers it here."""
        return False


# SQLite: the digests of every row's materializations in a side table, indexed, kept
# by triggers in the transaction that writes the row (a row's insert, a change of its
# materializations, its delete: the rebuild's clear), so that a toolchain digest no
# runner has is found absent in one index look-up (projections/unmatched.py). A
# placement's update sets neither column: no trigger fires. When the table is new (or
# empty) it is filled from the rows already there.
MATERIALIZATION_DIGESTS = "runner_materialization_digests"
_DIGESTS_OF = (
    f"INSERT INTO {MATERIALIZATION_DIGESTS} (runner_id, runtime_digest, toolchain_digest) "
    "SELECT {row}.runner_id, json_extract(item.value, '$.runtime_digest'), "
    "json_extract(item.value, '$.toolchain_digest') FROM json_each({row}.materializations) "
    "AS item"
)
_DIGESTS_DDL = (
    f"CREATE TABLE IF NOT EXISTS {MATERIALIZATION_DIGESTS} (runner_id TEXT NOT NULL, "
    "runtime_digest TEXT, toolchain_digest TEXT)",
    f"CREATE INDEX IF NOT EXISTS {MATERIALIZATION_DIGESTS}_digests "
    f"ON {MATERIALIZATION_DIGESTS} (toolchain_digest, runtime_digest)",
    f"CREATE INDEX IF NOT EXISTS {MATERIALIZATION_DIGESTS}_runner "
    f"ON {MATERIALIZATION_DIGESTS} (runner_id)",
    f"CREATE TRIGGER IF NOT EXISTS {MATERIALIZATION_DIGESTS}_insert AFTER INSERT ON {{table}} "
    f"BEGIN {_DIGESTS_OF.format(row='NEW')}; END",
    f"CREATE TRIGGER IF NOT EXISTS {MATERIALIZATION_DIGESTS}_update "
    "AFTER UPDATE OF runner_id, materializations ON {table} "
    f"BEGIN DELETE FROM {MATERIALIZATION_DIGESTS} WHERE runner_id = OLD.runner_id; "
    f"{_DIGESTS_OF.format(row='NEW')}; END",
    f"CREATE TRIGGER IF NOT EXISTS {MATERIALIZATION_DIGESTS}_delete AFTER DELETE ON {{table}} "
    f"BEGIN DELETE FROM {MATERIALIZATION_DIGESTS} WHERE runner_id = OLD.runner_id; END",
    _DIGESTS_OF.format(row="snap").replace("FROM json_each", "FROM {table} AS snap, json_each", 1)
    + f" WHERE NOT EXISTS (SELECT 1 FROM {MATERIALIZATION_DIGESTS})",
)


class SQLiteRunnerSnapshotsView(RunnerSnapshotsView, SQLiteSqlView):
    # The registered runners of each pool sorted by the ALIKE columns (BINARY: bytes),
    # so that the first and the last are equal exactly when all are: a refusal's survey
    # then leaves the texts out (projections/unmatched.py); and by the artifact digests.
    # A placement, a release or a liveness heartbeat sets none of these columns: SQLite
    # leaves the indexes alone.
    ddl = (
        *RunnerSnapshotsView.ddl,
        "CREATE INDEX IF NOT EXISTS runner_snapshots_alike ON {table} (pool_name, "
        + ", ".join(RunnerSnapshotsView.ALIKE)
        + ") WHERE deregistered = 0",
        "CREATE INDEX IF NOT EXISTS runner_snapshots_artifacts ON {table} "
        "(pool_name, artifact_digests) WHERE deregistered = 0",
        *_DIGESTS_DDL,
    )

    def alike_in_pool(self, pool_name: str, query: Query) -> tuple[str, ...] | None:
        ends = _index_ends(query, pool_name, self.ALIKE)
        return None if ends is None else tuple(ends[column] for column in self.ALIKE)

    def one_locality_in_pool(self, pool_name: str, query: Query) -> bool:
        return _index_ends(query, pool_name, ("artifact_digests",)) is not None

    def materialized_nowhere(self, runtime: str, toolchain: str) -> bool:
        rows = self.query(
            f"SELECT 1 AS found FROM {MATERIALIZATION_DIGESTS} "
            "WHERE toolchain_digest = %s AND runtime_digest = %s LIMIT 1",
            [toolchain, runtime],
        )
        return not rows

    def materialization_digests(self) -> dict[str, list[tuple[str, str]]] | None:
        rows = self.query(
            f"SELECT runner_id, runtime_digest, toolchain_digest FROM {MATERIALIZATION_DIGESTS}"
        )
        digests: dict[str, list[tuple[str, str]]] = {}
        for row in rows:
            pair = (row["runtime_digest"], row["toolchain_digest"])
            digests.setdefault(row["runner_id"], []).append(pair)
        return {runner_id: sorted(pairs) for runner_id, pairs in digests.items()}


def _index_ends(
    query: Query,
    pool_name: str,
    columns: tuple[str, ...],
    collate: str = "",
    indexed: str = "",
) -> dict[str, Any] | None:
    """The values of ``columns`` when the first and the last registered runners of the
    pool by them (an index's ends: texts compared byte by byte, ``collate``; the rows of
    a partial index, ``indexed``) have the same, so that every runner between has them;
    None when they differ or the pool has no such runner."""
    ends = [
        query(
            f"SELECT {', '.join(columns)} FROM {{table}} WHERE pool_name = %s AND "
            f"deregistered = 0{indexed} ORDER BY "
            + ", ".join(f"{column}{collate}{direction}" for column in columns)
            + " LIMIT 1",
            [pool_name],
        )
        for direction in ("", " DESC")
    ]
    if not ends[0] or ends[0] != ends[1]:
        return None
    return ends[0][0]


# PostgreSQL: a B-tree entry holds at most about 2,700 bytes, so its index of the ALIKE
# columns holds the rows whose texts are shorter than this (all but a runner of
# unusually many materializations), and a second index the others' pools: a pool with
# one of those is surveyed with its texts.
_SHORT = (
    "octet_length(pool_name) + "
    + " + ".join(f"octet_length({column})" for column in RunnerSnapshotsView.ALIKE)
    + " < 2000"
)


class PostgresRunnerSnapshotsView(RunnerSnapshotsView, PostgresSqlView):
    # The materializations as jsonb, indexed, so that a digest no runner has is found
    # absent without a scan of the pool (projections/unmatched.py).
    # The ALIKE index as on SQLite (projections/unmatched.py): no placement, release or
    # liveness heartbeat sets a column these indexes read, so such an update stays HOT.
    ddl = (
        *RunnerSnapshotsView.ddl,
        "CREATE INDEX IF NOT EXISTS runner_snapshots_materializations "
        "ON {table} USING gin ((materializations::jsonb) jsonb_path_ops)",
        "CREATE INDEX IF NOT EXISTS runner_snapshots_alike ON {table} (pool_name, "
        + ", ".join(f'{column} COLLATE "C"' for column in RunnerSnapshotsView.ALIKE)
        + f") WHERE deregistered = 0 AND {_SHORT}",
        "CREATE INDEX IF NOT EXISTS runner_snapshots_alike_long ON {table} (pool_name) "
        f"WHERE deregistered = 0 AND NOT ({_SHORT})",
    )
    id_order = 'runner_id COLLATE "C"'  # byte order of UTF-8 = Python's str order
    contains = "STRPOS({column}, %s) > 0"
    subquery_fence = " OFFSET 0"
    byte_collation = ' COLLATE "C"'
    parallel_reads = True  # a connection each, served by two server processes
    series = "generate_series(1, %s) AS n(i)"

    def alike_in_pool(self, pool_name: str, query: Query) -> tuple[str, ...] | None:
        long = query(
            "SELECT 1 AS found FROM {table} WHERE pool_name = %s AND deregistered = 0 "
            f"AND NOT ({_SHORT}) LIMIT 1",
            [pool_name],
        )
        if long:
            return None
        ends = _index_ends(query, pool_name, self.ALIKE, self.byte_collation, f" AND {_SHORT}")
        return None if ends is None else tuple(ends[column] for column in self.ALIKE)

    def materialization_test(self, runtime: str, toolchain: str) -> tuple[str, list[Any]]:
        """jsonb containment of an item of both digests: answered by the GIN index."""
        item = {"runtime_digest": runtime, "toolchain_digest": toolchain}
        return "(materializations::jsonb) @> %s::jsonb", [json.dumps([item])]


def row_to_snapshot(row: dict[str, Any]) -> RunnerSnapshot:
    return RunnerSnapshot.model_construct(
        id=row["runner_id"],
        pool_name=row["pool_name"],
        backend_kind=row["backend_kind"],
        architecture=row["architecture"],
        capabilities=frozenset(json.loads(row["capabilities"])),
        allocatable=Capacity.of({dim: row[f"allocatable_{dim}"] for dim in DIMENSIONS}),
        reserved=Capacity.of({dim: row[f"reserved_{dim}"] for dim in DIMENSIONS}),
        drain_phase=row["drain_phase"],
        last_heartbeat_at=text_time(row["last_heartbeat_at"]),
        artifact_digests=tuple(json.loads(row["artifact_digests"])),
        materializations=materialization_snapshots(json.loads(row["materializations"])),
        supported_egress_contexts=tuple(json.loads(row["supported_egress_contexts"])),
        guest_protocol_minimum=row["guest_protocol_minimum"],
        guest_protocol_maximum=row["guest_protocol_maximum"],
    )


def _runner_update(event: Any, **columns: Any) -> Update:
    return Update(
        ("stream_id",),
        (event.originator_id.hex,),
        {**columns, "version": event.originator_version},
    )


def _lease_update(event: Any, **columns: Any) -> Update:
    return Update(
        ("lease_id",),
        (event.originator_id.hex,),
        {**columns, "lease_version": event.originator_version},
    )


class RunnerSnapshotsProjection(SqlProjection[RunnerSnapshotsView]):
    """Folds Runner and RunnerLease events into runner snapshot rows."""

    name = "runner_snapshots"

    IGNORED = {
        RunnerLease.Opened: (
            "the row and its lease id are made at Runner.Registered, its heartbeat and "
            "evidence empty; opening the lease sets none of them"
        ),
        **dict.fromkeys(
            (
                Sandbox.Created,
                Sandbox.AssignmentFenced,
                Sandbox.AssignmentRunning,
                Sandbox.AssignmentReleased,
                Sandbox.AssignmentFailed,
                Sandbox.ReconcileClaimed,
                Sandbox.ReconcileClaimReleased,
                Sandbox.AssignmentUncertain,
                Sandbox.ReconcileScheduled,
                Sandbox.GenerationAdvanced,
            ),
            "a sandbox's events change no runner row: the runner's own stream records what "
            "it reserves and releases (Runner.CapacityReserved, Runner.CapacityReleased)",
        ),
        **dict.fromkeys(
            (RefusalLog.Opened, RefusalLog.Refused), "a refusal reserves nothing on a runner"
        ),
        FencingTokenUse.Used: "the index of fencing tokens used changes no runner",
        **dict.fromkeys(
            ACCESS_TOKEN_EVENTS,
            "an access token changes no runner (a runner token names runner ids only)",
        ),
        **dict.fromkeys(CELL_CLAIM_EVENTS, "a cell claim changes no runner"),
    }

    @singledispatchmethod
    def changes(self, event: Any) -> list[RowChange]:
        return self.unhandled(event)  # ignored (only the position moves), or unknown

    @changes.register
    def _(self, event: Runner.Registered) -> list[RowChange]:
        allocatable = event.allocatable
        row: dict[str, Any] = {
            "runner_id": event.runner_id,
            "stream_id": event.originator_id.hex,
            "lease_id": lease_uuid(event.runner_id).hex,
            "pool_name": event.pool_name,
            "backend_kind": event.backend_kind,
            "architecture": event.architecture,
            "capabilities": sorted(event.capabilities),
        }
        for column, dim in _ALLOCATABLE_OF:
            row[column] = allocatable[dim]
        for column in RESERVED:
            row[column] = 0
        row.update(
            drain_phase=DRAIN_PHASE_ACTIVE,
            last_heartbeat_at=None,
            artifact_digests=[],
            materializations=[],
            supported_egress_contexts=sorted(event.supported_egress_contexts),
            guest_protocol_minimum=event.guest_protocol_minimum,
            guest_protocol_maximum=event.guest_protocol_maximum,
            deregistered=0,
            version=event.originator_version,
            lease_version=0,
        )
        return [Insert(row)]

    @changes.register
    def _(self, event: Runner.CapacityReserved) -> list[RowChange]:
        return [_capacity_delta(event, event.capacity, +1)]

    @changes.register
    def _(self, event: Runner.CapacityReleased) -> list[RowChange]:
        return [_capacity_delta(event, event.capacity, -1)]

    @changes.register
    def _(self, event: Runner.DrainStarted) -> list[RowChange]:
        return [_runner_update(event, drain_phase=DRAIN_PHASE_DRAINING)]

    @changes.register
    def _(self, event: Runner.DrainCancelled) -> list[RowChange]:
        return [_runner_update(event, drain_phase=DRAIN_PHASE_ACTIVE)]

    @changes.register
    def _(self, event: Runner.AllocatableChanged) -> list[RowChange]:
        allocatable = {column: event.allocatable[dim] for column, dim in _ALLOCATABLE_OF}
        return [_runner_update(event, **allocatable)]

    @changes.register
    def _(self, event: Runner.Deregistered) -> list[RowChange]:
        return [_runner_update(event, deregistered=1)]

    @changes.register
    def _(self, event: RunnerLease.LivenessRenewed) -> list[RowChange]:
        return [_lease_update(event, last_heartbeat_at=event.at)]

    @changes.register
    def _(self, event: RunnerLease.EvidenceRecorded) -> list[RowChange]:
        return [
            _lease_update(
                event,
                last_heartbeat_at=event.at,
                artifact_digests=event.artifact_digests,
                materializations=[dict(item) for item in event.materializations],
            )
        ]


def _capacity_delta(event: Any, capacity: dict[str, int], sign: int) -> Update:
    return Update(
        ("stream_id",),
        (event.originator_id.hex,),
        {"version": event.originator_version},
        {column: sign * capacity[dim] for column, dim in _RESERVED_OF},
    )
