"""Which runners exist, by pool: an in-process read model of registrations.

It reads the notifications after the position it reached last time, so each refresh
costs what was appended since: all but those of the event classes it ignores
(``IGNORED``, each with a reason), so that an event of a class it does not know is met
and counted (:mod:`projections.unknown_events`) rather than filtered out. It folds
``Runner.Registered`` and ``Runner.Deregistered`` (``HANDLERS``). The authority for
every placement stays the Runner aggregate; this index only tells which runner streams
to load.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from threading import Lock
from typing import Any, ClassVar
from uuid import UUID

from eventsourcing.persistence import ApplicationRecorder, Mapper, Notification

from secondbox_scheduler.domain.access_tokens import ACCESS_TOKEN_EVENTS
from secondbox_scheduler.domain.cell_claims import CELL_CLAIM_EVENTS
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.projections.notification_reader import select_page
from secondbox_scheduler.projections.unknown_events import UnknownEvents, topics_of_classes

_PAGE = 1000


class RunnerIndex:
    """Registered runner ids by pool, caught up on demand from the notification log."""

    # Each event class the index folds, and the name of its handler.
    HANDLERS: ClassVar[Mapping[type[Any], str]] = {
        Runner.Registered: "_registered",
        Runner.Deregistered: "_deregistered",
    }
    # Each event class the index reads past, and why.
    IGNORED: ClassVar[Mapping[type[Any], str]] = {
        **dict.fromkeys(
            (
                Runner.CapacityReserved,
                Runner.CapacityReleased,
                Runner.DrainStarted,
                Runner.DrainCancelled,
                Runner.AllocatableChanged,
            ),
            "a registered runner stays in its pool until it is deregistered, whatever "
            "it reserves, drains or offers (the aggregate, loaded by id, says that)",
        ),
        **dict.fromkeys(
            (RunnerLease.Opened, RunnerLease.LivenessRenewed, RunnerLease.EvidenceRecorded),
            "a lease's events add or remove no runner",
        ),
        **dict.fromkeys(
            (
                Sandbox.Created,
                Sandbox.AssignmentFenced,
                Sandbox.AssignmentRunning,
                Sandbox.AssignmentReleased,
                Sandbox.AssignmentFailed,
                Sandbox.ReconcileClaimed,
                Sandbox.ReconcileClaimReleased,
                Sandbox.AssignmentUncertain,
                Sandbox.ReconcileScheduled,
                Sandbox.GenerationAdvanced,
            ),
            "a sandbox's events add or remove no runner",
        ),
        **dict.fromkeys(
            (RefusalLog.Opened, RefusalLog.Refused), "a refusal adds or removes no runner"
        ),
        FencingTokenUse.Used: "the index of fencing tokens used adds or removes no runner",
        **dict.fromkeys(ACCESS_TOKEN_EVENTS, "an access token adds or removes no runner"),
        **dict.fromkeys(CELL_CLAIM_EVENTS, "a cell claim adds or removes no runner"),
    }

    @classmethod
    def handled_events(cls) -> frozenset[type[Any]]:
        """The event classes the index folds."""
        return frozenset(cls.HANDLERS)

    def __init__(self, recorder: ApplicationRecorder, mapper: Mapper[UUID]) -> None:
        self._recorder = recorder
        self._mapper = mapper
        self._handlers: dict[str, Callable[[Notification], None]] = {
            topic: getattr(self, name)
            for cls, name in self.HANDLERS.items()
            for topic in topics_of_classes((cls,))
        }
        self._ignored = tuple(sorted(topics_of_classes(self.IGNORED)))
        self._position = 0
        self._pools: dict[str, set[str]] = {}
        self._pool_of: dict[str, str] = {}
        self._by_stream: dict[UUID, str] = {}
        self.unknown_events = UnknownEvents("runner_index")
        self._lock = Lock()

    def _catch_up(self) -> None:
        while True:
            page = select_page(
                self._recorder, self._position, None, (), _PAGE, excluding=self._ignored
            )
            unknown: Counter[str] = Counter()
            for notification in page:
                handler = self._handlers.get(notification.topic)
                if handler is None:  # a class it does not know: not even decoded
                    unknown[notification.topic] += 1
                else:
                    handler(notification)
                self._position = notification.id
            self.unknown_events.add(unknown)
            if len(page) < _PAGE:
                return

    def _registered(self, notification: Notification) -> None:
        event: Any = self._mapper.to_domain_event(notification)
        self._pools.setdefault(event.pool_name, set()).add(event.runner_id)
        self._pool_of[event.runner_id] = event.pool_name
        self._by_stream[event.originator_id] = event.runner_id

    def _deregistered(self, notification: Notification) -> None:
        runner_id = self._by_stream.pop(UUID(str(notification.originator_id)))
        self._pools[self._pool_of.pop(runner_id)].discard(runner_id)

    def runner_ids(self, pool_name: str | None = None) -> list[str]:
        """Sorted ids of registered runners, of one pool or of all."""
        with self._lock:
            self._catch_up()
            if pool_name is not None:
                return sorted(self._pools.get(pool_name, ()))
            return sorted(self._pool_of)
