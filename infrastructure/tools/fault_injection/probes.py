"""Probes of the two lines of defence behind every command, for the adversarial profile.

The placement rule stands in front of the Runner aggregate, so a client of the
application never reaches the aggregate's own capacity guard with a request that
breaks it, and a history without a breach never exercises the audit's checks. The
adversarial ``verify`` therefore also probes both directly, on the live state:

- :func:`guard_probes`: a copy of a runner aggregate as it stands in the store is
  asked, with nothing in front of it, for one unit more than is free on each checked
  dimension, for anything at all while draining, to release without proof or twice, to
  deregister while it holds reservations, to shrink below what is reserved; each must be
  refused with its documented error and record nothing. The copy is never saved.
- :func:`audit_probes`: the audit fold of the whole log, at its end, is given one forged
  event that the aggregates would have refused (a reservation past allocatable on each
  dimension, a reservation on a draining runner, a capacity release of a reservation
  never held, a deregistration while reserved, an allocatable below reserved); each must
  be reported at its position with its rule. The log is never written.

Each probe is a :class:`Probe`: a name, whether it held, and what happened otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.errors import (
    CapacityExceededError,
    ConflictError,
    InvalidRequestError,
    RunnerUnavailableError,
    SchedulerError,
)
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement.rules import checked_dimensions
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import DRAIN_PHASE_DRAINING, Capacity, RunnerSnapshot
from secondbox_scheduler.infrastructure.application import SchedulerApplication

PROBE_PROOF = {"probe": "never saved"}


@dataclass(frozen=True)
class Probe:
    name: str
    ok: bool
    detail: str = ""

    def to_record(self) -> dict[str, Any]:
        return {"kind": "probe", "name": self.name, "ok": self.ok, "detail": self.detail}


def _refused(
    name: str, runner: Runner, error: type[SchedulerError], call: Callable[[], object]
) -> Probe:
    """``call`` on ``runner`` (a copy) must raise ``error`` and record nothing."""
    before = (runner.version, len(runner.pending_events))
    try:
        call()
    except error:
        if (runner.version, len(runner.pending_events)) != before:
            return Probe(name, False, "refused, but recorded an event")
        return Probe(name, True)
    except SchedulerError as other:
        return Probe(name, False, f"refused with {type(other).__name__}: {other}")
    return Probe(name, False, f"accepted on runner {runner.runner_id!r}")


def guard_probes(app: SchedulerApplication, runner_id: str, at: datetime) -> list[Probe]:
    """The Runner aggregate's guards, asked directly on a copy of its live state."""
    runner: Any = app.repository.get(runner_uuid(runner_id))
    lease: Any = app.repository.get(lease_uuid(runner_id))
    assert isinstance(runner, Runner)
    assert isinstance(lease, RunnerLease)
    if runner.deregistered:
        return []
    snapshot = runner.snapshot(lease)
    free, reserved = snapshot.free().as_dict(), snapshot.reserved.as_dict()
    checked = checked_dimensions(snapshot.capabilities)
    draining = snapshot.drain_phase == DRAIN_PHASE_DRAINING
    probes: list[Probe] = []

    def refused(name: str, error: type[SchedulerError], call: Callable[[], object]) -> None:
        probes.append(_refused(name, runner, error, call))

    def reserve(capacity: Capacity) -> Callable[[], object]:
        return lambda: runner.reserve(
            assignment_id="probe", sandbox_id="probe", generation=1, capacity=capacity, at=at
        )

    def release(proof: dict[str, str]) -> Callable[[], object]:
        return lambda: runner.release(sandbox_id="probe", generation=1, release_proof=proof, at=at)

    def shrink(allocatable: Capacity) -> Callable[[], object]:
        return lambda: runner.change_allocatable(allocatable, at)

    for dim in Capacity.DIMENSIONS:
        past = reserve(Capacity(**{dim: max(free[dim], 0) + 1}))
        if draining:
            refused(f"reserve while draining ({dim})", RunnerUnavailableError, past)
        elif dim in checked:
            refused(f"reserve past free {dim}", CapacityExceededError, past)
    refused("release without proof", InvalidRequestError, release({}))
    refused("release of a reservation never held", ConflictError, release(PROBE_PROOF))
    if any(reserved.values()):
        refused("deregister while reserved", ConflictError, lambda: runner.deregister(at))
        for dim in checked:
            if reserved[dim] > 0:
                below = Capacity(**{**snapshot.allocatable.as_dict(), dim: reserved[dim] - 1})
                refused(f"allocatable below reserved {dim}", CapacityExceededError, shrink(below))
    return probes


