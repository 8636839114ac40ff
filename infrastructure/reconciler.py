"""The reconciler: claims due assignments and applies the reconcile policy.

One pass: read the assignments that are due (``next_reconcile_at`` has come, nobody
holds an unexpired claim) from the assignments projection; for each, take the
reconcile claim on the Sandbox aggregate (refused while another owner holds it), check
again on the aggregate that it is still due, apply :func:`domain.reconcile.decide_reconcile`,
commit the result (refused unless the claim is still current) and release the claim.
Several reconcilers on one database never work the same assignment at the same time:
the claim is serialized by optimistic concurrency on the sandbox stream.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from secondbox_scheduler.domain.errors import (
    AssignmentNotFoundError,
    ReconcileClaimError,
    RunnerNotFoundError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.reconcile import decide_reconcile
from secondbox_scheduler.domain.values import DurableAssignment
from secondbox_scheduler.infrastructure.application import SchedulerApplication


def default_owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class ReconcileReport:
    """What one or more passes did."""

    passes: int = 0
    due: int = 0
    claimed: int = 0
    held_by_others: int = 0
    no_longer_due: int = 0
    stale: int = 0
    claims_lost: int = 0
    actions: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passes": self.passes,
            "due": self.due,
            "claimed": self.claimed,
            "held_by_others": self.held_by_others,
            "no_longer_due": self.no_longer_due,
            "stale": self.stale,
            "claims_lost": self.claims_lost,
            "actions": dict(sorted(self.actions.items())),
        }


class Reconciler:
    def __init__(
        self,
        app: SchedulerApplication,
        owner: str | None = None,
        *,
        heartbeat_timeout: timedelta = timedelta(seconds=30),
        claim_ttl: timedelta = timedelta(seconds=30),
        interval: timedelta = timedelta(seconds=60),
        batch: int = 100,
    ) -> None:
        if app.read_models is None:
            raise SchedulerError("the reconciler needs a SQLite or PostgreSQL store")
        self.app = app
        self.owner = owner or default_owner()
        self.heartbeat_timeout = heartbeat_timeout
        self.claim_ttl = claim_ttl
        self.interval = interval
        self.batch = batch
        self.report = ReconcileReport()

    def run_once(self) -> tuple[int, int]:
        """One pass over what is due now: (assignments found due, assignments reconciled)."""
        read_models = self.app.current_read_models()
        assert read_models is not None
        due = read_models.assignments.due_for_reconcile(self.app.now(), limit=self.batch)
        self.report.passes += 1
        self.report.due += len(due)
        done = 0
        for assignment in due:
            done += self._reconcile(assignment)
        return len(due), done

    def drain(
        self, poll: float = 0.2, sleep: Callable[[float], None] = time.sleep, patience: int = 3
    ) -> ReconcileReport:
        """Pass after pass until nothing is due (or ``patience`` passes in a row found due
        assignments but reconciled none, e.g. all held by other reconcilers)."""
        idle = 0
        while idle < patience:
            found, done = self.run_once()
            if found == 0:
                break
            idle = 0 if done else idle + 1
            if not done:
                sleep(poll)
        return self.report

    def _reconcile(self, due: DurableAssignment) -> int:
        app, owner = self.app, self.owner
        sandbox_id, generation = due.sandbox_id, due.generation
        try:
            claimed = app.claim_reconcile(sandbox_id, generation, owner, app.now() + self.claim_ttl)
        except (StaleFenceError, AssignmentNotFoundError):
            self.report.stale += 1
            return 0
        if not claimed:
            self.report.held_by_others += 1
            return 0
        self.report.claimed += 1
        try:
            now = app.now()
            current = app.get_assignment(sandbox_id, generation)
            if (
                current is None
                or current.next_reconcile_at is None
                or current.next_reconcile_at > now
            ):
                self.report.no_longer_due += 1
                return 0
            try:
                home = app.fold_runner(current.runner_id)
            except RunnerNotFoundError:
                home = None
            decision = decide_reconcile(current, home, now, self.heartbeat_timeout, self.interval)
            app.record_reconcile(sandbox_id, generation, owner, decision)
            self.report.actions[decision.action] += 1
            return 1
        except ReconcileClaimError:
            self.report.claims_lost += 1
            return 0
        except StaleFenceError:
            self.report.stale += 1
            return 0
        finally:
            with contextlib.suppress(SchedulerError):  # the generation moved on
                app.release_reconcile_claim(sandbox_id, generation, owner)

    def run(
        self,
        poll: float = 1.0,
        should_stop: Callable[[], bool] = lambda: False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> ReconcileReport:
        """Pass after pass until ``should_stop()``; sleeps ``poll`` when nothing was due."""
        while not should_stop():
            if self.run_once()[1] == 0:
                sleep(poll)
        return self.report
