"""What-if replay: a recorded history's demand replayed in memory under changes.

Pure, like the audit fold beside it (``domain/audit/fold.py``): :class:`WhatIf` is fed
decoded events with their notification positions, in log order, and writes nothing. It
keeps two fleets (:mod:`.whatif_fleet`): the recorded one (reservations as the log has
them, for the utilisation before) and the counterfactual one, in which every recorded
decision is decided again by the placement rules:

- ``Sandbox.Created`` and a refused ``create_sandbox`` (``RefusalLog.Refused``): a home
  decision over every runner of the pool, ranked by the policy (``domain/placement/ranking.py``);
- ``Sandbox.AssignmentFenced`` and a refused ``schedule``: a placement on the sandbox's
  counterfactual home runner, which reserves its capacity when every rule passes.

Everything else is replayed as recorded (registrations, heartbeats, drains, allocatable
changes, deregistrations, and each sandbox's lifecycle in its recorded order and times)
unless a change (:class:`~.whatif_changes.WhatIfChanges`) overrides it. Each decision is
compared with its record (:mod:`.whatif_evidence`) and tallied (:mod:`.whatif_report`).
With no change every decision must be reproduced. The demand model and its limits are
in docs/audit.md ("audit whatif").
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import orjson

from secondbox_scheduler.domain.errors import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
)
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease, materialization_snapshots
from secondbox_scheduler.domain.placement.evidence import (
    CandidateRecord,
    RunnerEvaluation,
    Unlisted,
    reason_keys,
)
from secondbox_scheduler.domain.placement.ranking import SEED
from secondbox_scheduler.domain.placement.rules import evaluate_runner
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot
from secondbox_scheduler.domain.whatif.changes import (
    AllocatableFrom,
    RunnerClones,
    RunnerFrom,
    WhatIfChanges,
)
from secondbox_scheduler.domain.whatif.evidence import (
    OUTCOME_PLACED,
    OUTCOME_REFUSED,
    OUTCOME_SKIPPED,
    RUNNER_CODES,
    DecisionView,
    compare_home_evidence,
    compare_placement_evidence,
    compare_runner_codes,
    recorded_keys,
    recorded_view,
    replayed_view,
)
from secondbox_scheduler.domain.whatif.fleet import Fleet, FleetRunner, Lease
from secondbox_scheduler.domain.whatif.pools import PoolView
from secondbox_scheduler.domain.whatif.report import (
    EVIDENCE_CHANGED,
    OPERATION_CREATE,
    OPERATION_SCHEDULE,
    REPRODUCED,
    SKIPPED,
    Tally,
    WhatIfReport,
    change_kind,
)
from secondbox_scheduler.domain.whatif.usage import usage_dict

_ANY_REQUIREMENTS = Requirements()  # for the rules that look at the runner alone


@dataclass
class _Sandbox:
    sandbox_id: str
    requirements: Requirements
    capacity: dict[str, int]
    home: str | None = None  # the counterfactual home runner (None: not created there)
    generation: int = 1  # the recorded current generation
    assignments: dict[int, str] = field(default_factory=dict)  # generation -> runner
    holding: set[int] = field(default_factory=set)  # generations still reserving


@dataclass(frozen=True)
class _Change:
    at: datetime | None  # None: from the start of the window
    order: int
    runner: str  # the recorded runner it waits for
    apply: Callable[[], bool]  # False: that runner is not registered yet


# Events of a sandbox's current generation that change no capacity (see WhatIf.lifecycle).
LIFECYCLE: frozenset[type[Any]] = frozenset({
    Sandbox.AssignmentRunning, Sandbox.AssignmentFailed, Sandbox.AssignmentUncertain,
    Sandbox.ReconcileClaimed, Sandbox.ReconcileClaimReleased, Sandbox.ReconcileScheduled,
})  # fmt: skip


def _refusal_error(evaluations: Sequence[RunnerEvaluation], error: type[Exception]) -> str:
    if any(evaluation.failed_only_egress for evaluation in evaluations):
        return EgressContextUnavailableError.__name__
    return error.__name__


class WhatIf:
    """Replays events in log order under ``changes``; :meth:`report` says what changed."""

    def __init__(self, changes: WhatIfChanges | None = None) -> None:
        self.changes = changes or WhatIfChanges()
        # the seed's ranking is the pool views' own key (None): docs/spec.md (section 3)'s rank key
        self.policy = None if self.changes.policy is SEED else self.changes.policy
        self.timeout = self.changes.heartbeat_timeout
        self.recorded = Fleet()  # reservations as the log has them
        self.fleet = Fleet()  # the counterfactual
        self.sandboxes: dict[str, _Sandbox] = {}
        # a runner's stream -> its id; a sandbox's and its refusal log's -> the sandbox id
        self.streams: dict[UUID | str, Any] = {}
        self.leases: dict[UUID, Lease] = {}
        self.views: dict[tuple[int, timedelta], PoolView] = {}
        self.requirement_values: dict[bytes, Requirements] = {}
        self.tally = Tally(WhatIfReport(self.changes.describe(), self.changes.policy.name))
        self.extra: set[tuple[str, int]] = set()  # placed only in the counterfactual
        self.started = False
        self.done = False
        self.position = 0
        self.events = 0
        self.changes_due = self._timed_changes()
        self.unknown: dict[str, int] = {}  # events of classes the replay does not know
        self.waiting: dict[str, list[_Change]] = {}  # changes of runners not yet registered
        self.clone_ids = {runner_id for c in self.changes.add for runner_id in c.ids}
        self._handlers: dict[type[Any], Callable[[int, Any], None]] = {
            Runner.Registered: self._registered,
            Runner.CapacityReserved: self._capacity_reserved,
            Runner.CapacityReleased: self._capacity_released,
            Runner.DrainStarted: self._drain_started,
            Runner.DrainCancelled: self._drain_cancelled,
            Runner.AllocatableChanged: self._allocatable_changed,
            Runner.Deregistered: self._deregistered,
            RunnerLease.Opened: self._lease_opened,
            RunnerLease.LivenessRenewed: self._lease_renewed,
            RunnerLease.EvidenceRecorded: self._lease_evidence,
            Sandbox.Created: self._sandbox_created,
            Sandbox.AssignmentFenced: self._fenced,
            Sandbox.AssignmentReleased: self._released,
            Sandbox.GenerationAdvanced: self._advanced,
            RefusalLog.Opened: self._refusal_log_opened,
            RefusalLog.Refused: self._refused,
            # the token index saved with each fence: nothing to replay (the fence is)
            FencingTokenUse.Used: lambda position, event: None,
        }

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
                self._fire(moment)
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(position, event)
        elif type(event) in LIFECYCLE:
            self._lifecycle(event.originator_id)
        else:
            name = type(event).__qualname__
            self.unknown[name] = self.unknown.get(name, 0) + 1

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

    def _lifecycle(self, stream: UUID | str) -> None:
        if self.started:
            sandbox_id = self.streams.get(stream)
            sandbox = self.sandboxes.get(sandbox_id) if isinstance(sandbox_id, str) else None
            if sandbox is not None and sandbox.generation not in sandbox.assignments:
                self.tally.report.lifecycle_skipped += 1

    # -- changes ----------------------------------------------------------------

    def _timed_changes(self) -> list[_Change]:
        found: list[tuple[datetime | None, str, Callable[[], bool]]] = []
        for drain in self.changes.drain:
            found.append((drain.at, drain.runner, functools.partial(self._drain_change, drain)))
        for removal in self.changes.remove:
            apply = functools.partial(self._remove_change, removal)
            found.append((removal.at, removal.runner, apply))
        for resize in self.changes.allocatable:
            apply = functools.partial(self._allocatable_change, resize)
            found.append((resize.at, resize.runner, apply))
        for clones in self.changes.add:
            found.append((clones.at, clones.source, functools.partial(self._add, clones)))
        changes = [_Change(at, order, runner, apply) for order, (at, runner, apply) in
                   enumerate(found)]  # fmt: skip
        untimed = [change for change in changes if change.at is None]
        timed = sorted((c for c in changes if c.at is not None), key=lambda c: (c.at, c.order))
        return untimed + timed

    def _fire(self, moment: datetime) -> None:
        due = self.changes_due
        while due and (due[0].at is None or moment >= due[0].at):
            change = due.pop(0)
            if not change.apply():
                self.waiting.setdefault(change.runner, []).append(change)

    def _drain_change(self, change: RunnerFrom) -> bool:
        runner = self.fleet.runners.get(change.runner)
        if runner is None:
            return False
        runner.drained = True
        self.fleet.drain(runner, True)
        return True

    def _remove_change(self, change: RunnerFrom) -> bool:
        runner = self.fleet.runners.get(change.runner)
        if runner is None:
            return False
        runner.removed = True
        self.fleet.leave(runner)
        return True

    def _allocatable_change(self, change: AllocatableFrom) -> bool:
        runner = self.fleet.runners.get(change.runner)
        if runner is None:
            return False
        runner.fixed = True
        if not runner.removed:
            self.fleet.resize(runner, change.applied_to(runner.pending or runner.allocatable))
        return True

    def _add(self, change: RunnerClones) -> bool:
        source = self.fleet.runners.get(change.source)
        if source is None:
            return False
        for runner_id in change.ids:
            if runner_id in self.fleet.runners:
                raise InvalidRequestError(
                    "add", f"runner {runner_id!r} is already registered in the history"
                )
            self.fleet.clone(source, runner_id)
        return True

    # -- runners ----------------------------------------------------------------

    def _registered(self, position: int, event: Any) -> None:
        runner_id = event.runner_id
        if runner_id in self.clone_ids:
            raise InvalidRequestError(
                "add", f"runner {runner_id!r} is registered by the history at #{position}"
            )
        self.streams[event.originator_id] = runner_id
        self.recorded.register(FleetRunner(event))
        self.fleet.register(FleetRunner(event))
        for change in self.waiting.pop(runner_id, []):
            change.apply()

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
            requirements = self._requirements(event.requirements)
            sandbox = self.sandboxes[event.sandbox_id] = _Sandbox(
                event.sandbox_id, requirements, requirements.capacity.as_dict()
            )
        if not self.started:
            sandbox.home = event.home_runner_id
            return
        record = event.home_decision
        sandbox.home = self._home_decision(
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
                self._kept(event, unlisted)
                return
            if sandbox is None:
                requirements = self._requirements(wanted)
                sandbox = self.sandboxes[sandbox_id] = _Sandbox(
                    sandbox_id, requirements, requirements.capacity.as_dict()
                )
            sandbox.home = self._home_decision(
                position, event.timestamp, sandbox, record, event.candidates, unlisted,
                None, event.error,
            )  # fmt: skip
        elif sandbox is not None:
            self._placement(
                position, event.timestamp, sandbox, event.generation, record,
                None, event.error, event.candidates,
            )  # fmt: skip

    def _requirements(self, record: Mapping[str, Any]) -> Requirements:
        """The requirements of a record; equal records share one value (sandboxes of
        one ProfileRevision), so that pool views are found by identity."""
        key = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
        found = self.requirement_values.get(key)
        if found is None:
            found = self.requirement_values[key] = Requirements.from_record(record)
        return found

    def _timeout(self, seconds: float) -> timedelta:
        return self.timeout or timedelta(seconds=seconds)

    def _home_decision(
        self,
        position: int,
        moment: datetime,
        sandbox: _Sandbox,
        record: Mapping[str, Any],
        candidates: Sequence[CandidateRecord],
        unlisted: Unlisted,
        recorded_home: str | None,
        recorded_error: str | None,
    ) -> str | None:
        """Decide a home runner again over the counterfactual pool; tally the decision."""
        requirements = sandbox.requirements
        view: PoolView | None = None
        home, error = sandbox.home, None  # a sandbox already created: an idempotent repeat
        if home is None:
            view = self._pool_view(requirements, self._timeout(record["heartbeat_timeout_seconds"]))
            view.at(record["decided_at"])
            chosen = view.chosen()
            home = chosen.runner_id if chosen is not None else None
            if home is None:
                error = (EgressContextUnavailableError if view.egress_only
                         else NoCompatibleRunnerError).__name__  # fmt: skip
                self.tally.refusal("after", OPERATION_CREATE, error, view.recorded)
        if recorded_home is None:
            self.tally.refusal(
                "before", OPERATION_CREATE, recorded_error, _listed_keys(candidates, unlisted)
            )
        detail: str | None
        if recorded_home == home and recorded_error == error:
            detail = None
            if view is not None:
                detail = compare_home_evidence(candidates, unlisted, view.counts(), view.lookup)
            kind = REPRODUCED if detail is None else EVIDENCE_CHANGED
        else:
            kind = change_kind(recorded_home, home)
            detail = f"recorded {recorded_home or recorded_error}, replayed {home or error}"

        def views() -> tuple[DecisionView, DecisionView]:
            return (
                recorded_view(
                    OUTCOME_PLACED if recorded_home else OUTCOME_REFUSED,
                    candidates, unlisted, runner_id=recorded_home, error=recorded_error,
                ),
                replayed_view(
                    OUTCOME_PLACED if home else OUTCOME_REFUSED,
                    *(view.evaluations() if view is not None else ((), ())),
                    runner_id=home, error=error, prefiltered=True,
                ),
            )  # fmt: skip

        self.tally.decision(
            position, moment, OPERATION_CREATE, sandbox.sandbox_id, 0, kind, detail, views
        )
        return home

    def _pool_view(self, requirements: Requirements, timeout: timedelta) -> PoolView:
        """The pool's evaluations for these requirements, kept current across decisions."""
        key = (id(requirements), timeout)  # one value per record: _requirements
        view = self.views.get(key)
        if view is None:
            pool_name = requirements.pool_name
            pool = self.fleet.pools.setdefault(pool_name, [])
            view = self.views[key] = PoolView(pool, requirements, timeout, self.policy)
            self.fleet.watch(pool_name, view.dirty)
        return view

    def _kept(self, event: Any, unlisted: Unlisted) -> None:
        """A refused creation recorded without its requirements (written before the
        attribute existed): it cannot be decided again, so it stays refused; check what
        the record allows."""
        report = self.tally.report
        report.kept += 1
        keys = _listed_keys(event.candidates, unlisted)
        self.tally.refusal("before", OPERATION_CREATE, event.error, keys)
        self.tally.refusal("after", OPERATION_CREATE, event.error, keys)
        timeout = self._timeout(event.heartbeat_timeout_seconds)
        snapshots = {r.runner_id: r.snapshot() for rs in self.fleet.pools.values() for r in rs}
        codes = {
            runner_id: [
                code
                for code in evaluate_runner(
                    _ANY_REQUIREMENTS, snapshot, event.decided_at, timeout
                ).reason_codes
                if code in RUNNER_CODES
            ]
            for runner_id, snapshot in snapshots.items()
        }
        if compare_runner_codes(event.candidates, unlisted, snapshots, codes) is None:
            report.kept_consistent += 1

    # -- sandboxes: placements and lifecycle ----------------------------------------

    def _fenced(self, position: int, event: Any) -> None:
        sandbox = self._sandbox_of(event)
        if sandbox is None:
            return
        record, placement = event.assignment, event.placement
        generation = record["generation"]
        if self.started:
            self._placement(
                position, event.timestamp, sandbox, generation, placement,
                record["runner_id"], None, placement["candidates"],
            )  # fmt: skip
            return
        runner = self.fleet.runners.get(record["runner_id"])  # before the window: as recorded
        if runner is not None and generation not in sandbox.assignments:
            sandbox.assignments[generation] = runner.runner_id
            sandbox.holding.add(generation)
            self.fleet.reserve(runner, sandbox.capacity, f"#{position}")

    def _placement(
        self,
        position: int,
        moment: datetime,
        sandbox: _Sandbox,
        generation: int,
        record: Mapping[str, Any],
        recorded_runner: str | None,
        recorded_error: str | None,
        candidates: Sequence[CandidateRecord],
    ) -> None:
        """Place a sandbox generation again on its counterfactual home; tally it."""
        evaluations: tuple[RunnerEvaluation, ...] = ()
        snapshot: RunnerSnapshot | None = None
        placed: str | None = None
        error: str | None = None
        outcome = OUTCOME_REFUSED
        if sandbox.home is None:
            outcome = OUTCOME_SKIPPED
        elif generation in sandbox.assignments:  # placed before: the request is a replay
            outcome, placed = OUTCOME_PLACED, sandbox.assignments[generation]
            if recorded_runner is not None:
                self.extra.discard((sandbox.sandbox_id, generation))
        else:
            runner = self.fleet.runners.get(sandbox.home)
            if runner is None or not runner.visible:
                error = HomeRunnerUnavailableError.__name__
            else:
                same = recorded_runner == runner.runner_id
                snapshot = runner.snapshot(record.get("lease_version") if same else None)
                timeout = self._timeout(record["heartbeat_timeout_seconds"])
                evaluation = evaluate_runner(
                    sandbox.requirements, snapshot, record["decided_at"], timeout
                )
                evaluations = (evaluation,)
                if evaluation.compatible:
                    outcome, placed = OUTCOME_PLACED, runner.runner_id
                    sandbox.assignments[generation] = placed
                    sandbox.holding.add(generation)
                    self.fleet.reserve(runner, sandbox.capacity, f"#{position}")
                    if recorded_runner is None:
                        self.extra.add((sandbox.sandbox_id, generation))
                else:
                    error = _refusal_error(evaluations, HomeRunnerUnavailableError)
        if recorded_runner is None:
            keys = Counter(
                k for c in candidates for k in reason_keys(RunnerEvaluation.from_record(c))
            )
            self.tally.refusal("before", OPERATION_SCHEDULE, recorded_error, keys)
        if outcome == OUTCOME_REFUSED:
            keys = Counter(k for e in evaluations for k in reason_keys(e))
            self.tally.refusal("after", OPERATION_SCHEDULE, error, keys)
        detail: str | None = None
        if outcome == OUTCOME_SKIPPED:
            kind, detail = SKIPPED, "the sandbox was not created in the replay"
        elif placed == recorded_runner and error == recorded_error:
            if placed is None:
                detail = _compare_refusal(candidates, evaluations)
            elif snapshot is not None:
                detail = compare_placement_evidence(record.get("runner", {}), snapshot)
            kind = REPRODUCED if detail is None else EVIDENCE_CHANGED
        else:
            kind = change_kind(recorded_runner, placed)
            detail = f"recorded {recorded_runner or recorded_error}, replayed {placed or error}"

        def views() -> tuple[DecisionView, DecisionView]:
            return (
                recorded_view(
                    OUTCOME_PLACED if recorded_runner else OUTCOME_REFUSED, candidates,
                    Unlisted(), runner_id=recorded_runner, error=recorded_error,
                ),
                replayed_view(outcome, evaluations, (), runner_id=placed, error=error),
            )  # fmt: skip

        self.tally.decision(
            position, moment, OPERATION_SCHEDULE, sandbox.sandbox_id, generation, kind,
            detail, views,
        )  # fmt: skip

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
        self.extra.discard((sandbox.sandbox_id, generation))
        self.fleet.release(self.fleet.runners[sandbox.assignments[generation]], sandbox.capacity)

    def _advanced(self, position: int, event: Any) -> None:
        sandbox = self._sandbox_of(event)
        if sandbox is None:
            return
        if self.started and sandbox.generation not in sandbox.assignments:
            self.tally.report.lifecycle_skipped += 1
        sandbox.generation = event.generation

    def _sandbox_of(self, event: Any) -> _Sandbox | None:
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
        report.held_to_end = len(self.extra)
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


def _listed_keys(candidates: Sequence[CandidateRecord], unlisted: Unlisted) -> Counter[str]:
    """Refused runners per reason key, as a home decision's record counts them."""
    keys: Counter[str] = Counter()
    for candidate in candidates:
        evaluation = RunnerEvaluation.from_record(candidate)
        if not evaluation.compatible:
            keys.update(recorded_keys(evaluation))
    for key, count in unlisted.reasons.items():
        keys[key] += count
    return keys


def _compare_refusal(
    candidates: Sequence[CandidateRecord], evaluations: Sequence[RunnerEvaluation]
) -> str | None:
    """A refused placement's candidates (the home runner, or none when it is absent)
    against the replay's evaluation of the home runner: ids, codes, shortfalls."""
    recorded = [RunnerEvaluation.from_record(c) for c in candidates]
    found = [(e.runner_id, [(f.code, dict(f.shortfall)) for f in e.failures]) for e in recorded]
    replayed = [
        (e.runner_id, [(f.code, dict(f.shortfall)) for f in e.failures]) for e in evaluations
    ]
    if found != replayed:
        return f"recorded {found}, replayed {replayed}"
    return None
