"""The runner side of the audit fold: runners and their heartbeat leases.

:class:`RunnerChecks` folds every event of a ``Runner`` and of a ``RunnerLease`` into
plain state (:mod:`~secondbox_scheduler.domain.audit.state`) and checks, after each, what
it could break: reserved <= allocatable (invariant 1), a runner's reserved capacity equal
to the sum over its unreleased assignments and each reservation paired with its fence
(invariant 2), no reservation on a draining or deregistered runner (invariant 5),
capacity released only once and with proof (invariant 6), heartbeats no later than the
scheduler's clock (``clock``). :class:`~secondbox_scheduler.domain.audit.fold.AuditFold`
routes the events here.
"""

from __future__ import annotations

from typing import Any

from secondbox_scheduler.domain.audit.evidence import plain_lease_lists, plain_runner
from secondbox_scheduler.domain.audit.state import (
    DIMENSIONS,
    ZERO,
    FoldState,
    LeaseState,
    Pending,
    RunnerState,
)
from secondbox_scheduler.domain.limits import MAX_RESERVED_TOTAL
from secondbox_scheduler.domain.placement.rules import checked_dimensions
from secondbox_scheduler.domain.values import DRAIN_PHASE_ACTIVE, DRAIN_PHASE_DRAINING


class RunnerChecks(FoldState):
    """The handlers of runner and lease events (named in ``AuditFold.HANDLERS``)."""

    # -- runners --------------------------------------------------------------

    def _registered(self, event: Any) -> None:
        runner = RunnerState(
            runner_id=event.runner_id,
            pool_name=event.pool_name,
            backend_kind=event.backend_kind,
            architecture=event.architecture,
            capabilities=list(event.capabilities),
            allocatable=dict(event.allocatable),
            supported_egress_contexts=list(event.supported_egress_contexts),
            guest_protocol_minimum=event.guest_protocol_minimum,
            guest_protocol_maximum=event.guest_protocol_maximum,
        )
        runner.checked = checked_dimensions(runner.capabilities)
        if plain_runner(runner):
            runner.listed = sorted(runner.capabilities)
        self._enter(event.originator_id).runner = runner
        self.runner_streams[event.runner_id] = event.originator_id

    def _runner(self, event: Any) -> RunnerState | None:
        runner = self._stream.runner if self._stream else None
        if runner is None:
            self._violate("history", "event of a runner that was never registered")
        return runner

    def _check_capacity(self, runner: RunnerState) -> None:
        reserved, allocatable = runner.reserved, runner.allocatable
        for dim in runner.checked:
            if reserved[dim] > allocatable[dim]:
                self._violate(
                    "invariant-1",
                    f"runner {runner.runner_id!r} reserved {dim} {reserved[dim]} > "
                    f"allocatable {allocatable[dim]}",
                )
            if reserved[dim] < 0:
                self._violate("invariant-2", f"runner {runner.runner_id!r} reserved {dim} < 0")
        for dim in (d for d in DIMENSIONS if reserved[d] > MAX_RESERVED_TOTAL):  # checked or not
            self._violate("invariant-1", f"runner {runner.runner_id!r} reserved {dim} > 2**63-1")

    def _check_ledger(self, runner: RunnerState) -> None:
        owed = self.owed.get(runner.runner_id, ZERO)
        if owed != runner.reserved:
            self._violate(
                "invariant-2",
                f"runner {runner.runner_id!r} reserved {runner.reserved} but its unreleased "
                f"assignments sum to {owed}",
            )

    def _reserved(self, event: Any) -> None:
        runner = self._runner(event)
        if runner is None:
            return
        if runner.deregistered or runner.drain_phase != DRAIN_PHASE_ACTIVE:
            state = "deregistered" if runner.deregistered else runner.drain_phase
            self._violate("invariant-5", f"reservation on {state} runner {runner.runner_id!r}")
        pending, self.pending = self.pending, None
        if (
            pending is None
            or pending.kind != "reserve"
            or (pending.sandbox_id, pending.generation, pending.runner_id)
            != (event.sandbox_id, event.generation, runner.runner_id)
            or pending.capacity != dict(event.capacity)
        ):
            self._violate(
                "invariant-2",
                f"reservation {event.reservation!r} on {runner.runner_id!r} matches no "
                "assignment fenced in the same transaction",
            )
        if event.reservation in runner.reservations:
            self._violate("invariant-3", f"second reservation {event.reservation!r}")
        capacity = event.capacity
        runner.reservations[event.reservation] = dict(capacity)
        reserved = runner.reserved
        for dim in DIMENSIONS:
            reserved[dim] += capacity[dim]
        self._check_capacity(runner)
        if pending is not None and pending.kind == "reserve":
            self._check_ledger(runner)
            if pending.token_sha256 is not None:  # its token index comes next
                self.pending = Pending(
                    "token", pending.position, pending.sandbox_id, pending.generation,
                    pending.runner_id, {}, pending.token_sha256,
                )  # fmt: skip

    def _capacity_released(self, event: Any) -> None:
        runner = self._runner(event)
        if runner is None:
            return
        if not event.release_proof:
            self._violate(
                "invariant-6", f"capacity of {event.reservation!r} released without proof"
            )
        held = runner.reservations.pop(event.reservation, None)
        if held is None:
            self._violate(
                "invariant-6", f"capacity of {event.reservation!r} released but not held (twice?)"
            )
        pending, self.pending = self.pending, None
        if pending is None or pending.kind != "release":
            self._violate(
                "invariant-6",
                f"capacity of {event.reservation!r} released without the assignment's release",
            )
        capacity, reserved = event.capacity, runner.reserved
        for dim in DIMENSIONS:
            reserved[dim] -= capacity[dim]
        self._check_capacity(runner)
        self._check_ledger(runner)

    def _drain_started(self, event: Any) -> None:
        self._drain(event, DRAIN_PHASE_DRAINING)

    def _drain_cancelled(self, event: Any) -> None:
        self._drain(event, DRAIN_PHASE_ACTIVE)

    def _drain(self, event: Any, phase: str) -> None:
        runner = self._runner(event)
        if runner is not None:
            runner.drain_phase = phase

    def _allocatable(self, event: Any) -> None:
        runner = self._runner(event)
        if runner is not None:
            runner.allocatable = dict(event.allocatable)
            self._check_capacity(runner)

    def _deregistered(self, event: Any) -> None:
        runner = self._runner(event)
        if runner is not None:
            runner.deregistered = True
            if runner.reservations:
                self._violate(
                    "invariant-2", f"runner {runner.runner_id!r} deregistered while reserved"
                )

    # -- leases ---------------------------------------------------------------

    def _lease_opened(self, event: Any) -> None:
        lease = LeaseState(event.runner_id)  # its version 1 is kept by AuditFold._versions
        self._enter(event.originator_id).lease = lease
        self.lease_of[event.runner_id] = event.originator_id

    def _heartbeat_time(self, event: Any) -> None:
        """docs/spec.md (section 6a): a heartbeat no later than the scheduler's clock (the event's
        timestamp) plus the largest tolerance."""
        if event.at > event.timestamp + self.MAX_CLOCK_SKEW:
            self._violate(
                "clock",
                f"heartbeat at {event.at.isoformat()} recorded at {event.timestamp.isoformat()}: "
                f"later than the clock + {self.MAX_CLOCK_SKEW.total_seconds():g}s",
            )

    def _lease_renewed(self, event: Any) -> None:
        self._heartbeat_time(event)
        lease = self._stream.lease if self._stream else None
        if lease is not None:
            lease.last_heartbeat_at = event.at

    def _lease_evidence(self, event: Any) -> None:
        self._heartbeat_time(event)
        lease = self._stream.lease if self._stream else None
        if lease is not None:
            lease.last_heartbeat_at = event.at
            lease.artifact_digests = list(event.artifact_digests)
            lease.materializations = [dict(m) for m in event.materializations]
            lease.plain_lists = plain_lease_lists(lease.artifact_digests, lease.materializations)
