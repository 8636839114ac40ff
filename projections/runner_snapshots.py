"""Runner snapshots projection: one row per runner with every RunnerSnapshot field.

Fed by the Runner stream (registration, reservations, drain, allocatable,
deregistration) and the RunnerLease stream (heartbeats and evidence). Indexed by
(pool_name, architecture), which is how ``create_sandbox`` asks for candidates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import singledispatchmethod
from typing import Any, ClassVar

from secondbox_scheduler.domain.ids import lease_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement import (
    ARCHITECTURE,
    BACKEND,
    CAPABILITY_COMPUTE,
    CAPABILITY_PHYSICAL_STORAGE_ADMISSION,
    CAPACITY,
    DRAINING,
    GUEST_PROTOCOL,
    HEARTBEAT_STALE,
)
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
)
from secondbox_scheduler.projections.row_changes import Insert, RowChange, Update
from secondbox_scheduler.projections.sql_view import (
    PostgresSqlView,
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
    ddl = (
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

    # -- candidates of a placement (create_sandbox) ---------------------------------

    id_order: ClassVar[str] = "runner_id"  # ordered like Python's str (code points)
    contains: ClassVar[str] = "INSTR({column}, %s) > 0"  # case-sensitive substring test

    def prefilter_counts(self, requirements: Requirements, stale_before: datetime) -> PoolCounts:
        """One aggregate over the pool: its registered runners, how many pass the
        prefilter, and per reason key how many fail that prefilter rule."""
        rules = _prefilter_rules(requirements, stale_before, self.contains)
        columns, params = ["COUNT(*) AS pool_runners"], []
        for index, (_, condition, condition_params) in enumerate(rules):
            columns.append(f"SUM(CASE WHEN {condition} THEN 1 ELSE 0 END) AS r{index}")
            params.extend(condition_params)
        excluded = " OR ".join(condition for _, condition, _ in rules)
        columns.append(f"SUM(CASE WHEN {excluded} THEN 1 ELSE 0 END) AS excluded")
        for _, _, condition_params in rules:
            params.extend(condition_params)
        params.append(requirements.pool_name)
        row = self.query(
            f"SELECT {', '.join(columns)} FROM {{table}} WHERE pool_name = %s AND deregistered = 0",
            params,
        )[0]
        reasons = {key: int(row[f"r{index}"] or 0) for index, (key, _, _) in enumerate(rules)}
        return PoolCounts(int(row["pool_runners"]), int(row["excluded"] or 0), reasons)

    def first_candidates(
        self, requirements: Requirements, stale_before: datetime, limit: int
    ) -> tuple[PoolCounts, list[tuple[RankBound, RunnerSnapshot]]]:
        """``prefilter_counts`` and ``candidate_page(offset=0)`` in one scan of the pool:
        a narrow CTE of (id, failed-rule bitmask, bound keys) feeds both the counts per
        bitmask and the first ``limit`` passing ids; then those rows by primary key."""
        rules = _prefilter_rules(requirements, stale_before, self.contains)
        flags = " + ".join(
            f"CASE WHEN {condition} THEN {1 << index} ELSE 0 END"
            for index, (_, condition, _) in enumerate(rules)
        )
        params: list[Any] = [p for _, _, condition_params in rules for p in condition_params]
        locality, locality_params = _locality_bound(requirements, self.contains)
        params += [*locality_params, requirements.pool_name, limit]
        free = {dim: f"(allocatable_{dim} - reserved_{dim})" for dim in DIMENSIONS}
        rows = self.query(
            f"WITH pool AS (SELECT runner_id, ({flags}) AS flags, {locality} AS lb, "
            f"{free['instances']} AS fi, {free['vcpu_count']} AS fv, "
            f"{free['memory_bytes']} AS fm FROM {{table}} "
            "WHERE pool_name = %s AND deregistered = 0) "
            "SELECT flags, COUNT(*) AS n, NULL AS runner_id FROM pool GROUP BY flags "
            "UNION ALL SELECT * FROM (SELECT -1 AS flags, 0 AS n, runner_id FROM pool "
            f"WHERE flags = 0 ORDER BY lb DESC, fi DESC, fv DESC, fm DESC, {self.id_order} "
            "LIMIT %s) AS page",
            params,
        )
        pool_runners = excluded = 0
        reasons = dict.fromkeys((key for key, _, _ in rules), 0)
        ids = []
        for row in rows:
            if row["flags"] < 0:
                ids.append(row["runner_id"])
                continue
            pool_runners += row["n"]
            if row["flags"]:
                excluded += row["n"]
            for index, (key, _, _) in enumerate(rules):
                if row["flags"] & (1 << index):
                    reasons[key] += row["n"]
        page = []
        if ids:
            placeholders = ", ".join("%s" for _ in ids)
            found = self.query(
                f"SELECT *, {locality} AS locality_bound FROM {{table}} "
                f"WHERE runner_id IN ({placeholders}) AND deregistered = 0",
                [*locality_params, *ids],
            )
            page = sorted((_bound(row), row_to_snapshot(row)) for row in found)
        return PoolCounts(pool_runners, excluded, reasons), page

    def candidate_page(
        self, requirements: Requirements, stale_before: datetime, offset: int, limit: int
    ) -> list[tuple[RankBound, RunnerSnapshot]]:
        """Runners of the pool that pass the prefilter, best first by an upper bound of
        their ranking key (``domain.placement`` ``_rank_key``): artifact locality bounded
        by occurrences of each preferred digest in the JSON text, then free instances,
        vcpu, memory (descending) and id."""
        rules = _prefilter_rules(requirements, stale_before, self.contains)
        where = ["pool_name = %s", "deregistered = 0"]
        params: list[Any] = [requirements.pool_name]
        for _, condition, condition_params in rules:
            where.append(f"NOT {condition}")
            params.extend(condition_params)
        locality, locality_params = _locality_bound(requirements, self.contains)
        free = {dim: f"(allocatable_{dim} - reserved_{dim})" for dim in DIMENSIONS}
        rows = self.query(
            f"SELECT *, {locality} AS locality_bound FROM {{table}} "
            f"WHERE {' AND '.join(where)} ORDER BY locality_bound DESC, "
            f"{free['instances']} DESC, {free['vcpu_count']} DESC, "
            f"{free['memory_bytes']} DESC, {self.id_order} LIMIT %s OFFSET %s",
            [*locality_params, *params, limit, offset],
        )
        return [(_bound(row), row_to_snapshot(row)) for row in rows]

    def snapshot(self, runner_id: str) -> RunnerSnapshot | None:
        rows = self.query(
            "SELECT * FROM {table} WHERE runner_id = %s AND deregistered = 0", [runner_id]
        )
        return row_to_snapshot(rows[0]) if rows else None

    def rows(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM {table} ORDER BY runner_id")


class SQLiteRunnerSnapshotsView(RunnerSnapshotsView, SQLiteSqlView):
    pass


class PostgresRunnerSnapshotsView(RunnerSnapshotsView, PostgresSqlView):
    id_order = 'runner_id COLLATE "C"'  # byte order of UTF-8 = Python's str order
    contains = "STRPOS({column}, %s) > 0"


RankBound = tuple[int, int, int, int, str]


@dataclass(frozen=True)
class PoolCounts:
    """The prefilter aggregate of one pool (see ``prefilter_counts``)."""

    pool_runners: int
    excluded: int
    reasons: dict[str, int]

    @property
    def passed(self) -> int:
        return self.pool_runners - self.excluded


def _locality_bound(requirements: Requirements, contains: str) -> tuple[str, list[Any]]:
    """SQL of an upper bound of the artifact locality: per distinct preferred digest,
    the non-overlapping occurrences of its JSON string in the ``artifact_digests`` text
    (every element equal to it is one; docs/architecture.md)."""
    terms, params = [], []
    for digest in sorted(set(requirements.preferred_artifact_digests)):
        pattern = json.dumps(digest)
        terms.append(
            f"CASE WHEN {contains.format(column='artifact_digests')} THEN "
            "(LENGTH(artifact_digests) - LENGTH(REPLACE(artifact_digests, %s, ''))) / %s ELSE 0 END"
        )
        params.extend([pattern, pattern, len(pattern)])
    return " + ".join(terms) or "0", params


def _bound(row: dict[str, Any]) -> RankBound:
    return (
        -int(row["locality_bound"]),
        -(row["allocatable_instances"] - row["reserved_instances"]),
        -(row["allocatable_vcpu_count"] - row["reserved_vcpu_count"]),
        -(row["allocatable_memory_bytes"] - row["reserved_memory_bytes"]),
        row["runner_id"],
    )


def _has_name(contains: str, column: str, name: str) -> tuple[str, list[Any]]:
    """True when the JSON list text of ``column`` contains ``"name"`` as a substring:
    case-sensitive on both databases, true whenever the list holds ``name`` (a superset
    test, so that excluding on its negation is safe)."""
    return contains.format(column=column), [json.dumps(name)]


def _prefilter_rules(
    requirements: Requirements, stale_before: datetime, contains: str
) -> list[tuple[str, str, list[Any]]]:
    """(reason key, SQL condition true when the runner fails, params) for the rules of
    ``domain.placement`` that plain columns decide. Each condition implies that the
    runner fails that rule, so excluding on them never hides a compatible runner."""
    requested = requirements.capacity.as_dict()
    compute, compute_params = _has_name(contains, "capabilities", CAPABILITY_COMPUTE)
    admission, admission_params = _has_name(
        contains, "capabilities", CAPABILITY_PHYSICAL_STORAGE_ADMISSION
    )
    generation = requirements.guest_protocol_generation
    rules: list[tuple[str, str, list[Any]]] = [
        (ARCHITECTURE, "architecture <> %s", [requirements.architecture]),
        (DRAINING, "drain_phase <> %s", [DRAIN_PHASE_ACTIVE]),
        (
            HEARTBEAT_STALE,
            "(last_heartbeat_at IS NULL OR last_heartbeat_at < %s)",
            [time_text(stale_before)],
        ),
        (BACKEND, f"(backend_kind = '' OR NOT {compute})", compute_params),
        (
            GUEST_PROTOCOL,
            "(%s < 1 OR guest_protocol_minimum > %s OR guest_protocol_maximum < %s)",
            [generation, generation, generation],
        ),
    ]
    for dim in DIMENSIONS:
        shortfall = f"allocatable_{dim} - reserved_{dim} < %s"
        if dim == "disk_bytes":
            rules.append(
                (
                    f"{CAPACITY}:{dim}",
                    f"({shortfall} AND NOT {admission})",
                    [requested[dim], *admission_params],
                )
            )
        else:
            rules.append((f"{CAPACITY}:{dim}", shortfall, [requested[dim]]))
    return rules


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
        materializations=tuple(
            MaterializationSnapshot.model_construct(**item)
            for item in json.loads(row["materializations"])
        ),
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

    @singledispatchmethod
    def changes(self, event: Any) -> list[RowChange]:
        return []  # events of other aggregates: only the position moves

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
            drain_phase="active",
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
        return [_runner_update(event, drain_phase="draining")]

    @changes.register
    def _(self, event: Runner.DrainCancelled) -> list[RowChange]:
        return [_runner_update(event, drain_phase="active")]

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
