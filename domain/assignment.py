"""The assignment of one sandbox generation: states, failure classes, stored record.

The Sandbox aggregate keeps each generation's assignment as a record of primitives
(what events and snapshots can carry: an :class:`AssignmentRecord`);
:func:`to_durable_assignment` turns one into the public :class:`DurableAssignment`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypedDict

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    RunnerSnapshot,
    ScheduleRequest,
    trusted,
)

_DURABLE_ORDER = tuple(DurableAssignment.model_fields)  # to_durable_assignment's shortcut
_DURABLE_FIELDS = frozenset(_DURABLE_ORDER)

STATE_ASSIGNED = "assigned"
STATE_RUNNING = "running"
STATE_RELEASED = "released"
STATE_FAILED = "failed"
STATE_UNCERTAIN = "uncertain"
STATES = (STATE_ASSIGNED, STATE_RUNNING, STATE_RELEASED, STATE_FAILED, STATE_UNCERTAIN)

# States whose compute may still run: the reservation stays until release proof.
HOLDS_CAPACITY = frozenset({STATE_ASSIGNED, STATE_RUNNING, STATE_FAILED, STATE_UNCERTAIN})
# States from which a runner-side failure may be reported.
CAN_FAIL = frozenset({STATE_ASSIGNED, STATE_RUNNING, STATE_UNCERTAIN})

TRANSIENT_FAILURES = frozenset({"transport", "dependency", "deadline_exceeded"})
TERMINAL_FAILURES = frozenset(
    {"admission", "compatibility", "fencing", "local_integrity", "authorization"}
)
FAILURE_CLASSES = TRANSIENT_FAILURES | TERMINAL_FAILURES


class AssignmentRecord(TypedDict):
    """One generation's assignment as the Sandbox aggregate keeps it and
    ``Sandbox.AssignmentFenced.assignment`` carries it (:func:`new_assignment_record`):
    the fields of :class:`DurableAssignment`, the token as hex and the capacity as
    ``Capacity.as_dict()``. Every release wrote every key."""

    id: str
    sandbox_id: str
    instance_id: str
    runner_id: str
    profile_revision_id: str
    backend_kind: str
    backend_reference: str
    generation: int
    fencing_token: str  # hex
    state: str  # one of STATES
    capability_snapshot: dict[str, str]
    resolved_artifacts: dict[str, str]
    release_proof: dict[str, str]
    failure_class: str
    retry_count: int
    retry_limit: int
    operation_deadline: datetime | None
    claim_expires_at: datetime | None
    reconcile_owner: str
    reconcile_claim_expires_at: datetime | None
    next_reconcile_at: datetime | None
    revision: int
    created_at: datetime
    updated_at: datetime
    egress_context: str | None
    capacity: dict[str, int]  # Capacity.as_dict()
    workspace_id: str
    assignment_command_id: str
    assignment_command: dict[str, str] | None
    start_mutation_id: str


class AssignmentUpdate(TypedDict, total=False):
    """Any part of an :class:`AssignmentRecord` (what ``dict.update`` takes for one): the
    same keys, none required. ``tests/test_domain_records.py`` keeps the two alike."""

    id: str
    sandbox_id: str
    instance_id: str
    runner_id: str
    profile_revision_id: str
    backend_kind: str
    backend_reference: str
    generation: int
    fencing_token: str
    state: str
    capability_snapshot: dict[str, str]
    resolved_artifacts: dict[str, str]
    release_proof: dict[str, str]
    failure_class: str
    retry_count: int
    retry_limit: int
    operation_deadline: datetime | None
    claim_expires_at: datetime | None
    reconcile_owner: str
    reconcile_claim_expires_at: datetime | None
    next_reconcile_at: datetime | None
    revision: int
    created_at: datetime
    updated_at: datetime
    egress_context: str | None
    capacity: dict[str, int]
    workspace_id: str
    assignment_command_id: str
    assignment_command: dict[str, str] | None
    start_mutation_id: str


def require_failure_class(failure_class: object) -> str:
    if not isinstance(failure_class, str) or failure_class not in FAILURE_CLASSES:
        raise InvalidRequestError(
            "failure_class", f"must be one of {sorted(FAILURE_CLASSES)}", failure_class
        )
    return failure_class


def capability_snapshot(runner: RunnerSnapshot) -> dict[str, str]:
    """docs/spec.md (section 6) step 5: what the runner advertised when it was chosen."""
    snapshot = {
        "architecture": runner.architecture,
        "pool": runner.pool_name,
        "guestProtocolMinimum": str(runner.guest_protocol_minimum),
        "guestProtocolMaximum": str(runner.guest_protocol_maximum),
    }
    for name in sorted(runner.capabilities):
        snapshot[f"capability.{name}"] = "true"
    return snapshot


def new_assignment_record(
    request: ScheduleRequest, runner: RunnerSnapshot, generation: int, at: datetime
) -> AssignmentRecord:
    """The record of a freshly fenced assignment (state assigned, revision 1)."""
    return {
        "id": request.assignment_id,
        "sandbox_id": request.sandbox_id,
        "instance_id": request.instance_id,
        "runner_id": runner.id,
        "profile_revision_id": request.profile_revision_id,
        "backend_kind": runner.backend_kind,
        "backend_reference": "",
        "generation": generation,
        "fencing_token": request.fencing_token.hex(),
        "state": STATE_ASSIGNED,
        "capability_snapshot": capability_snapshot(runner),
        "resolved_artifacts": dict(request.resolved_artifacts),
        "release_proof": {},
        "failure_class": "",
        "retry_count": 0,
        "retry_limit": request.retry_limit,
        "operation_deadline": request.operation_deadline,
        "claim_expires_at": request.claim_expires_at,
        "reconcile_owner": "",
        "reconcile_claim_expires_at": None,
        "next_reconcile_at": request.operation_deadline,
        "revision": 1,
        "created_at": at,
        "updated_at": at,
        "egress_context": request.requirements.egress_context,
        "capacity": request.requirements.capacity.as_dict(),
        "workspace_id": request.workspace_id,
        "assignment_command_id": request.assignment_command_id,
        "assignment_command": (
            None if request.assignment_command is None else dict(request.assignment_command)
        ),
        "start_mutation_id": request.start_mutation_id,
    }


def to_durable_assignment(record: AssignmentRecord | Mapping[str, Any]) -> DurableAssignment:
    """Trusted conversion of a stored record into the public value type (an
    :class:`AssignmentRecord`, or the audit fold's untyped copy of one)."""
    fields: dict[str, Any] = dict(record)
    fields["fencing_token"] = bytes.fromhex(record["fencing_token"])
    fields["capacity"] = Capacity.of(record["capacity"])
    for name in ("capability_snapshot", "resolved_artifacts", "release_proof"):
        fields[name] = dict(record[name])
    if record["assignment_command"] is not None:
        fields["assignment_command"] = dict(record["assignment_command"])
    if fields.keys() == _DURABLE_FIELDS:  # every field: as model_construct builds it, in
        # its field order, without its work per field (10 -> 5 us; a placement makes one)
        return trusted(DurableAssignment, {name: fields[name] for name in _DURABLE_ORDER})
    return DurableAssignment.model_construct(**fields)