def _forged(fold: AuditFold, name: str, rule: str, events: list[Any]) -> Probe:
    """Fold ``events`` on a copy of ``fold``; the last one must break ``rule``."""
    scratch = copy.deepcopy(fold)
    position = fold.position
    found: list[Any] = []
    for event in events:
        position += 1
        found = scratch.apply(position, event)
    if any(violation.rule == rule for violation in found):
        return Probe(name, True)
    return Probe(name, False, f"the audit reported {[str(v) for v in found]}, not {rule}")


def audit_probes(
    fold: AuditFold, versions: dict[str, int], at: datetime, limit: int = 3
) -> list[Probe]:
    """Forged events on the final state of ``fold``; ``versions``: each runner's stream
    version in the store (the forged events follow it). At most ``limit`` runners."""
    probes: list[Probe] = []
    for snapshot in fold.runner_snapshots()[:limit]:
        stream = fold.runner_streams[snapshot.id]
        probes += _runner_audit_probes(fold, snapshot, stream, versions[snapshot.id], at)
    return probes


def _runner_audit_probes(
    fold: AuditFold, snapshot: RunnerSnapshot, stream: UUID, version: int, at: datetime
) -> list[Probe]:
    def event(kind: type[Any], offset: int = 1, **fields: Any) -> Any:
        return kind(
            originator_id=stream, originator_version=version + offset, timestamp=at, **fields
        )

    def reservation(capacity: Capacity, offset: int = 1) -> Any:
        return event(
            Runner.CapacityReserved, offset, reservation="probe#1", assignment_id="probe",
            sandbox_id="probe", generation=1, capacity=capacity.as_dict(),
        )  # fmt: skip

    probes: list[Probe] = []
    free, reserved = snapshot.free().as_dict(), snapshot.reserved.as_dict()
    checked = checked_dimensions(snapshot.capabilities)
    for dim in checked:
        past = reservation(Capacity(**{dim: max(free[dim], 0) + 1}))
        probes.append(_forged(fold, f"audit: reservation past allocatable {dim}", "invariant-1",
                              [past]))  # fmt: skip
    if snapshot.drain_phase != DRAIN_PHASE_DRAINING:
        drained = [event(Runner.DrainStarted), reservation(Capacity(), 2)]
        probes.append(_forged(fold, "audit: reservation on a draining runner", "invariant-5",
                              drained))  # fmt: skip
    never_held = event(
        Runner.CapacityReleased, reservation="probe#1", assignment_id="probe",
        capacity=Capacity().as_dict(), release_proof=PROBE_PROOF,
    )  # fmt: skip
    probes.append(_forged(fold, "audit: release of a reservation never held", "invariant-6",
                          [never_held]))  # fmt: skip
    if any(reserved.values()):
        probes.append(_forged(fold, "audit: deregistered while reserved", "invariant-2",
                              [event(Runner.Deregistered)]))  # fmt: skip
        for dim in checked:
            if reserved[dim] > 0:
                below = event(
                    Runner.AllocatableChanged,
                    allocatable={**snapshot.allocatable.as_dict(), dim: reserved[dim] - 1},
                )
                probes.append(_forged(fold, f"audit: allocatable below reserved {dim}",
                                      "invariant-1", [below]))  # fmt: skip
    return probes
