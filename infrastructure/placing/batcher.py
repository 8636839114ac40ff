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
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from eventsourcing.utils import strtobool

from secondbox_scheduler.domain.actors import ActorRecord
from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.acting import current_actor
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

_LOG = logging.getLogger(__name__)

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


class _Signal:
    """A one-way wake-up on a bare lock (``threading.Event`` is a condition variable,
    a lock and a list of waiters in Python: several times the work per call). Unlike an
    Event it must not be set by two threads at once (both could release the lock): a
    slot is woken by the one thread that passes it the lead (holding the batcher's lock)
    or by the leader of the one batch that answered it."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def clear(self) -> None:
        if self._set:
            self._lock.acquire()
            self._set = False

    def wait(self) -> None:
        self._lock.acquire()
        self._lock.release()


class _Slot:
    """One queued call: its request, then its answer or the lead."""

    __slots__ = ("abandoned", "actor", "deferred", "done", "lead", "outcome", "request", "wake")

    def __init__(self, request: ScheduleRequest, actor: ActorRecord | None) -> None:
        self.request = request
        self.actor = actor  # the caller's: its events record it, whoever leads the batch
        self.abandoned = False  # its caller was interrupted: never queued again
        self.outcome: Outcome | BaseException | None = None
        self.done = False
        self.lead = False
        self.deferred = False  # once deferred, its next batch waits for its runner
        self.wake: _Signal | _AsyncWake = _Signal()


class _AsyncWake:
    """The wake-up of a slot whose caller is a coroutine (:meth:`PlacementBatcher.
    schedule_async`): set once answered, it resolves the caller's future on its loop;
    set while it holds the lead, it hands the slot to the batcher's leader thread. Set,
    like a :class:`_Signal`, by one thread at a time (see there)."""

    __slots__ = ("_future", "_leaders", "_loop", "_slot")

    def __init__(
        self,
        slot: _Slot,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Outcome],
        leaders: queue.SimpleQueue[_Slot | None],
    ) -> None:
        self._slot = slot
        self._loop = loop
        self._future = future
        self._leaders = leaders

    def set(self) -> None:
        slot = self._slot
        if slot.done:
            self._loop.call_soon_threadsafe(_resolve, self._future, slot.outcome)
        elif slot.lead:
            self._leaders.put(slot)

    def clear(self) -> None:
        """(A deferred slot waits for its next wake-up: nothing to reset.)"""

    def wait(self) -> None:  # pragma: no cover - a coroutine never blocks on its slot
        raise RuntimeError("a coroutine's slot is never waited on by a thread")


def _resolve(future: asyncio.Future[Outcome], outcome: Outcome | BaseException | None) -> None:
    """(On the caller's loop.) The answer, unless the caller stopped waiting."""
    if future.cancelled():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        assert outcome is not None
        future.set_result(outcome)


class PlacementBatcher:
    """Queues concurrent placements and commits them in batches, in arrival order."""

    def __init__(
        self,
        run: PlaceDeferring,
        *,
        size: int = DEFAULT_BATCH_SIZE,
        wait: float = DEFAULT_BATCH_WAIT,
    ) -> None:
        self._run = run
        self.size = size
        self.wait = wait
        self._queue: deque[_Slot] = deque()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a call queued (for the leader)
        self._busy = False
        self._last_size = 0  # requests in the previous batch
        self._last_arrival = 0.0  # time.monotonic() of the latest call queued
        self._wanted = 0  # while a leader regroups: the calls it waits for
        # coroutines' slots that hold the lead, for the leader thread (started on first use)
        self._leaders: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        self._leader: threading.Thread | None = None

    async def schedule_async(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        """:meth:`schedule` for a coroutine: queued the same way, awaited on its loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        slot = _Slot(request, current_actor())
        slot.wake = _AsyncWake(slot, loop, future, self._leaders)
        self._start_leader()
        with self._arrived:  # held by others only between a batch's steps
            self._queue.append(slot)
            self._last_arrival = time.monotonic()
            leads = not self._busy  # read here: once queued, a leader may pass it the lead
            if leads:
                self._busy = slot.lead = True
            elif 0 < self._wanted <= len(self._queue):
                self._arrived.notify()
        if leads:
            self._leaders.put(slot)
        # shielded: a cancelled caller's request is still placed (its answer dropped)
        outcome = await asyncio.shield(future)
        if isinstance(outcome, SchedulerError):
            raise outcome
        return outcome

    def _start_leader(self) -> None:
        if self._leader is not None:
            return
        with self._lock:
            if self._leader is None:
                self._leader = threading.Thread(
                    target=self._lead_for_coroutines, name="secondbox-batch-leader", daemon=True
                )
                self._leader.start()

    def _lead_for_coroutines(self) -> None:
        """The leader thread: leads each batch whose lead came to a coroutine's slot."""
        while (slot := self._leaders.get()) is not None:
            if slot.done or not slot.lead:
                continue
            try:
                self._lead()
            except BaseException as error:  # not the batch's (those are answers): ours
                _LOG.exception("the batch leader failed")
                with self._lock:
                    slot.abandoned = True
                    if slot in self._queue:
                        self._queue.remove(slot)
                    if not slot.done:
                        slot.outcome, slot.done, slot.lead = error, True, False
                        self._pass_lead()
                slot.wake.set()

    def close(self) -> None:
        """Stop the leader thread (after the batch it may be leading)."""
        leader, self._leader = self._leader, None
        if leader is not None:
            self._leaders.put(None)
            leader.join(timeout=30)

    def schedule(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        slot = _Slot(request, current_actor())
        with self._arrived:
            self._queue.append(slot)
            self._last_arrival = time.monotonic()
            if not self._busy:
                self._busy = slot.lead = True
            elif 0 < self._wanted <= len(self._queue):
                self._arrived.notify()  # the regrouping leader has all it waits for
        try:
            while True:
                if not slot.lead:
                    slot.wake.wait()
                if slot.done:
                    break
                self._lead()  # this caller leads the next batch (its own request is in it)
        except BaseException:  # interrupted (not by the batch: its errors are answers)
            self._abandon(slot)
            raise
        outcome = slot.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

    def _lead(self) -> None:
        with self._arrived:
            self._regroup()
            batch = [self._queue.popleft() for _ in range(min(self.size, len(self._queue)))]
            self._last_size = len(batch)
        try:
            outcomes: Sequence[Outcome | BaseException | None] = self._run(
                [s.request for s in batch],
                [not s.deferred for s in batch],
                [s.actor for s in batch],
            )
            if len(outcomes) != len(batch):
                raise RuntimeError(f"{len(outcomes)} answers to a batch of {len(batch)}")
        except BaseException as error:  # the store failed: every caller of the batch hears it
            outcomes = [error] * len(batch)
        deferred, answered = [], []
        for slot, outcome in zip(batch, outcomes, strict=True):
            if outcome is None:  # its runner was busy: first in the next batch
                slot.deferred, slot.lead = True, False
                slot.wake.clear()
                deferred.append(slot)
            else:
                slot.outcome, slot.done = outcome, True
                answered.append(slot)
        with self._lock:
            self._queue.extendleft(reversed([s for s in deferred if not s.abandoned]))
            self._pass_lead()
        # only the slots this batch answered: a deferred one is the next leader's to wake
        for slot in answered:
            slot.wake.set()

    def _regroup(self) -> None:
        """Wait (holding ``self._lock`` only between wake-ups) for the calls
        :func:`regroup` says, while they keep coming. Callers notify only once all are
        queued; a timer wake-up with a later arrival waits on from that arrival."""
        wanted, alone, gap, limit = regroup(self._last_size, self.size, self.wait)
        start = time.monotonic()
        deadline = start + limit
        self._wanted = wanted
        try:
            while len(self._queue) < wanted:
                pause = gap if len(self._queue) > 1 else alone
                timeout = min(deadline, max(self._last_arrival, start) + pause) - time.monotonic()
                if timeout <= 0:
                    break  # the longest wait is over, or nobody came for ``pause``
                self._arrived.wait(timeout)
        finally:
            self._wanted = 0

    def _abandon(self, slot: _Slot) -> None:
        """A caller interrupted while queued or leading (a KeyboardInterrupt, say): its
        request leaves the queue, and if it held the lead, the lead passes on, so the
        other callers are not left waiting for it."""
        with self._lock:
            slot.abandoned = True  # in a batch being run: not queued again if deferred
            if slot in self._queue:
                self._queue.remove(slot)
            if slot.lead and not slot.done:
                slot.lead = False
                self._pass_lead()

    def _pass_lead(self) -> None:
        """(Holding ``self._lock``.) The first caller queued leads next; none: idle."""
        if self._queue:
            successor = self._queue[0]
            successor.lead = True
            successor.wake.set()
        else:
            self._busy = False


def batcher_from_settings(env: Mapping[str, str], place: PlaceDeferring) -> PlacementBatcher | None:
    """The batcher the settings ask for (``SECONDBOX_BATCHING``, ``SECONDBOX_BATCH_SIZE``,
    ``SECONDBOX_BATCH_WAIT_MS``), or None with batching off."""
    if not strtobool(env.get(BATCHING) or "on"):
        return None
    size = int(batch_setting(env.get(BATCH_SIZE), DEFAULT_BATCH_SIZE, BATCH_SIZE))
    wait = batch_setting(env.get(BATCH_WAIT_MS), 0, BATCH_WAIT_MS) / 1000
    return PlacementBatcher(place, size=size, wait=wait)
