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

Every event class the aggregates record (:mod:`secondbox_scheduler.domain.event_catalogue`)
is accounted for: checked by the handler :attr:`AuditFold.HANDLERS` names for it, or
ignored for the reason :attr:`AuditFold.IGNORED` gives. An event of any other class is
a finding (rule ``unknown-event``), never skipped in silence. Along the log, the clock
readings the events record do not go backwards by more than the largest clock tolerance
(rule ``time-order``, :mod:`~secondbox_scheduler.domain.audit.log_times`).

The plain state and :class:`~secondbox_scheduler.domain.audit.state.Violation` are in
:mod:`~secondbox_scheduler.domain.audit.state`; the handlers of runner and lease events
in :mod:`~secondbox_scheduler.domain.audit.runner_checks`, those of sandbox, refusal and
token events in :mod:`~secondbox_scheduler.domain.audit.sandbox_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from eventsourcing.utils import get_topic

from secondbox_scheduler.domain.access_tokens import ACCESS_TOKEN_EVENTS
from secondbox_scheduler.domain.audit.log_times import LogTimes
from secondbox_scheduler.domain.audit.runner_checks import RunnerChecks
from secondbox_scheduler.domain.audit.sandbox_checks import SandboxChecks
from secondbox_scheduler.domain.audit.state import LEASE_WINDOW, WANTED, Pending, Violation
from secondbox_scheduler.domain.cell_claims import CELL_CLAIM_EVENTS
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner, runner_snapshot
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import RunnerSnapshot


class AuditFold(RunnerChecks, SandboxChecks, LogTimes):
    """Replays events in log order into plain state and reports every broken promise."""

    # Every event class the fold checks, and the name of its handler.
    HANDLERS: ClassVar[Mapping[type[Any], str]] = MappingProxyType(
        {
            Runner.Registered: "_registered",
            Runner.CapacityReserved: "_reserved",
            Runner.CapacityReleased: "_capacity_released",
            Runner.DrainStarted: "_drain_started",
            Runner.DrainCancelled: "_drain_cancelled",
            Runner.AllocatableChanged: "_allocatable",
            Runner.Deregistered: "_deregistered",
            RunnerLease.Opened: "_lease_opened",
            RunnerLease.LivenessRenewed: "_lease_renewed",
            RunnerLease.EvidenceRecorded: "_lease_evidence",
            Sandbox.Created: "_sandbox_created",
            Sandbox.AssignmentFenced: "_fenced",
            Sandbox.AssignmentRunning: "_running",
            Sandbox.AssignmentReleased: "_released",
            Sandbox.AssignmentFailed: "_failed",
            Sandbox.ReconcileClaimed: "_reconcile_claimed",
            Sandbox.ReconcileClaimReleased: "_reconcile_claim_released",
            Sandbox.AssignmentUncertain: "_uncertain",
            Sandbox.ReconcileScheduled: "_reconcile_scheduled",
            Sandbox.GenerationAdvanced: "_advanced",
            RefusalLog.Refused: "_refused",
            FencingTokenUse.Used: "_token_used",
        }
    )
    # Every event class the fold passes over, and why nothing in it needs checking.
    IGNORED: ClassVar[Mapping[type[Any], str]] = MappingProxyType(
        {
            RefusalLog.Opened: (
                "opens a sandbox's refusal log and records nothing else: each refusal is "
                "its own RefusalLog.Refused"
            ),
            **dict.fromkeys(
                ACCESS_TOKEN_EVENTS,
                "access tokens decide who may call the service, not capacity or authority "
                "over a sandbox: no invariant reads them (the log's time order, stream "
                "versions and chain are checked for them as for every event)",
            ),
            **dict.fromkeys(
                CELL_CLAIM_EVENTS,
                "a cell claim names the cell that holds an id (the id directory of several "
                "cells): it reserves nothing and fences nothing",
            ),
        }
    )

    @classmethod
    def handled_events(cls) -> tuple[type[Any], ...]:
        """The event classes the fold checks (the keys of :attr:`HANDLERS`)."""
        return tuple(cls.HANDLERS)

    def __init__(self, *, compact: bool = False) -> None:
        super().__init__()
        # compact: a generation's assignment record, once the sandbox has advanced past
        # it, keeps only what a later event of it is checked against (``audit verify``,
        # which needs no record; ``assignment_records`` then lists the compact ones)
        self.compact = compact
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            event_class: getattr(self, name) for event_class, name in self.HANDLERS.items()
        }

    # -- driving --------------------------------------------------------------

    def apply(self, position: int, event: Any) -> list[Violation]:
        """Fold one event at notification ``position``; return the violations it caused."""
        found_before = len(self.violations)
        self.position = position
        self.events += 1
        self._current = event
        self._stream = self._entry(event.originator_id)
        pending = self.pending
        if pending is not None and not self._completes(pending, event):
            self._unpaired(pending, "in the same transaction")
            self.pending = None
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)
        elif type(event) not in self.IGNORED:
            self._unknown(event)
        self._log_time(event)
        self._versions(event)
        if len(self.violations) == found_before:
            return []
        return self.violations[found_before:]

    def finish(self, after: Any = None) -> list[Violation]:
        """At the end of the log: an unpaired part of a transaction is a violation too.
        At a cut (``--until``), ``after`` is the event just past it: a cut may fall
        inside a transaction, whose other part is then that event."""
        self._finish_times()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if after is None:
                self._unpaired(pending, "before the end of the log")
            elif not self._completes(pending, after):
                self._unpaired(pending, "in the same transaction")
        return self.violations

    def _unpaired(self, pending: Pending, where: str) -> None:
        rule = "invariant-3" if pending.kind == "token" else "invariant-2"
        self._violate(
            rule,
            f"{pending.kind} of {pending.sandbox_id}#{pending.generation} at "
            f"#{pending.position} has no matching {WANTED[pending.kind]} {where}",
        )

    # the event class that completes each kind of pending part of a transaction
    COMPLETING: ClassVar[Mapping[str, type[Any]]] = MappingProxyType(
        {
            "reserve": Runner.CapacityReserved,
            "release": Runner.CapacityReleased,
            "token": FencingTokenUse.Used,
        }
    )

    def _completes(self, pending: Pending, event: Any) -> bool:
        return isinstance(event, self.COMPLETING[pending.kind])

    def _unknown(self, event: Any) -> None:
        """An event of a class the fold neither checks nor ignores (an event added to an
        aggregate without teaching the audit, or one from outside the catalogue)."""
        self._violate(
            "unknown-event",
            f"event class {get_topic(type(event))} is neither checked nor ignored by the audit",
        )

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
            lease.record(lease.version, event.timestamp, LEASE_WINDOW)

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
