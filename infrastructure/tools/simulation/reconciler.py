"""The simulation's reconcilers: :class:`SimulationReconciler` ("simulator-reconciler")
and :class:`ScriptedPeer` ("simulator-peer"), a second process scripted to race it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from secondbox_scheduler.domain.assignment import STATE_FAILED
from secondbox_scheduler.domain.errors import (
    ReconcileClaimError,
    RunnerNotFoundError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.reconcile import (
    ACTION_DEADLINE_EXCEEDED,
    ReconcileDecision,
    decide_reconcile,
)
from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.reconciler import Reconciler
from secondbox_scheduler.infrastructure.tools.simulation.config import (
    HEARTBEAT_TIMEOUT,
    PEER_OWNER,
    PEER_RACES,
    RECONCILE_CLAIM_TTL,
    RECONCILE_INTERVAL,
)


class SimulationReconciler(Reconciler):
    """The simulation's :class:`Reconciler`: the same passes on simulated time, but

    - it sees only the run's own sandboxes (ids starting with ``prefix``), so a run
      appended to a store never reconciles another run's assignments;
    - it tells a ``deadline_exceeded`` redelivery from a terminal failure;
    - ``before_claim`` (when set) runs between reading the due list and claiming each
      due assignment: where another reconciler process could get in first.
    """

    def __init__(self, app: SchedulerApplication, owner: str, prefix: str = "") -> None:
        super().__init__(
            app,
            owner,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            claim_ttl=RECONCILE_CLAIM_TTL,
            interval=RECONCILE_INTERVAL,
        )
        self.prefix = prefix
        self.redeliveries = 0
        self.terminal_failures = 0
        self.before_claim: Callable[[DurableAssignment], None] | None = None

    def run_once(self) -> tuple[int, int]:
        if not self.prefix:
            return super().run_once()
        read_models = self.app.current_read_models()
        assert read_models is not None
        found = read_models.assignments.due_for_reconcile(self.app.now(), limit=2**31)
        due = [a for a in found if a.sandbox_id.startswith(self.prefix)][: self.batch]
        self.report.passes += 1
        self.report.due += len(due)
        done = sum(self._reconcile(assignment) for assignment in due)
        return len(due), done

    def reconcile(self, due: DurableAssignment) -> int:
        """Claim, decide, commit and release one assignment: 1 if a result was committed."""
        return self._reconcile(due)

    def _reconcile(self, due: DurableAssignment) -> int:
        if self.before_claim is not None:
            self.before_claim(due)
        exceeded = self.report.actions[ACTION_DEADLINE_EXCEEDED]
        done = super()._reconcile(due)
        if self.report.actions[ACTION_DEADLINE_EXCEEDED] > exceeded:
            current = self.app.get_assignment(due.sandbox_id, due.generation)
            if current is not None and current.state == STATE_FAILED:
                self.terminal_failures += 1
            else:
                self.redeliveries += 1
        return done


@dataclass
class _PausedClaim:
    due: DurableAssignment
    decision: ReconcileDecision
    until: datetime


class ScriptedPeer(SimulationReconciler):
    """A second reconciler process that joins half-way (:meth:`join`) and gets in between
    the simulator's reconciler's due read and its claim (:meth:`claim_first`, set as that
    reconciler's ``before_claim``).

    ``will_not_move(sandbox_id)`` tells whether a sandbox will stay as it is for the rest
    of the run, so that a claim the peer pauses on cannot be overtaken by its sandbox.
    """

    def __init__(
        self, app: SchedulerApplication, prefix: str, will_not_move: Callable[[str], bool]
    ) -> None:
        super().__init__(app, PEER_OWNER, prefix)
        self.will_not_move = will_not_move
        self.joined = False
        self.races_left = 0
        self.pauses_left = 0
        self.won: list[DurableAssignment] = []
        self.paused: list[_PausedClaim] = []

    def join(self) -> None:
        """A second reconciler process joins, for a while."""
        self.joined = True
        self.races_left = PEER_RACES
        self.pauses_left = 1

    def claim_first(self, due: DurableAssignment) -> None:
        """Between the reconciler's due read and its claim, the scripted peer may claim first:
        a few times to win the race (it commits after the pass, see :meth:`finish_won`), once
        to pause with the claim past its expiry (see :meth:`wake`), on a sandbox that will
        not move."""
        if self.races_left > 0:
            self.races_left -= 1
            self._claim(due)
            self.won.append(due)
        elif self.pauses_left > 0 and self.will_not_move(due.sandbox_id):
            self.pauses_left -= 1
            until = self._claim(due)
            current = self.app.get_assignment(due.sandbox_id, due.generation)
            assert current is not None
            try:
                home: RunnerSnapshot | None = self.app.fold_runner(current.runner_id)
            except RunnerNotFoundError:
                home = None
            decision = decide_reconcile(
                current, home, self.app.now(), HEARTBEAT_TIMEOUT, RECONCILE_INTERVAL
            )
            self.paused.append(_PausedClaim(due, decision, until))

    def _claim(self, due: DurableAssignment) -> datetime:
        until = self.app.now() + RECONCILE_CLAIM_TTL
        claimed = self.app.claim_reconcile(due.sandbox_id, due.generation, self.owner, until)
        assert claimed, f"{due.sandbox_id} was claimed by someone else"
        return until

    def finish_won(self) -> None:
        """The peer finishes what it claimed first."""
        for due in self.won:
            self.reconcile(due)
        self.won.clear()

    def wake(self) -> None:
        """The paused peer wakes after its claim expired (and the reconciler took the
        assignment over) and tries to commit its old decision: refused."""
        now = self.app.now()
        for paused in [p for p in self.paused if p.until <= now]:
            self.paused.remove(paused)
            sandbox_id, generation = paused.due.sandbox_id, paused.due.generation
            try:
                self.app.record_reconcile(sandbox_id, generation, self.owner, paused.decision)
                self.report.actions[paused.decision.action] += 1
            except ReconcileClaimError:
                self.report.claims_lost += 1
            except StaleFenceError:
                self.report.stale += 1
            finally:
                with contextlib.suppress(SchedulerError):
                    self.app.release_reconcile_claim(sandbox_id, generation, self.owner)
