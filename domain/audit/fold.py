"""Audit fold: the whole scheduling history replayed event by event, with every promise checked.

Pure: it is fed decoded events with their notification positions, in log order, and
keeps its own plain state (no aggregate, no cache, no projection). After every event
it checks the invariants of docs/spec.md (section 7) that the event could break:

1. reserved <= allocatable on every checked dimension, and <= 2**63-1 on every one;
2. a runner's reserved capacity equals the sum over its unreleased assignments (a
   fence and its reservation, a release and its capacity release, are written in one
   transaction, so the second of each pair must follow the first at once);
3. one assignment per (sandbox, generation); a fencing token never repeats per sandbox;
4. each assignment's runner was the sandbox's home runner and compatible, by every
   rule, on the evidence recorded with the decision; and that evidence matches the
   runner and lease as the log had them (versions, capacity, drain phase, heartbeat);
5. no reservation on a draining or deregistered runner;
6. capacity released at most once per assignment, and only with proof.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.assignment import STATE_RELEASED, STATE_RUNNING, STATE_UNCERTAIN
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse, token_sha256
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.limits import MAX_CLOCK_TOLERANCE, MAX_RESERVED_TOTAL
from secondbox_scheduler.domain.placement.evidence import HomeDecisionRecord, rank_key_from_record
from secondbox_scheduler.domain.placement.rules import checked_dimensions, evaluate_runner
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner, runner_snapshot
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
)

DIMENSIONS = Capacity.DIMENSIONS


@dataclass(frozen=True)
class Violation:
    position: int
    aggregate: str
    event: str
    rule: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "aggregate": self.aggregate,
            "event": self.event,
            "rule": self.rule,
            "detail": self.detail,
        }

    def __str__(self) -> str:
        return f"#{self.position} {self.aggregate} {self.event}: {self.rule}: {self.detail}"


@dataclass
class RunnerState:
    runner_id: str
    pool_name: str
    backend_kind: str
    architecture: str
    capabilities: list[str]
    allocatable: dict[str, int]
    supported_egress_contexts: list[str]
    guest_protocol_minimum: int
    guest_protocol_maximum: int
    reserved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMENSIONS, 0))
    reservations: dict[str, dict[str, int]] = field(default_factory=dict)
    drain_phase: str = DRAIN_PHASE_ACTIVE
    deregistered: bool = False
    version: int = 1
    checked: tuple[str, ...] = ()  # checked_dimensions(capabilities), set at registration


@dataclass
class LeaseState:
    runner_id: str
    last_heartbeat_at: datetime | None = None
    artifact_digests: list[str] = field(default_factory=list)
    materializations: list[dict[str, str]] = field(default_factory=list)
    version: int = 1
    history: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    snapshots: dict[int, tuple[MaterializationSnapshot, ...]] = field(default_factory=dict)

    def at_version(self, version: int) -> tuple[Any, ...]:
        return self.history.get(version, (None, [], []))

    def materializations_at(self, version: int) -> tuple[MaterializationSnapshot, ...]:
        """The lease's materializations at ``version`` as value objects (cached: the
        fold replaces a lease's lists on each event and never changes them in place)."""
        items = self.snapshots.get(version)
        if items is None:
            _, _, materializations = self.at_version(version)
            items = tuple(MaterializationSnapshot.from_record(m) for m in materializations)
            self.snapshots[version] = items
        return items


@dataclass
class SandboxState:
    sandbox_id: str
    workspace_id: str
    profile_revision_id: str
    requirements: dict[str, Any]
    home_runner_id: str
    generation: int = 1
    assignments: dict[int, dict[str, Any]] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)
    fenced_at: dict[int, int] = field(default_factory=dict)
    pinned: Requirements | None = None  # Requirements.from_record(requirements), cached


class _Stream:
    """What the fold holds for one originator id (looked up once per event)."""

    __slots__ = ("lease", "runner", "sandbox")

    def __init__(self) -> None:
        self.runner: RunnerState | None = None
        self.lease: LeaseState | None = None
        self.sandbox: SandboxState | None = None


