"""Utilisation of each pool over time, for the what-if report: peak and time-weighted mean.

A pool's utilisation of a dimension at a moment is what its runners have reserved over
what they offer (sum of reserved / sum of allocatable). A runner counts from its
registration until it is deregistered (or removed by a what-if change), and after that
for as long as it still holds reservations. Between two changes the utilisation is
constant; the mean weighs each value by how long it held, over the window (from the
pool's first registration when that is later). Times only move forward: an event
stamped earlier than one before it counts as happening at the later time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.values import Capacity

DIMENSIONS = Capacity.DIMENSIONS
_RANGE = range(len(DIMENSIONS))


@dataclass
class _Pool:
    since: datetime
    allocatable: list[int] = field(default_factory=lambda: [0] * len(DIMENSIONS))
    reserved: list[int] = field(default_factory=lambda: [0] * len(DIMENSIONS))
    share: list[float] = field(default_factory=lambda: [0.0] * len(DIMENSIONS))
    peak: list[float] = field(default_factory=lambda: [0.0] * len(DIMENSIONS))
    area: list[float] = field(default_factory=lambda: [0.0] * len(DIMENSIONS))  # share x s
    last: datetime | None = None


@dataclass(frozen=True)
class DimensionUse:
    """One pool's use of one dimension over the window."""

    peak: float
    mean: float

    def to_dict(self) -> dict[str, float]:
        return {"peak": round(self.peak, 4), "mean": round(self.mean, 4)}


class PoolUsage:
    """Sums of reserved and allocatable per pool, integrated over time."""

    def __init__(self) -> None:
        self.pools: dict[str, _Pool] = {}
        self.now: datetime | None = None
        self.start: datetime | None = None  # the window's start; nothing counts before

    def at(self, moment: datetime) -> None:
        """Move the clock (never backwards)."""
        if self.now is None or moment > self.now:
            self.now = moment

    def begin(self) -> None:
        """The window starts now: forget what came before, keep the current state."""
        self.start = self.now
        for pool in self.pools.values():
            pool.area = [0.0] * len(DIMENSIONS)
            pool.peak = list(pool.share)
            pool.last = self.now
            if self.now is not None and pool.since < self.now:
                pool.since = self.now

    def change(
        self,
        pool_name: str,
        *,
        allocatable: Mapping[str, int] | None = None,
        reserved: Mapping[str, int] | None = None,
        sign: int = 1,
    ) -> None:
        """Add (``sign`` 1) or subtract (-1) a runner's allocatable and/or reserved."""
        now = self.now
        assert now is not None, "at() before change()"
        pool = self.pools.get(pool_name)
        if pool is None:
            pool = self.pools[pool_name] = _Pool(since=now, last=now)
        elif pool.last is not None and now > pool.last:
            seconds = (now - pool.last).total_seconds()
            area, share = pool.area, pool.share
            for i in _RANGE:
                area[i] += share[i] * seconds
        pool.last = now
        if allocatable is not None:
            for i, dim in enumerate(DIMENSIONS):
                pool.allocatable[i] += sign * allocatable[dim]
        if reserved is not None:
            for i, dim in enumerate(DIMENSIONS):
                pool.reserved[i] += sign * reserved[dim]
        share, peak = pool.share, pool.peak
        for i in _RANGE:
            offered = pool.allocatable[i]
            share[i] = pool.reserved[i] / offered if offered > 0 else 0.0
            if share[i] > peak[i]:
                peak[i] = share[i]

    def summary(self) -> dict[str, dict[str, DimensionUse]]:
        """Per pool and dimension, peak and time-weighted mean up to now."""
        found: dict[str, dict[str, DimensionUse]] = {}
        end = self.now
        for name in sorted(self.pools):
            pool = self.pools[name]
            uses = {}
            for i, dim in enumerate(DIMENSIONS):
                area = pool.area[i]
                if end is not None and pool.last is not None and end > pool.last:
                    area += pool.share[i] * (end - pool.last).total_seconds()
                span = (end - pool.since).total_seconds() if end is not None else 0.0
                mean = area / span if span > 0 else pool.share[i]
                uses[dim] = DimensionUse(pool.peak[i], mean)
            found[name] = uses
        return found


def usage_dict(summary: Mapping[str, Mapping[str, DimensionUse]]) -> dict[str, Any]:
    return {
        pool: {dim: use.to_dict() for dim, use in uses.items()} for pool, uses in summary.items()
    }
