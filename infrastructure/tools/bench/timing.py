"""Clocks and sample figures of ``secondbox-scheduler bench``: the wall clock of setup,
the median of timed calls and the nearest-rank percentile of latency samples."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime


def now() -> datetime:
    """The wall clock (UTC) that setup stamps runners, heartbeats and sandboxes with."""
    return datetime.now(UTC)


def median_ms(operation: Callable[[], object], calls: int) -> float:
    """Median milliseconds of ``calls`` calls of ``operation``, each timed alone."""
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        operation()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile (0 for no samples)."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]
