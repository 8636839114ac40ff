"""The garbage collector's young-generation threshold in the scheduler's own processes.

CPython collects its youngest generation every 700 allocations of container objects.
A placement batch keeps its events, records and loaded aggregates alive for a few
milliseconds, longer than 700 allocations, so a collection in the middle of a batch
finds them alive and moves them to an older generation; enough of them there, and the
next collection is a **full** one, which walks every object of the process: the
cached runners and leases, the pools, the modules. Measured in a bench worker
(docs/performance.md, "Tail latency"): five full collections in a 15 s batched run,
106 to 193 ms each, during which the process answers nobody, and a batch stopped there
holds its runner locks, so other replicas wait too: most of the p99.

With a threshold of 20,000 the temporaries of a batch are gone before the youngest
generation is collected; the same run had no full collection at all. Garbage cycles
live a little longer (up to 20,000 allocations); nothing else changes.

The scheduler's processes (the CLI, ``serve``, the bench's and ``verify``'s workers)
call :func:`tune_gc` once at start. It changes a process-wide setting, so an embedder's
process is theirs to tune: :class:`~.application.SchedulerApplication` never calls it.
``SECONDBOX_GC_THRESHOLD``: the threshold (700 to 1,000,000), or ``off`` for Python's
own setting.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping

from secondbox_scheduler.domain.errors import InvalidRequestError

GC_THRESHOLD = "SECONDBOX_GC_THRESHOLD"
DEFAULT_YOUNG_THRESHOLD = 20_000
LOWEST, HIGHEST = 700, 1_000_000


def gc_threshold(value: str | None) -> int | None:
    """The setting's young-generation threshold (None: leave Python's)."""
    if value is None or not value.strip():
        return DEFAULT_YOUNG_THRESHOLD
    if value.strip().lower() == "off":
        return None
    try:
        threshold = int(value)
    except ValueError:
        threshold = 0
    if not LOWEST <= threshold <= HIGHEST:
        raise InvalidRequestError(
            GC_THRESHOLD, f"must be a whole number from {LOWEST} to {HIGHEST:,}, or off", value
        )
    return threshold


def tune_gc(environ: Mapping[str, str] = os.environ) -> int | None:
    """Set the young-generation threshold from ``SECONDBOX_GC_THRESHOLD`` (the older
    generations' thresholds stay as they are); returns the threshold set, or None."""
    threshold = gc_threshold(environ.get(GC_THRESHOLD))
    if threshold is not None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(threshold, older, oldest)
    return threshold
