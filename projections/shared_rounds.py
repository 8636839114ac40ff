"""One run of a catch-up for every caller that asked for it while another ran.

A caller of :meth:`SharedRounds.run` needs a run that *starts after it asked* (a
catch-up that began earlier may have read the log's head before the caller's own
write). The callers that arrive while a run is going on all wait for the next one, and
the first of them to find no run going on does it for all of them: under concurrent
callers a burst of N asks costs two runs, not N, each covering the log's head at its
start. A run that raises wakes the waiters; one of them runs again (each caller gets a
run that completed, or the error of its own attempt).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SharedRounds:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._started = 0  # runs begun
        self._completed = 0  # the number of the last run that completed
        self._running = False
        self._waiting = 0  # callers waiting for a run

    def wait_for_waiting(self, count: int, timeout: float) -> bool:
        """Whether ``count`` callers came to wait for a run within ``timeout`` s."""
        with self._condition:
            return self._condition.wait_for(lambda: self._waiting >= count, timeout)

    def run(self, work: Callable[[], object]) -> None:
        """Return once a run of ``work`` that began after this call has completed."""
        with self._condition:
            needed = self._started + 1  # the next run to begin, or a later one
            while self._completed < needed:
                if self._running:
                    self._waiting += 1
                    self._condition.notify_all()  # for wait_for_waiting
                    self._condition.wait()
                    self._waiting -= 1
                    continue
                self._started += 1
                number = self._started
                self._running = True
                self._condition.release()
                try:
                    work()
                except BaseException:
                    self._condition.acquire()
                    self._running = False
                    self._condition.notify_all()
                    raise
                self._condition.acquire()
                self._running = False
                self._completed = number
                self._condition.notify_all()
