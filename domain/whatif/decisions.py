"""The decisions of a what-if replay: each recorded decision decided again, and tallied.

A home decision (``Sandbox.Created``, a refused ``create_sandbox``) chooses over every
runner of the pool in the counterfactual fleet, ranked by the policy
(``domain/placement/ranking.py``), from the pool's :class:`~.pools.PoolView`. A
placement (``Sandbox.AssignmentFenced``, a refused ``schedule``) evaluates the sandbox's
counterfactual home runner and reserves its capacity when every rule passes. Each
decision is compared with its record (:mod:`.evidence`) and tallied (:mod:`.report`).
:class:`Decisions` holds what the decisions share: the counterfactual fleet, the tally,
the pool views and the requirement values. The engine (:mod:`.engine`) calls it for the
events that record a decision.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

try:
    import orjson
except ImportError:  # without the [fast] extra: the json module's way (same values)
    orjson = None  # type: ignore[assignment]

from secondbox_scheduler.domain.errors import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    NoCompatibleRunnerError,
)
from secondbox_scheduler.domain.placement.evidence import (
    CandidateRecord,
    RunnerEvaluation,
    Unlisted,
    reason_keys,
)
from secondbox_scheduler.domain.placement.ranking import RankingPolicy
from secondbox_scheduler.domain.placement.rules import evaluate_runner
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot
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
from secondbox_scheduler.domain.whatif.fleet import Fleet
from secondbox_scheduler.domain.whatif.pools import PoolView
from secondbox_scheduler.domain.whatif.report import (
    EVIDENCE_CHANGED,
    OPERATION_CREATE,
    OPERATION_SCHEDULE,
    REPRODUCED,
    SKIPPED,
    Tally,
    change_kind,
)

_ANY_REQUIREMENTS = Requirements()  # for the rules that look at the runner alone


@dataclass
class SandboxState:
    """One sandbox in the counterfactual: where it lives and what it holds."""

    sandbox_id: str
    requirements: Requirements
    capacity: dict[str, int]
    home: str | None = None  # the counterfactual home runner (None: not created there)
    generation: int = 1  # the recorded current generation
    assignments: dict[int, str] = field(default_factory=dict)  # generation -> runner
    holding: set[int] = field(default_factory=set)  # generations still reserving


class Decisions:
    """Decides recorded decisions again over the counterfactual ``fleet``; tallies them.

    ``policy`` ranks home decisions (None: the pool views' own key, the seed's);
    ``timeout`` replaces every record's heartbeat timeout (None: the record's)."""

    def __init__(
        self,
        fleet: Fleet,
        tally: Tally,
        policy: RankingPolicy | None,
        timeout: timedelta | None,
    ) -> None:
        self.fleet = fleet
        self.tally = tally
        self.policy = policy
        self.timeout = timeout
        self.views: dict[tuple[int, timedelta], PoolView] = {}
        self.requirement_values: dict[bytes, Requirements] = {}
        self.extra: set[tuple[str, int]] = set()  # placed only in the counterfactual

    def requirements(self, record: Mapping[str, Any]) -> Requirements:
        """The requirements of a record; equal records share one value (sandboxes of
        one ProfileRevision), so that pool views are found by identity."""
        if orjson is not None:
            key = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
        else:
            key = json.dumps(record, sort_keys=True, default=str).encode()
        found = self.requirement_values.get(key)
        if found is None:
            found = self.requirement_values[key] = Requirements.from_record(record)
        return found

    def new_sandbox(self, sandbox_id: str, record: Mapping[str, Any]) -> SandboxState:
        """A sandbox of the recorded requirements ``record``, not yet homed."""
        requirements = self.requirements(record)
        return SandboxState(sandbox_id, requirements, requirements.capacity.as_dict())

    def _timeout(self, seconds: float) -> timedelta:
        return self.timeout or timedelta(seconds=seconds)

    # -- home decisions ---------------------------------------------------------------

    def home(
        self,
        position: int,
        moment: datetime,
        sandbox: SandboxState,
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
        key = (id(requirements), timeout)  # one value per record: requirements()
        view = self.views.get(key)
        if view is None:
            pool_name = requirements.pool_name
            pool = self.fleet.pools.setdefault(pool_name, [])
            view = self.views[key] = PoolView(pool, requirements, timeout, self.policy)
            self.fleet.watch(pool_name, view.dirty)
        return view

    def kept(self, event: Any, unlisted: Unlisted) -> None:
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

    # -- placements -------------------------------------------------------------------

    def placement(
        self,
        position: int,
        moment: datetime,
        sandbox: SandboxState,
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


def _refusal_error(evaluations: Sequence[RunnerEvaluation], error: type[Exception]) -> str:
    if any(evaluation.failed_only_egress for evaluation in evaluations):
        return EgressContextUnavailableError.__name__
    return error.__name__


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
