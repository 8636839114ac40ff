"""Home decisions of a what-if replay without evaluating the whole pool each time.

A home decision evaluates every runner of the pool (the replay needs every runner's
verdict to check the record's counts). A history creates many sandboxes over the same
pool with the same requirements, while only a few runners change in between, so a
:class:`PoolView` keeps, for one pool, one set of requirements and one heartbeat
timeout, every runner's evaluation and the counts the evidence needs, and re-evaluates
only the runners that changed (the fleet marks them) or whose heartbeat went stale since
(a heap of expiry times). The best compatible runner is the top of a heap ordered by the
ranking policy. Each entry gives the verdict ``evaluate_runner``
(``domain/placement/rules.py``) and the policy give for the runner's current snapshot at
the decision's time (the same reason codes, shortfalls and ranks; a kept entry's words
may name an earlier time), so the decision is ``decide``'s over the whole pool
(``tests/test_whatif.py`` checks that both agree).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.placement.evidence import RankKey, RunnerEvaluation, reason_keys
from secondbox_scheduler.domain.placement.ranking import RankingPolicy, rank_key
from secondbox_scheduler.domain.placement.rules import evaluate_runner
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot
from secondbox_scheduler.domain.whatif.evidence import PLAIN_KEYS, PoolCounts, recorded_keys
from secondbox_scheduler.domain.whatif.fleet import FleetRunner


@dataclass(frozen=True)
class Entry:
    """One runner's evaluation, as of one snapshot of it."""

    runner: FleetRunner
    snapshot: RunnerSnapshot
    evaluation: RunnerEvaluation
    rank: RankKey | None  # docs/spec.md (section 3)'s key, for a compatible runner
    keys: tuple[str, ...]  # reason keys
    plain: bool  # fails a prefilter rule
    stamp: int


class PoolView:
    """Every runner of one pool evaluated for one set of requirements, kept current."""

    def __init__(
        self,
        pool: list[FleetRunner],
        requirements: Requirements,
        timeout: timedelta,
        policy: RankingPolicy | None,
    ) -> None:
        self.pool = pool  # the fleet's list of the pool's visible runners, in order
        self.requirements = requirements
        self.timeout = timeout
        self.policy = policy
        self.entries: dict[str, Entry] = {}
        self.dirty: set[FleetRunner] = set(pool)  # watched: the fleet adds changed runners
        self.keys: Counter[str] = Counter()  # per reason key, runners failing it
        self.passing: Counter[str] = Counter()  # ... and failing no prefilter rule
        self.recorded: Counter[str] = Counter()  # refused runners, as records count them
        self.compatible = 0
        self.egress_only = 0
        self.best: list[tuple[Any, int, str, int]] = []  # (policy key, order, id, stamp)
        self.expiry: list[tuple[datetime, int, str, int]] = []  # (fresh until, ., id, stamp)
        self.now: datetime | None = None
        self.stamps = 0

    # -- keeping it current ---------------------------------------------------------

    def at(self, now: datetime) -> None:
        """Bring every entry up to ``now``: changed runners, expired heartbeats. A time
        earlier than the last one re-evaluates every runner."""
        if self.now is not None and now < self.now:
            self.dirty.update(entry.runner for entry in self.entries.values())
            self.dirty.update(self.pool)
        self.now = now
        expiry = self.expiry
        while expiry and expiry[0][0] < now:
            _, _, runner_id, stamp = heapq.heappop(expiry)
            entry = self.entries.get(runner_id)
            if entry is not None and entry.stamp == stamp:
                self.dirty.add(entry.runner)
        if self.dirty:
            dirty = list(self.dirty)
            self.dirty.clear()
            for runner in dirty:
                self._evaluate(runner, now)

    def _evaluate(self, runner: FleetRunner, now: datetime) -> None:
        runner_id = runner.runner_id
        old = self.entries.pop(runner_id, None)
        if old is not None:
            self._count(old, -1)
        if not runner.visible:
            return
        snapshot = runner.snapshot()
        evaluation = evaluate_runner(self.requirements, snapshot, now, self.timeout)
        keys = tuple(reason_keys(evaluation))
        self.stamps += 1
        entry = Entry(
            runner,
            snapshot,
            evaluation,
            rank_key(self.requirements, snapshot) if evaluation.compatible else None,
            keys,
            any(key in PLAIN_KEYS for key in keys),
            self.stamps,
        )
        self.entries[runner_id] = entry
        self._count(entry, +1)
        order = runner.seq  # decide() breaks ties by list order: registration order
        if evaluation.compatible:
            key = (
                entry.rank if self.policy is None else self.policy.key(self.requirements, snapshot)
            )
            heapq.heappush(self.best, (key, order, runner_id, entry.stamp))
        heartbeat = snapshot.last_heartbeat_at
        if heartbeat is not None and heartbeat >= now - self.timeout:
            heapq.heappush(self.expiry, (heartbeat + self.timeout, order, runner_id, entry.stamp))

    def _count(self, entry: Entry, sign: int) -> None:
        for key in entry.keys:
            self.keys[key] += sign
            if not entry.plain:
                self.passing[key] += sign
        if entry.evaluation.compatible:
            self.compatible += sign
        else:
            for key in recorded_keys(entry.evaluation):
                self.recorded[key] += sign
            if entry.evaluation.failed_only_egress:
                self.egress_only += sign

    # -- reading it ---------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.entries)

    def chosen(self) -> FleetRunner | None:
        """The best compatible runner by the policy (None: nothing is compatible)."""
        best = self.best
        while best:
            _, _, runner_id, stamp = best[0]
            entry = self.entries.get(runner_id)
            if entry is not None and entry.stamp == stamp:
                return entry.runner
            heapq.heappop(best)
        return None

    def counts(self) -> PoolCounts:
        return PoolCounts(self.size, self.keys, self.passing, self.compatible)

    def lookup(self, runner_id: str) -> tuple[RunnerEvaluation, RankKey | None] | None:
        entry = self.entries.get(runner_id)
        return None if entry is None else (entry.evaluation, entry.rank)

    def evaluations(self) -> tuple[list[RunnerEvaluation], list[RankKey | None]]:
        """Every runner's evaluation and rank, in the pool's order (for showing)."""
        entries = [self.entries[runner.runner_id] for runner in self.pool]
        return [e.evaluation for e in entries], [e.rank for e in entries]
