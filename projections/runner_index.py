"""Which runners exist, by pool: an in-process read model of registrations.

It reads only the Registered and Deregistered notifications, from the position it
reached last time, so each refresh costs what was appended since. The authority for
every placement stays the Runner aggregate; this index only tells which runner
streams to load.
"""

from __future__ import annotations

from threading import Lock
from uuid import UUID

from eventsourcing.persistence import ApplicationRecorder, Mapper

from secondbox_scheduler.domain.event_topics import topics_of
from secondbox_scheduler.domain.runner import Runner

_PAGE = 1000


class RunnerIndex:
    """Registered runner ids by pool, caught up on demand from the notification log."""

    def __init__(self, recorder: ApplicationRecorder, mapper: Mapper[UUID]) -> None:
        self._recorder = recorder
        self._mapper = mapper
        self._topics = [*topics_of(Runner.Registered), *topics_of(Runner.Deregistered)]
        self._position = 0
        self._pools: dict[str, set[str]] = {}
        self._pool_of: dict[str, str] = {}
        self._by_stream: dict[UUID, str] = {}
        self._lock = Lock()

    def _catch_up(self) -> None:
        while True:
            page = self._recorder.select_notifications(
                start=self._position, limit=_PAGE, topics=self._topics, inclusive_of_start=False
            )
            for notification in page:
                event = self._mapper.to_domain_event(notification)
                if isinstance(event, Runner.Registered):
                    self._pools.setdefault(event.pool_name, set()).add(event.runner_id)
                    self._pool_of[event.runner_id] = event.pool_name
                    self._by_stream[event.originator_id] = event.runner_id
                else:
                    runner_id = self._by_stream.pop(UUID(str(notification.originator_id)))
                    self._pools[self._pool_of.pop(runner_id)].discard(runner_id)
                self._position = notification.id
            if len(page) < _PAGE:
                return

    def runner_ids(self, pool_name: str | None = None) -> list[str]:
        """Sorted ids of registered runners, of one pool or of all."""
        with self._lock:
            self._catch_up()
            if pool_name is not None:
                return sorted(self._pools.get(pool_name, ()))
            return sorted(self._pool_of)