_NO_STREAM = _Stream()  # never written: what _of returns for an unknown stream
_ZERO: dict[str, int] = dict.fromkeys(DIMENSIONS, 0)  # never mutated


@dataclass
class Pending:
    """The first part of a transaction of several aggregates, waiting for the next part:
    a fence's reservation ("reserve"), then its token index ("token"); a release's
    capacity release ("release")."""

    kind: str  # "reserve", "token" or "release"
    position: int
    sandbox_id: str
    generation: int
    runner_id: str
    capacity: dict[str, int]
    token_sha256: str | None = None  # of a fence that saved a token index


_WANTED = {"reserve": "CapacityReserved", "release": "CapacityReleased", "token": "Used"}


class AuditFold:
    """Replays events in log order into plain state and reports every broken promise."""

    # A recorded caller time (a heartbeat's ``at``, a placement's ``decided_at``) may
    # differ from the scheduler's clock by at most the largest tolerance it accepts.
    MAX_CLOCK_SKEW = MAX_CLOCK_TOLERANCE

    def __init__(self) -> None:
        self.runner_streams: dict[str, UUID] = {}
        self.lease_of: dict[str, UUID] = {}
        self.sandbox_streams: dict[str, UUID] = {}
        self.refusals: dict[str, list[dict[str, Any]]] = {}
        self.owed: dict[str, dict[str, int]] = {}  # unreleased assignments' capacity by runner
        self.violations: list[Violation] = []
        self._current: Any = None
        self._streams: dict[UUID, _Stream] = {}  # every aggregate's state, by stream id
        self._stream: _Stream | None = None  # the current event's
        self._names: dict[type[Any], tuple[str, str]] = {}
        self.pending: Pending | None = None
        self.position = 0
        self.events = 0
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            Runner.Registered: self._registered,
            Runner.CapacityReserved: self._reserved,
            Runner.CapacityReleased: self._capacity_released,
            Runner.DrainStarted: self._drain_started,
            Runner.DrainCancelled: self._drain_cancelled,
            Runner.AllocatableChanged: self._allocatable,
            Runner.Deregistered: self._deregistered,
            RunnerLease.Opened: self._lease_opened,
            RunnerLease.LivenessRenewed: self._lease_renewed,
            RunnerLease.EvidenceRecorded: self._lease_evidence,
            Sandbox.Created: self._sandbox_created,
            Sandbox.AssignmentFenced: self._fenced,
            Sandbox.AssignmentReleased: self._released,
            Sandbox.GenerationAdvanced: self._advanced,
            RefusalLog.Refused: self._refused,
            FencingTokenUse.Used: self._token_used,
        }

    # -- driving --------------------------------------------------------------

    def apply(self, position: int, event: Any) -> list[Violation]:
        """Fold one event at notification ``position``; return the violations it caused."""
        found_before = len(self.violations)
        self.position = position
        self.events += 1
        self._current = event
        self._stream = self._streams.get(event.originator_id)
        pending = self.pending
        if pending is not None and not self._completes(pending, event):
            self._unpaired(pending, "in the same transaction")
            self.pending = None
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)
        elif isinstance(event, Sandbox.Event):
            self._sandbox_update(event)
        self._versions(event)
        if len(self.violations) == found_before:
            return []
        return self.violations[found_before:]

    def finish(self) -> list[Violation]:
        """At the end of the log: an unpaired part of a transaction is a violation too."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._unpaired(pending, "before the end of the log")
        return self.violations

    def _unpaired(self, pending: Pending, where: str) -> None:
        rule = "invariant-3" if pending.kind == "token" else "invariant-2"
        self._violate(
            rule,
            f"{pending.kind} of {pending.sandbox_id}#{pending.generation} at "
            f"#{pending.position} has no matching {_WANTED[pending.kind]} {where}",
        )

    def _completes(self, pending: Pending, event: Any) -> bool:
        wanted = {
            "reserve": Runner.CapacityReserved,
            "release": Runner.CapacityReleased,
            "token": FencingTokenUse.Used,
        }[pending.kind]
        return isinstance(event, wanted)

    def _violate(self, rule: str, detail: str) -> None:
        event = self._current
        names = self._names.get(type(event))
        if names is None:
            name = type(event).__qualname__
            names = self._names[type(event)] = (name, name.split(".")[0])
        stream = self._stream
        runner = stream.runner if stream else None
        lease = stream.lease if stream else None
        sandbox = stream.sandbox if stream else None
        label = (
            runner.runner_id if runner else lease.runner_id if lease
            else sandbox.sandbox_id if sandbox else str(event.originator_id)
        )  # fmt: skip
        self.violations.append(
            Violation(self.position, f"{names[1]} {label}", names[0], rule, detail)
        )

    def _of(self, stream_id: UUID | None) -> _Stream:
        """The state of a stream named by an index (empty when there is none)."""
        stream = self._streams.get(stream_id) if stream_id is not None else None
        return stream if stream is not None else _NO_STREAM

    def _enter(self, stream_id: UUID) -> _Stream:
        """The current event's stream entry, created for an aggregate's first event."""
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = _Stream()
        self._stream = stream
        return stream

    def _versions(self, event: Any) -> None:
        stream = self._stream
        if stream is None:
            return
        runner = stream.runner
        if runner is not None:
            runner.version = event.originator_version
        lease = stream.lease
        if lease is not None:
            lease.version = event.originator_version
            # The lists are shared, not copied: the fold replaces them, never mutates them.
            lease.history[lease.version] = (
                lease.last_heartbeat_at,
                lease.artifact_digests,
                lease.materializations,
            )
            lease.snapshots.pop(lease.version, None)

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

    def _owe(self, runner_id: str, capacity: dict[str, int], sign: int) -> None:
        owed = self.owed.get(runner_id)
        if owed is None:
            owed = self.owed[runner_id] = dict(_ZERO)
        for dim in DIMENSIONS:
            owed[dim] += sign * capacity[dim]

    def _check_ledger(self, runner: RunnerState) -> None:
        owed = self.owed.get(runner.runner_id, _ZERO)
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
        lease = LeaseState(event.runner_id)
        lease.history[1] = (None, [], [])
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

    # -- sandboxes ------------------------------------------------------------

    def _sandbox_created(self, event: Any) -> None:
        sandbox = SandboxState(
            sandbox_id=event.sandbox_id,
            workspace_id=event.workspace_id,
            profile_revision_id=event.profile_revision_id,
            requirements=dict(event.requirements),
            home_runner_id=event.home_runner_id,
        )
        self._enter(event.originator_id).sandbox = sandbox
        self.sandbox_streams[event.sandbox_id] = event.originator_id
        self._check_home_decision(event.home_runner_id, event.home_decision)

    def _check_home_decision(self, home: str, decision: HomeDecisionRecord) -> None:
        """The home decision's own evidence is consistent: the chosen runner is the
        home runner, listed as compatible, and ranks first among the compatible runners
        listed (unlisted runners are only counted: docs/events.md 7.3)."""
        if decision.get("chosen_runner_id") != home:
            self._violate(
                "invariant-4", f"home decision chose {decision.get('chosen_runner_id')!r}"
            )
        ranks = {
            c["runner_id"]: c.get("rank")
            for c in decision.get("candidates", ())
            if not c["failures"]
        }
        if home not in ranks:
            self._violate("invariant-4", f"home runner {home!r} is not listed as compatible")
            return

        best = min(ranks, key=lambda runner_id: rank_key_from_record(runner_id, ranks[runner_id]))
        if ranks[home] is not None and best != home:
            self._violate("invariant-4", f"listed runner {best!r} ranks above home {home!r}")

    def _sandbox(self, event: Any) -> SandboxState | None:
        sandbox = self._stream.sandbox if self._stream else None
        if sandbox is None:
            self._violate("history", "event of a sandbox that was never created")
        return sandbox

    def _fenced(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        if sandbox is None:
            return
        record = dict(event.assignment)
        generation = record["generation"]
        if generation in sandbox.assignments:
            self._violate("invariant-3", f"second assignment for generation {generation}")
        if generation != sandbox.generation:
            self._violate(
                "invariant-3",
                f"assignment for generation {generation} while current is {sandbox.generation}",
            )
        if record["fencing_token"] in sandbox.tokens:
            self._violate("invariant-3", f"fencing token reused in generation {generation}")
        self._check_placement(sandbox, record, dict(event.placement))
        sandbox.assignments[generation] = record
        sandbox.tokens.add(record["fencing_token"])
        sandbox.fenced_at[generation] = self.position
        self._owe(record["runner_id"], record["capacity"], +1)
        indexed = getattr(event, "token_indexed", False)
        self.pending = Pending(
            "reserve", self.position, sandbox.sandbox_id, generation, record["runner_id"],
            dict(record["capacity"]),
            token_sha256(record["fencing_token"]) if indexed else None,
        )  # fmt: skip

    def _token_used(self, event: Any) -> None:
        """A fencing token's index stream: saved with the fence that used the token."""
        pending, self.pending = self.pending, None
        if (
            pending is None
            or pending.kind != "token"
            or (pending.sandbox_id, pending.generation, pending.token_sha256)
            != (event.sandbox_id, event.generation, event.token_sha256)
        ):
            self._violate(
                "invariant-3",
                f"token index of {event.sandbox_id}#{event.generation} matches no fence "
                "in the same transaction",
            )

    def _check_placement(
        self, sandbox: SandboxState, record: dict[str, Any], placement: dict[str, Any]
    ) -> None:
        runner_id = record["runner_id"]
        if runner_id != sandbox.home_runner_id:
            self._violate(
                "invariant-4",
                f"assignment on {runner_id!r} but the home runner is {sandbox.home_runner_id!r}",
            )
        requirements = sandbox.pinned
        if requirements is None:
            requirements = sandbox.pinned = Requirements.from_record(sandbox.requirements)
        evidence = RunnerSnapshot.from_record(placement["runner"])
        decided_at = placement["decided_at"]
        clock = placement.get("clock")  # recorded since release 0.2
        if clock is not None and abs(decided_at - clock) > self.MAX_CLOCK_SKEW:
            self._violate(
                "clock",
                f"decided at {decided_at.isoformat()} by the request, the clock said "
                f"{clock.isoformat()}",
            )
        timeout = timedelta(seconds=placement["heartbeat_timeout_seconds"])
        evaluation = evaluate_runner(
            requirements, evidence, decided_at, timeout,
            rules_version=placement.get("rules_version", 1),
        )  # fmt: skip
        if not evaluation.compatible:
            reasons = ", ".join(f.detail for f in evaluation.failures)
            self._violate("invariant-4", f"runner {runner_id!r} was not compatible: {reasons}")
        if record["capacity"] != requirements.capacity.as_dict():
            self._violate("invariant-4", "reserved capacity differs from the pinned requirements")
        runner = self._of(self.runner_streams.get(runner_id)).runner
        if runner is None:
            self._violate("invariant-4", f"runner {runner_id!r} is not registered")
            return
        actual = {
            "allocatable": runner.allocatable,
            "reserved": runner.reserved,
            "drain_phase": runner.drain_phase,
            "capabilities": sorted(runner.capabilities),
            "pool_name": runner.pool_name,
            "architecture": runner.architecture,
            "backend_kind": runner.backend_kind,
        }
        recorded = {
            "allocatable": evidence.allocatable.as_dict(),
            "reserved": evidence.reserved.as_dict(),
            "drain_phase": evidence.drain_phase,
            "capabilities": sorted(evidence.capabilities),
            "pool_name": evidence.pool_name,
            "architecture": evidence.architecture,
            "backend_kind": evidence.backend_kind,
        }
        for key, value in recorded.items():
            if actual[key] != value:
                self._violate(
                    "invariant-4",
                    f"evidence {key} {value!r} differs from the runner's {actual[key]!r}",
                )
        if runner.deregistered:
            self._violate("invariant-4", f"runner {runner_id!r} was deregistered")
        if placement.get("runner_version") != runner.version:
            self._violate(
                "invariant-4",
                f"evidence of runner version {placement.get('runner_version')} but the runner "
                f"was at {runner.version}",
            )
        lease = self._of(self.lease_of.get(runner_id)).lease
        if lease is None:
            self._violate("invariant-4", f"runner {runner_id!r} has no lease")
            return
        version = placement.get("lease_version", 0)
        if version > lease.version:
            self._violate("invariant-4", f"evidence of lease version {version} not yet recorded")
            return
        heartbeat, digests, _ = lease.at_version(version)
        if (
            heartbeat != evidence.last_heartbeat_at
            or tuple(digests) != evidence.artifact_digests
            or lease.materializations_at(version) != evidence.materializations
        ):
            self._violate(
                "invariant-4",
                f"heartbeat evidence differs from the lease at version {version}",
            )

    def _released(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        if sandbox is None:
            return
        record = sandbox.assignments.get(event.generation)
        if record is None:
            self._violate("invariant-6", f"release of generation {event.generation} never fenced")
            return
        if record["state"] == STATE_RELEASED:
            self._violate("invariant-6", f"generation {event.generation} released twice")
        if not event.release_proof:
            self._violate("invariant-6", "released without proof")
        if record["state"] != STATE_RELEASED:
            self._owe(record["runner_id"], record["capacity"], -1)
        self._touch(record, event, state=STATE_RELEASED, release_proof=dict(event.release_proof))
        self.pending = Pending(
            "release", self.position, sandbox.sandbox_id, event.generation, record["runner_id"],
            dict(record["capacity"]),
        )  # fmt: skip

    def _advanced(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        if sandbox is None:
            return
        current = sandbox.assignments.get(sandbox.generation)
        if current is None or current["state"] != STATE_RELEASED:
            self._violate("invariant-6", "generation advanced before its assignment was released")
        sandbox.generation = event.generation

    def _sandbox_update(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        generation = getattr(event, "generation", None)
        if sandbox is None or generation is None:
            return
        record = sandbox.assignments.get(generation)
        if record is None:
            self._violate("history", f"{type(event).__name__} of unfenced generation {generation}")
            return
        changes: dict[str, Any] = {}
        if isinstance(event, Sandbox.AssignmentRunning):
            changes = {"state": STATE_RUNNING}
        elif isinstance(event, Sandbox.AssignmentFailed):
            changes = {
                "state": event.state,
                "failure_class": event.failure_class,
                "retry_count": event.retry_count,
            }
        elif isinstance(event, Sandbox.AssignmentUncertain):
            changes = {"state": STATE_UNCERTAIN}
        elif isinstance(event, Sandbox.ReconcileClaimed):
            changes = {"reconcile_owner": event.owner, "reconcile_claim_expires_at": event.until}
        elif isinstance(event, Sandbox.ReconcileClaimReleased):
            changes = {"reconcile_owner": "", "reconcile_claim_expires_at": None}
        elif isinstance(event, Sandbox.ReconcileScheduled):
            changes = {
                "next_reconcile_at": event.next_reconcile_at,
                "operation_deadline": event.operation_deadline,
            }
        self._touch(record, event, **changes)

    def _touch(self, record: dict[str, Any], event: Any, **changes: Any) -> None:
        record.update(changes)
        record["revision"] += 1
        record["updated_at"] = event.timestamp

    def _refused(self, event: Any) -> None:
        self.refusals.setdefault(str(event.originator_id), []).append(
            {"position": self.position, **{k: getattr(event, k) for k in (
                "operation", "generation", "error", "summary", "decided_at",
                "heartbeat_timeout_seconds", "candidates")}}
        )  # fmt: skip

    # -- state views ----------------------------------------------------------

    def runner_snapshots(self) -> list[RunnerSnapshot]:
        snapshots = []
        runners = [s.runner for s in self._streams.values() if s.runner is not None]
        for runner in sorted(runners, key=lambda r: r.runner_id):
            if not runner.deregistered:
                lease = self._of(self.lease_of.get(runner.runner_id)).lease
                snapshots.append(runner_snapshot(runner, lease))
        return snapshots

    def assignment_records(self) -> list[dict[str, Any]]:
        records = []
        sandboxes = [s.sandbox for s in self._streams.values() if s.sandbox is not None]
        for sandbox in sorted(sandboxes, key=lambda s: s.sandbox_id):
            for generation in sorted(sandbox.assignments):
                records.append(sandbox.assignments[generation])
        return records
