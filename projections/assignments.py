"""Assignments projection: one row per (sandbox, generation) with every DurableAssignment field.

Fed by the Sandbox stream. Queries by sandbox, by runner, by state, and the
reconciler's "due" query: next_reconcile_at at or before a time and no unexpired
reconcile claim. Every other event class is ignored with a reason (``IGNORED``); an
event of an unknown class is counted (:mod:`projections.unknown_events`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import singledispatchmethod
from typing import Any

from secondbox_scheduler.domain.access_tokens import ACCESS_TOKEN_EVENTS
from secondbox_scheduler.domain.assignment import STATE_RELEASED, STATE_RUNNING, STATE_UNCERTAIN
from secondbox_scheduler.domain.cell_claims import CELL_CLAIM_EVENTS
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity, DurableAssignment
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

TIME_FIELDS = (
    "operation_deadline",
    "claim_expires_at",
    "reconcile_claim_expires_at",
    "next_reconcile_at",
    "created_at",
    "updated_at",
)
JSON_FIELDS = ("capability_snapshot", "resolved_artifacts", "release_proof", "capacity",
               "assignment_command")  # fmt: skip
COLUMNS = (
    "sandbox_id", "generation", "sandbox_stream", "id", "instance_id", "runner_id",
    "profile_revision_id", "backend_kind", "backend_reference", "fencing_token", "state",
    "capability_snapshot", "resolved_artifacts", "release_proof", "failure_class",
    "retry_count", "retry_limit", "operation_deadline", "claim_expires_at", "reconcile_owner",
    "reconcile_claim_expires_at", "next_reconcile_at", "revision", "created_at", "updated_at",
    "egress_context", "capacity", "workspace_id", "assignment_command_id",
    "assignment_command", "start_mutation_id",
)  # fmt: skip
_INTEGER = {"generation", "retry_count", "retry_limit", "revision"}


class AssignmentsView(SqlView):
    projection_name = "assignments"
    table = "assignments"
    ddl = (
        "CREATE TABLE IF NOT EXISTS {table} ("
        + ", ".join(f"{c} {'BIGINT' if c in _INTEGER else 'TEXT'}" for c in COLUMNS)
        + ", PRIMARY KEY (sandbox_id, generation))",
        "CREATE UNIQUE INDEX IF NOT EXISTS assignments_stream ON {table} "
        "(sandbox_stream, generation)",
        "CREATE INDEX IF NOT EXISTS assignments_runner ON {table} (runner_id)",
        "CREATE INDEX IF NOT EXISTS assignments_state ON {table} (state)",
        "CREATE INDEX IF NOT EXISTS assignments_due ON {table} (next_reconcile_at)",
    )
    keys = (("sandbox_stream", "generation"),)
    encoders = {
        **dict.fromkeys(TIME_FIELDS, time_text),
        **dict.fromkeys(JSON_FIELDS, to_json),
    }

    def _select(
        self,
        where: str,
        params: list[Any],
        order: str = "sandbox_id, generation",
        limit: int | None = None,
    ) -> list[DurableAssignment]:
        tail = "" if limit is None else f" LIMIT {int(limit)}"
        rows = self.query(f"SELECT * FROM {{table}} WHERE {where} ORDER BY {order}{tail}", params)
        return [row_to_assignment(row) for row in rows]

    def get(self, sandbox_id: str, generation: int) -> DurableAssignment | None:
        found = self._select("sandbox_id = %s AND generation = %s", [sandbox_id, generation])
        return found[0] if found else None

    def by_sandbox(self, sandbox_id: str) -> list[DurableAssignment]:
        return self._select("sandbox_id = %s", [sandbox_id])

    def of_generation(self, sandbox_id: str, generation: int) -> DurableAssignment | None:
        found = self._select("sandbox_id = %s AND generation = %s", [sandbox_id, generation])
        return found[0] if found else None

    def by_runner(self, runner_id: str, *, holding: bool = True) -> list[DurableAssignment]:
        """Assignments fenced on ``runner_id``; by default only those holding capacity."""
        if holding:
            return self._select("runner_id = %s AND state <> %s", [runner_id, STATE_RELEASED])
        return self._select("runner_id = %s", [runner_id])

    def by_state(self, state: str) -> list[DurableAssignment]:
        return self._select("state = %s", [state])

    def due_for_reconcile(self, at: datetime, limit: int = 100) -> list[DurableAssignment]:
        """Unreleased assignments whose next_reconcile_at has come and that no one holds."""
        moment = time_text(at)
        return self._select(
            "state <> %s AND next_reconcile_at <= %s AND (reconcile_claim_expires_at IS NULL "
            "OR reconcile_claim_expires_at <= %s)",
            [STATE_RELEASED, moment, moment],
            order="next_reconcile_at, sandbox_id, generation",
            limit=limit,
        )

    def rows(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM {table} ORDER BY sandbox_id, generation")


class SQLiteAssignmentsView(AssignmentsView, SQLiteSqlView):
    pass


class PostgresAssignmentsView(AssignmentsView, PostgresSqlView):
    pass


def row_to_assignment(row: dict[str, Any]) -> DurableAssignment:
    fields = {name: row[name] for name in COLUMNS if name != "sandbox_stream"}
    for name in TIME_FIELDS:
        fields[name] = text_time(row[name])
    for name in JSON_FIELDS:
        fields[name] = None if row[name] is None else json.loads(row[name])
    fields["capacity"] = Capacity.of(fields["capacity"])
    fields["fencing_token"] = bytes.fromhex(row["fencing_token"])
    return DurableAssignment.model_construct(**fields)


def _update(event: Any, **columns: Any) -> Update:
    return Update(
        ("sandbox_stream", "generation"),
        (event.originator_id.hex, event.generation),
        {**columns, "updated_at": event.timestamp},
        {"revision": 1},
    )


class AssignmentsProjection(SqlProjection[AssignmentsView]):
    """Folds Sandbox events into assignment rows."""

    name = "assignments"

    IGNORED = {
        **dict.fromkeys(
            (
                Runner.Registered,
                Runner.CapacityReserved,
                Runner.CapacityReleased,
                Runner.DrainStarted,
                Runner.DrainCancelled,
                Runner.AllocatableChanged,
                Runner.Deregistered,
                RunnerLease.Opened,
                RunnerLease.LivenessRenewed,
                RunnerLease.EvidenceRecorded,
            ),
            "a runner's events change no assignment: an assignment's runner and capacity "
            "are fixed when it is fenced (runner_snapshots keeps the runner's side)",
        ),
        Sandbox.Created: (
            "a sandbox has no assignment row until a generation is fenced "
            "(Sandbox.AssignmentFenced inserts it)"
        ),
        Sandbox.GenerationAdvanced: (
            "the new generation's row is inserted when it is fenced; the earlier "
            "generations' rows keep their state"
        ),
        **dict.fromkeys(
            (RefusalLog.Opened, RefusalLog.Refused), "a refusal makes or changes no assignment"
        ),
        FencingTokenUse.Used: (
            "the token is in the row from Sandbox.AssignmentFenced; its index changes no row"
        ),
        **dict.fromkeys(ACCESS_TOKEN_EVENTS, "an access token makes or changes no assignment"),
        **dict.fromkeys(CELL_CLAIM_EVENTS, "a cell claim makes or changes no assignment"),
    }

    @singledispatchmethod
    def changes(self, event: Any) -> list[RowChange]:
        return self.unhandled(event)  # ignored (only the position moves), or unknown

    @changes.register
    def _(self, event: Sandbox.AssignmentFenced) -> list[RowChange]:
        values: dict[str, Any] = {**event.assignment, "sandbox_stream": event.originator_id.hex}
        return [Insert({name: values[name] for name in COLUMNS})]  # encoded when written

    @changes.register
    def _(self, event: Sandbox.AssignmentRunning) -> list[RowChange]:
        return [_update(event, state=STATE_RUNNING)]

    @changes.register
    def _(self, event: Sandbox.AssignmentReleased) -> list[RowChange]:
        return [_update(event, state=STATE_RELEASED, release_proof=dict(event.release_proof))]

    @changes.register
    def _(self, event: Sandbox.AssignmentFailed) -> list[RowChange]:
        return [
            _update(
                event,
                state=event.state,
                failure_class=event.failure_class,
                retry_count=event.retry_count,
            )
        ]

    @changes.register
    def _(self, event: Sandbox.ReconcileClaimed) -> list[RowChange]:
        return [
            _update(
                event,
                reconcile_owner=event.owner,
                reconcile_claim_expires_at=event.until,
            )
        ]

    @changes.register
    def _(self, event: Sandbox.AssignmentUncertain) -> list[RowChange]:
        return [_update(event, state=STATE_UNCERTAIN)]

    @changes.register
    def _(self, event: Sandbox.ReconcileScheduled) -> list[RowChange]:
        return [
            _update(
                event,
                next_reconcile_at=event.next_reconcile_at,
                operation_deadline=event.operation_deadline,
            )
        ]

    @changes.register
    def _(self, event: Sandbox.ReconcileClaimReleased) -> list[RowChange]:
        return [_update(event, reconcile_owner="", reconcile_claim_expires_at=None)]
