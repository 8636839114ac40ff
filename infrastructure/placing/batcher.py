"""Group commit of concurrent ``schedule`` calls in one process.

Callers queue their requests; one of them at a time, the leader, takes what is queued
(up to the batch size, after waiting at most the longest wait for more), decides and
commits it as one :class:`~.placement_batch.PlacementBatch`, answers every caller in
it, and hands the lead to the first caller still queued. A lone call leads at once and
waits for nobody (the default longest wait is 0): batches form by themselves while a
commit is in flight, as a database's group commit does. A leader whose previous batch
held several requests waits for as many callers to queue again (:func:`regroup`): a
leader still alone goes after ``REGROUP_WAIT`` (1 ms: a lone call never waits longer);
after a batch of two or three, 1 ms in all; after a batch of ``LOADED`` (4) or more,
once others have queued, for as long as calls keep arriving (``REGROUP_GAP``, 2 ms,
after the latest ends the wait), at most ``REGROUP_LIMIT`` (8 ms). The wait ends as
soon as they are all back. A call the batch handed back (its home runner was held by
another replica's batch, :mod:`.runner_locks`) is queued again before every later call,
and its next batch waits for the runner. A caller interrupted while it waits or leads
leaves the queue and passes the lead on (its request, if a batch being run defers it, is
not queued again). Each request's events record its own caller's actor
(:mod:`..acting`), not the leader's. Settings: ``SECONDBOX_BATCH_SIZE`` (default 64) and
``SECONDBOX_BATCH_WAIT_MS`` (default 0: the regroup above; more: a leader waits that
long for a full batch).

A coroutine calls :meth:`PlacementBatcher.schedule_async` instead (the HTTP service): its
request is queued the same way, in the same queue, but no thread waits for it. Its
answer resolves the coroutine's future on its event loop; when the lead comes to it,
the batcher's own leader thread leads the batch in its place. So concurrent HTTP
requests cost no thread each, nor a hop to a thread pool and back, and they meet in
batches with the blocking callers as they would have as threads. A coroutine
cancelled while it waits does not withdraw its request (as a thread-pool call would
not): the placement is decided and committed, only its answer is dropped.

The queue (the lead and its hand-over, requests handed back, interrupted callers, the
leader thread for coroutines) is :mod:`..batching.leader_queue`'s, shared with the
creation batcher (:mod:`..creating.batcher`); this module holds the placement rules:
:func:`regroup`, the deferral of a request whose runner is held, the settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from eventsourcing.utils import strtobool

from secondbox_scheduler.domain.actors import ActorRecord
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.acting import current_actor
from secondbox_scheduler.infrastructure.batching.leader_queue import LeaderQueue, Signal, Slot
from secondbox_scheduler.infrastructure.placing.port import Outcome
from secondbox_scheduler.infrastructure.settings import (
    BATCH_SIZE,
    BATCH_WAIT_MS,
    BATCHING,
    batch_setting,
)

# A batch's decisions: each request's answer, None for one handed back to the next batch;
# given the requests, whether each may be deferred, and each one's actor (who asked).
PlaceDeferring = Callable[
    [Sequence[ScheduleRequest], Sequence[bool], Sequence[ActorRecord | None]],
    list[Outcome | None],
]

DEFAULT_BATCH_SIZE = 64
DEFAULT_BATCH_WAIT = 0.0
# Under load, the callers a batch answered come back together; the first of them would
# lead a batch of one while the rest queue behind it (batches of 1, 15, 1, 15, ...).
# So a leader whose previous batch held several requests waits for as many to queue
# again. A lone call after a lone call never waits, and a leader that nobody joins goes
# after REGROUP_WAIT. Under load (a batch of LOADED or more), the callers come back over
# milliseconds (each thread must get a CPU: 1.9 ms median, 5.7 ms p90 in the bench), and
# one that misses the batch waits for all of it (docs/performance.md): there, once
# others have joined, the leader waits while they keep arriving, up to REGROUP_LIMIT,
# and stops when none came for REGROUP_GAP (the load dropped).
REGROUP_WAIT = 0.001
LOADED = 4
REGROUP_GAP = 0.002
REGROUP_LIMIT = 0.008


def regroup(previous: int, size: int, wait: float) -> tuple[int, float, float, float]:
    """How a leader waits before it takes its batch, after a batch of ``previous``
    requests, with the batch size and the configured longest wait (0: none configured):
    (calls wanted, longest wait while alone, longest pause after the latest arrival once
    joined, longest wait in all)."""
    if wait > 0:  # the configured wait, for a full batch
        return size, wait, wait, wait
    wanted = min(size, previous)
    if wanted >= LOADED:
        return wanted, REGROUP_WAIT, REGROUP_GAP, REGROUP_LIMIT
    return wanted, REGROUP_WAIT, REGROUP_WAIT, REGROUP_WAIT


Placed = tuple[DurableAssignment, bool]  # an answer (a refusal is raised)
_Signal = Signal  # a blocking caller's wake-up (read at each call)


class PlacementBatcher(LeaderQueue[ScheduleRequest, Placed]):
    """Queues concurrent placements and commits them in batches, in arrival order."""

    def __init__(
        self,
        run: PlaceDeferring,
        *,
        size: int = DEFAULT_BATCH_SIZE,
        wait: float = DEFAULT_BATCH_WAIT,
    ) -> None:
        super().__init__(size)
        self._run = run
        self.wait = wait
        self._last_size = 0  # requests in the previous batch

    def schedule(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        return self._call(Slot(request, current_actor(), _Signal()))

    async def schedule_async(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        """:meth:`schedule` for a coroutine: queued the same way, awaited on its loop."""
        return await self._call_async(Slot(request, current_actor()))

    def _run_batch(
        self, batch: Sequence[Slot[ScheduleRequest, Placed]]
    ) -> Sequence[Outcome | BaseException | None]:
        return self._run(
            [s.request for s in batch], [not s.deferred for s in batch], [s.actor for s in batch]
        )

    def _took(self, batch: Sequence[Slot[ScheduleRequest, Placed]]) -> None:
        self._last_size = len(batch)

    def _regroup(self) -> None:
        """Wait (holding ``self._lock`` only between wake-ups) for the calls
        :func:`regroup` says, while they keep coming."""
        self._wait_for(*regroup(self._last_size, self.size, self.wait))


def batcher_from_settings(env: Mapping[str, str], place: PlaceDeferring) -> PlacementBatcher | None:
    """The batcher the settings ask for (``SECONDBOX_BATCHING``, ``SECONDBOX_BATCH_SIZE``,
    ``SECONDBOX_BATCH_WAIT_MS``), or None with batching off."""
    if not strtobool(env.get(BATCHING) or "on"):
        return None
    size = int(batch_setting(env.get(BATCH_SIZE), DEFAULT_BATCH_SIZE, BATCH_SIZE))
    wait = batch_setting(env.get(BATCH_WAIT_MS), 0, BATCH_WAIT_MS) / 1000
    return PlacementBatcher(place, size=size, wait=wait)
