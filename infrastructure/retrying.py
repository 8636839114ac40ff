"""Lost races, retried: full-jitter backoff and the retry loop of the commands.

A command that loses an optimistic-concurrency race (``IntegrityError``: a rival
committed first) or read two aggregates on either side of a rival's commit
(:class:`StaleRead`) runs again from the start after a full-jitter backoff; past its
retry limit the caller gets ``SerializationContentionError`` (docs/spec.md, section 6,
step 6). A save that gave up waiting for a lock another session holds
(:class:`~.store.write_timeouts.WriteTimeoutError`) is a lost race too, retried at most
``TIMEOUT_RETRY_LIMIT`` times within that budget: each waited the whole write lock
timeout already, and a hold that outlived three of them is not about to end.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.errors import SerializationContentionError
from secondbox_scheduler.infrastructure.counters import SchedulerMetrics
from secondbox_scheduler.infrastructure.store.write_timeouts import WriteTimeoutError

T = TypeVar("T")

BACKOFF_BASE_SECONDS = 0.002
BACKOFF_CAP_SECONDS = 0.250
BACKOFF_MAX_EXPONENT = 10  # 2 ms * 2**10 is past the cap already; 2.0**1024 overflows
COMMAND_RETRY_LIMIT = 32  # conflicts tolerated by commands other than schedule
TIMEOUT_RETRY_LIMIT = 2  # of those, saves that timed out waiting for a lock


class StaleRead(Exception):
    """A command read two aggregates on either side of a rival's commit (a sandbox
    without the assignment whose reservation its runner already holds, or the reverse):
    a lost race, retried like an optimistic-concurrency conflict."""


def backoff_ceiling(retry: int) -> float:
    """Upper bound of the full-jitter draw before retry number ``retry`` (0-based),
    defined for every retry: the exponent is capped, as the original caps it."""
    exponent = min(max(retry, 0), BACKOFF_MAX_EXPONENT)
    return min(BACKOFF_BASE_SECONDS * 2.0**exponent, BACKOFF_CAP_SECONDS)


class Retrying:
    """Backoff draws (thread-safe) and the retry loop, counting races in ``metrics``."""

    def __init__(
        self,
        metrics: SchedulerMetrics,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.metrics = metrics
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()

    def backoff(self, retry: int) -> None:
        """Full jitter: sleep a uniform draw in [0, min(2 ms * 2^retry, 250 ms)]."""
        with self._rng_lock:
            delay = self._rng.uniform(0.0, backoff_ceiling(retry))
        self._sleep(delay)

    def run(self, operation: Callable[[int], T], *, retries: int, subject: str) -> T:
        """Run ``operation(attempt)``; on a lost race back off and run it again."""
        timeouts = 0
        for attempt in range(retries + 1):
            try:
                return operation(attempt)
            except (IntegrityError, StaleRead) as error:
                timeouts += isinstance(error, WriteTimeoutError)
                if attempt == retries or timeouts > TIMEOUT_RETRY_LIMIT:
                    retries = attempt
                    break
                self.metrics.add("contention_retries")
                self.backoff(attempt)
        self.metrics.add("contention_errors")
        raise SerializationContentionError(retries + 1, subject)
