"""What-if replay: a recorded history's demand replayed in memory under changes.

Pure, like the audit fold beside it (``domain/audit/fold.py``): :class:`WhatIf` is fed
decoded events with their notification positions, in log order, and writes nothing. It
keeps two fleets (:mod:`.fleet`): the recorded one (reservations as the log has them,
for the utilisation before) and the counterfactual one, in which every recorded
decision is decided again by the placement rules (:mod:`.decisions`):

- ``Sandbox.Created`` and a refused ``create_sandbox`` (``RefusalLog.Refused``): a home
  decision over every runner of the pool, ranked by the policy (``domain/placement/ranking.py``);
- ``Sandbox.AssignmentFenced`` and a refused ``schedule``: a placement on the sandbox's
  counterfactual home runner, which reserves its capacity when every rule passes.

Everything else is replayed as recorded (registrations, heartbeats, drains, allocatable
changes, deregistrations, and each sandbox's lifecycle in its recorded order and times)
unless a change (:class:`~.changes.WhatIfChanges`, applied when due by
:mod:`.scheduled`) overrides it. Each decision is compared with its record
(:mod:`.evidence`) and tallied (:mod:`.report`). With no change every decision must be
reproduced. The demand model and its limits are in docs/audit.md ("audit whatif").

Every event class the aggregates record (``domain/event_catalogue.py``) has a handler in
:attr:`WhatIf.HANDLERS` or a reason in :attr:`WhatIf.IGNORED`; an event of any other
class is not replayed but counted by topic (the report's ``unknown_events``), and the
report then says the history was not reproduced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, ClassVar
from uuid import UUID

from eventsourcing.utils import get_topic

from secondbox_scheduler.domain.access_tokens import ACCESS_TOKEN_EVENTS
from secondbox_scheduler.domain.cell_claims import CELL_CLAIM_EVENTS
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease, materialization_snapshots
from secondbox_scheduler.domain.placement.evidence import Unlisted
from secondbox_scheduler.domain.placement.ranking import SEED
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.whatif.changes import WhatIfChanges
from secondbox_scheduler.domain.whatif.decisions import Decisions, SandboxState
from secondbox_scheduler.domain.whatif.fleet import Fleet, FleetRunner, Lease
from secondbox_scheduler.domain.whatif.report import OPERATION_CREATE, Tally, WhatIfReport
from secondbox_scheduler.domain.whatif.scheduled import ScheduledChanges
from secondbox_scheduler.domain.whatif.usage import usage_dict

# Events of a sandbox's current generation that change no capacity (see WhatIf.lifecycle).
LIFECYCLE: frozenset[type[Any]] = frozenset({
    Sandbox.AssignmentRunning, Sandbox.AssignmentFailed, Sandbox.AssignmentUncertain,
    Sandbox.ReconcileClaimed, Sandbox.ReconcileClaimReleased, Sandbox.ReconcileScheduled,
})  # fmt: skip


class WhatIf:
    """Replays events in log order under ``changes``; :meth:`report` says what changed."""

    # Each event class the replay handles, and the name of its handler (called with the
    # notification position and the event).
    HANDLERS: ClassVar[Mapping[type[Any], str]] = {
        Runner.Registered: "_registered",
        Runner.CapacityReserved: "_capacity_reserved",
        Runner.CapacityReleased: "_capacity_released",
        Runner.DrainStarted: "_drain_started",
        Runner.DrainCancelled: "_drain_cancelled",
        Runner.AllocatableChanged: "_allocatable_changed",
        Runner.Deregistered: "_deregistered",
        RunnerLease.Opened: "_lease_opened",
        RunnerLease.LivenessRenewed: "_lease_renewed",
        RunnerLease.EvidenceRecorded: "_lease_evidence",
        Sandbox.Created: "_sandbox_created",
        Sandbox.AssignmentFenced: "_fenced",
        Sandbox.AssignmentReleased: "_released",
        Sandbox.GenerationAdvanced: "_advanced",
        **dict.fromkeys(LIFECYCLE, "_lifecycle_event"),
        RefusalLog.Opened: "_refusal_log_opened",
        RefusalLog.Refused: "_refused",
    }
    # Each event class the replay reads past, and why.
    IGNORED: ClassVar[Mapping[type[Any], str]] = {
        FencingTokenUse.Used: (
            "the token index saved with each fence: nothing to replay (the fence itself, "
            "Sandbox.AssignmentFenced, is)"
        ),
        **dict.fromkeys(
            ACCESS_TOKEN_EVENTS, "who may call the service changes no placement: nothing to replay"
        ),
        **dict.fromkeys(
            CELL_CLAIM_EVENTS, "which cell holds an id changes no placement: nothing to replay"
        ),
    }

    @classmethod
    def handled_events(cls) -> frozenset[type[Any]]:
        """The event classes the replay has a handler for."""
        return frozenset(cls.HANDLERS)

    def __init__(self, changes: WhatIfChanges | None = None) -> None:
        self.changes = changes or WhatIfChanges()
        # the seed ranking is the pool views' own key (None): docs/spec.md (section 3)
        self.policy = None if self.changes.policy is SEED else self.changes.policy
        self.timeout = self.changes.heartbeat_timeout
        self.recorded = Fleet()  # reservations as the log has them
        self.fleet = Fleet()  # the counterfactual
        self.sandboxes: dict[str, SandboxState] = {}
        # a runner's stream -> its id; a sandbox's and its refusal log's -> the sandbox id
        self.streams: dict[UUID | str, Any] = {}
        self.leases: dict[UUID, Lease] = {}
        self.tally = Tally(WhatIfReport(self.changes.describe(), self.changes.policy.name))
        self.decisions = Decisions(self.fleet, self.tally, self.policy, self.timeout)
        self.scheduled = ScheduledChanges(self.changes, self.fleet)
        self.changes_due = self.scheduled.due  # the same list: fired changes leave it
        self.started = False
        self.done = False
        self.position = 0
        self.events = 0
        self.unknown: dict[str, int] = {}  # events of classes the replay does not know
        self._handlers: dict[type[Any], Callable[[int, Any], None]] = {
            event_class: getattr(self, name) for event_class, name in self.HANDLERS.items()
        }
        self._ignored = frozenset(self.IGNORED)

    # -- driving --------------------------------------------------------------

    def apply(self, position: int, event: Any) -> None:
        """Replay one event at notification ``position`` (log order). Past the window's
        end it only sets :attr:`done`."""
        window = self.changes.window
        moment: datetime = event.timestamp
        until = window.until
        if until is not None and (position > until if isinstance(until, int) else moment > until):
            self.done = True
            return
        self.position = position
        self.events += 1
        self.recorded.usage.at(moment)
        self.fleet.usage.at(moment)
        if not self.started:
            start = window.start
            if start is None or (position >= start if isinstance(start, int) else moment >= start):
                self.started = True
                self.recorded.usage.begin()
                self.fleet.usage.begin()
        if self.started and self.changes_due:
            at = self.changes_due[0].at
            if at is None or moment >= at:
                self.scheduled.fire(moment)
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(position, event)
        elif type(event) not in self._ignored:
            topic = get_topic(type(event))
            self.unknown[topic] = self.unknown.get(topic, 0) + 1

    def undecoded(self) -> frozenset[type[Any]]:
        """Event classes the replay needs no attribute of (only the stream and the
        position: :meth:`lifecycle`), so a reader may skip decoding them; none when the
        window is bounded by times, which needs every event's time."""
        window = self.changes.window
        if isinstance(window.start, datetime) or isinstance(window.until, datetime):
            return frozenset()
        return LIFECYCLE

    def lifecycle(self, position: int, stream: UUID | str) -> None:
        """A lifecycle event of a sandbox's current generation (running, failed,
        uncertain, reconcile claims): no capacity changes hands; it is skipped, and
        counted, when the counterfactual did not place that generation."""
        if self.done:
            return
        until = self.changes.window.until
        if isinstance(until, int) and position > until:
            self.done = True
            return
        self.position = position
        self.events += 1
        start = self.changes.window.start
        if not self.started and (start is None or (isinstance(start, int) and position >= start)):
            self.started = True
            self.recorded.usage.begin()
            self.fleet.usage.begin()
        self._lifecycle(stream)

    def _lifecycle_event(self, position: int, event: Any) -> None:
        self._lifecycle(event.originator_id)

    def _lifecycle(self, stream: UUID | str) -> None:
        if self.started:
            sandbox_id = self.streams.get(stream)
            sandbox = self.sandboxes.get(sandbox_id) if isinstance(sandbox_id, str) else None
            if sandbox is not None and sandbox.generation not in sandbox.assignments:
                self.tally.report.lifecycle_skipped += 1

    # -- runners ----------------------------------------------------------------

    def _registered(self, position: int, event: Any) -> None:
        runner_id = event.runner_id
        if runner_id in self.scheduled.clone_ids:
            raise InvalidRequestError(
                "add", f"runner {runner_id!r} is registered by the history at #{position}"
            )
        self.streams[event.originator_id] = runner_id
        self.recorded.register(FleetRunner(event))
        self.fleet.register(FleetRunner(event))
        self.scheduled.registered(runner_id)

    def _runners(self, event: Any) -> tuple[FleetRunner, FleetRunner] | None:
        runner_id = self.streams.get(event.originator_id)
        recorded = self.recorded.runners.get(runner_id) if isinstance(runner_id, str) else None
        if recorded is None:
            return None
        return recorded, self.fleet.runners[recorded.runner_id]

    def _capacity_reserved(self, position: int, event: Any) -> None:
        pair = self._runners(event)
        if pair is not None:
            self.recorded.reserve(pair[0], event.capacity, f"#{position}")

    def _capacity_released(self, position: int, event: Any) -> None:
        pair = self._runners(event)
        if pair is not None:
            self.recorded.release(pair[0], event.capacity)

    def _drain_started(self, position: int, event: Any) -> None:
        pair = self._runners(event)
        if pair is not None:
            self.fleet.drain(pair[1], True)

    def _drain_cancelled(self, position: int, event: Any) -> None:
        pair = self._runners(event)
        if pair is not None and not pair[1].drained:
            self.fleet.drain(pair[1], False)

    def _allocatable_changed(self, position: int, event: Any) -> None:
        pair = self._runners(event)
        if pair is None:
            return
        recorded, runner = pair
        self.recorded.resize(recorded, dict(event.allocatable))
        if not runner.fixed and not runner.removed:
            self.fleet.resize(runner, dict(event.allocatable))

    def _deregistered(self, position: int, event: Any) -> None:
        pair = self._runners(event)
        if pair is not None:
            self.recorded.leave(pair[0])
            self.fleet.leave(pair[1])

    # -- leases -----------------------------------------------------------------

    def _lease_opened(self, position: int, event: Any) -> None:
        self.leases[event.originator_id] = self.fleet.open_lease(event.runner_id)

    def _lease_renewed(self, position: int, event: Any) -> None:
        lease = self.leases.get(event.originator_id)
        if lease is not None:
            lease.heartbeat = event.at
            self.fleet.lease_changed(lease, event.originator_version)

    def _lease_evidence(self, position: int, event: Any) -> None:
        lease = self.leases.get(event.originator_id)
        if lease is not None:
            lease.heartbeat = event.at
            lease.digests = tuple(event.artifact_digests)
            lease.materializations = materialization_snapshots(event.materializations)
            self.fleet.lease_changed(lease, event.originator_version)

    # -- sandboxes: home decisions ------------------------------------------------

    def _refusal_log_opened(self, position: int, event: Any) -> None:
        self.streams[event.originator_id] = event.sandbox_id

    def _sandbox_created(self, position: int, event: Any) -> None:
        self.streams[event.originator_id] = event.sandbox_id
        sandbox = self.sandboxes.get(event.sandbox_id)
        if sandbox is None or sandbox.home is None:  # new, or refused before
            sandbox = self.sandboxes[event.sandbox_id] = self.decisions.new_sandbox(
                event.sandbox_id, event.requirements
            )
        if not self.started:
            sandbox.home = event.home_runner_id
            return
        record = event.home_decision
        sandbox.home = self.decisions.home(
            position, event.timestamp, sandbox, record, record["candidates"],
            Unlisted.from_record(record.get("unlisted")), event.home_runner_id, None,
        )  # fmt: skip

    def _refused(self, position: int, event: Any) -> None:
        sandbox_id = self.streams.get(event.originator_id)
        if not isinstance(sandbox_id, str) or not self.started:
            return
        unlisted = Unlisted.from_record(getattr(event, "unlisted", None))
        record = {
            "decided_at": event.decided_at,
            "heartbeat_timeout_seconds": event.heartbeat_timeout_seconds,
        }
        sandbox = self.sandboxes.get(sandbox_id)
        if event.operation == OPERATION_CREATE:
            wanted = getattr(event, "requirements", None)
            if wanted is None:
                self.decisions.kept(event, unlisted)
                return
            if sandbox is None:
                sandbox = self.sandboxes[sandbox_id] = self.decisions.new_sandbox(
                    sandbox_id, wanted
                )
            sandbox.home = self.decisions.home(
                position, event.timestamp, sandbox, record, event.candidates, unlisted,
                None, event.error,
            )  # fmt: skip
        elif sandbox is not None:
            self.decisions.placement(
                position, event.timestamp, sandbox, event.generation, record,
                None, event.error, event.candidates,
            )  # fmt: skip

    # -- sandboxes: placements and lifecycle ----------------------------------------

    def _fenced(self, position: int, event: Any) -> None:
        sandbox = self._sandbox_of(event)
        if sandbox is None:
            return
        record, placement = event.assignment, event.placement
        generation = record["generation"]
        if self.started:
            self.decisions.placement(
                position, event.timestamp, sandbox, generation, placement,
                record["runner_id"], None, placement["candidates"],
            )  # fmt: skip
            return
        runner = self.fleet.runners.get(record["runner_id"])  # before the window: as recorded
        if runner is not None and generation not in sandbox.assignments:
            sandbox.assignments[generation] = runner.runner_id
            sandbox.holding.add(generation)
            self.fleet.reserve(runner, sandbox.capacity, f"#{position}")

    def _released(self, position: int, event: Any) -> None:
        sandbox = self._sandbox_of(event)
        if sandbox is None:
            return
        generation = event.generation
        if generation not in sandbox.holding:
            if self.started:
                self.tally.report.lifecycle_skipped += 1
            return
        sandbox.holding.discard(generation)
        self.decisions.extra.discard((sandbox.sandbox_id, generation))
        self.fleet.release(self.fleet.runners[sandbox.assignments[generation]], sandbox.capacity)

    def _advanced(self, position: int, event: Any) -> None:
        sandbox = self._sandbox_of(event)
        if sandbox is None:
            return
        if self.started and sandbox.generation not in sandbox.assignments:
            self.tally.report.lifecycle_skipped += 1
        sandbox.generation = event.generation

    def _sandbox_of(self, event: Any) -> SandboxState | None:
        sandbox_id = self.streams.get(event.originator_id)
        return self.sandboxes.get(sandbox_id) if isinstance(sandbox_id, str) else None

    # -- the end -----------------------------------------------------------------

    def report(self) -> WhatIfReport:
        """The report of everything replayed (call once, at the end)."""
        unknown = sorted(self.changes.runners_named() - set(self.recorded.runners))
        if unknown:
            raise InvalidRequestError(
                "changes", f"no runner {unknown[0]!r} in the history (up to the window's end)"
            )
        self.tally.finish()
        report = self.tally.report
        report.events, report.position = self.events, self.position
        report.held_to_end = len(self.decisions.extra)
        report.allocatable_waits = self.fleet.waits
        report.unknown_events = dict(sorted(self.unknown.items()))
        report.invariant_violations = list(self.fleet.violations)
        report.utilisation = {
            "before": usage_dict(self.recorded.usage.summary()),
            "after": usage_dict(self.fleet.usage.summary()),
        }
        window = self.changes.window
        report.window = {"from": _bound(window.start), "until": _bound(window.until)}
        return report


def _bound(value: int | datetime | None) -> int | str | None:
    return value.isoformat() if isinstance(value, datetime) else value
