"""The leader/follower queue of the group-commit batchers (``placing/batcher.py``,
``creating/batcher.py``).

Callers queue their requests; one of them at a time, the leader, takes a batch of what
is queued (:meth:`LeaderQueue._take`, after waiting as :meth:`LeaderQueue._regroup`
says), runs it (:meth:`LeaderQueue._run_batch`), answers every caller in it, and hands
the lead to the first caller still queued. A lone call leads at once: batches form
while a batch is being run, as a database's group commit does. A batch's answer None
hands the request back: it is queued again before every later call, marked
``deferred``. A caller interrupted while it waits or leads leaves the queue and passes
the lead on (its request, if a batch being run hands it back, is not queued again).
A failure of the batch (not an answer) is raised in every caller of the batch.

A thread calls :meth:`LeaderQueue._call`; a coroutine :meth:`LeaderQueue._call_async`:
its request is queued the same way, in the same queue, but no thread waits for it. Its
answer resolves the coroutine's future on its event loop; when the lead comes to it,
the queue's own leader thread leads the batch in its place. A coroutine cancelled while
it waits does not withdraw its request (as a thread-pool call would not): the request
is run, only its answer is dropped.

Each batcher keeps its own rules: how a leader waits for more callers (it calls
:meth:`LeaderQueue._wait_for` with its figures), what a batch takes, and what it
records of each batch it ran (:meth:`LeaderQueue._took`, :meth:`LeaderQueue._ran`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Generic, TypeVar

from secondbox_scheduler.domain.actors import ActorRecord

RequestT = TypeVar("RequestT")
OutcomeT = TypeVar("OutcomeT")

_LOG = logging.getLogger(__name__)


class Signal:
    """A one-way wake-up on a bare lock (``threading.Event`` is a condition variable,
    a lock and a list of waiters in Python: several times the work per call). Unlike an
    Event it must not be set by two threads at once (both could release the lock): a
    slot is woken by the one thread that passes it the lead (holding the queue's lock)
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


class Slot(Generic[RequestT, OutcomeT]):
    """One queued call: its request, then its answer or the lead."""

    __slots__ = ("abandoned", "actor", "deferred", "done", "lead", "outcome", "request", "wake")

    def __init__(
        self,
        request: RequestT,
        actor: ActorRecord | None,
        wake: Signal | AsyncWake[RequestT, OutcomeT] | None = None,
    ) -> None:
        self.request = request
        self.actor = actor  # the caller's: its events record it, whoever leads the batch
        self.abandoned = False  # its caller was interrupted: never queued again
        self.outcome: OutcomeT | BaseException | None = None
        self.done = False
        self.lead = False
        self.deferred = False  # handed back by a batch: its next batch knows it
        # a thread's Signal, or set by _call_async
        self.wake: Signal | AsyncWake[RequestT, OutcomeT] = Signal() if wake is None else wake


class AsyncWake(Generic[RequestT, OutcomeT]):
    """The wake-up of a slot whose caller is a coroutine: set once answered, it resolves
    the caller's future on its loop; set while it holds the lead, it hands the slot to
    the queue's leader thread. Set, like a :class:`Signal`, by one thread at a time."""

    __slots__ = ("_future", "_leaders", "_loop", "_slot")

    def __init__(
        self,
        slot: Slot[RequestT, OutcomeT],
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[OutcomeT],
        leaders: queue.SimpleQueue[Slot[RequestT, OutcomeT] | None],
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


def _resolve(future: asyncio.Future[OutcomeT], outcome: OutcomeT | BaseException | None) -> None:
    """(On the caller's loop.) The answer, unless the caller stopped waiting."""
    if future.cancelled():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        assert outcome is not None
        future.set_result(outcome)


class LeaderQueue(Generic[RequestT, OutcomeT]):
    """Queued calls run in batches, one batch at a time, in arrival order."""

    leader_name = "secondbox-batch-leader"  # the leader thread's (for coroutines)

    def __init__(self, size: int) -> None:
        self.size = size
        self._queue: deque[Slot[RequestT, OutcomeT]] = deque()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a call queued (for the leader)
        self._busy = False
        self._last_arrival = 0.0  # time.monotonic() of the latest call queued
        self._wanted = 0  # while a leader regroups: the calls it waits for
        # coroutines' slots that hold the lead, for the leader thread (started on first use)
        self._leaders: queue.SimpleQueue[Slot[RequestT, OutcomeT] | None] = queue.SimpleQueue()
        self._leader: threading.Thread | None = None

    # -- what each batcher says -----------------------------------------------------

    def _run_batch(
        self, batch: Sequence[Slot[RequestT, OutcomeT]]
    ) -> Sequence[OutcomeT | BaseException | None]:
        """Each request's answer, None for one handed back to the next batch."""
        raise NotImplementedError

    def _regroup(self) -> None:
        """(Holding ``self._lock``.) Wait for more callers before the batch is taken."""

    def _take(self) -> list[Slot[RequestT, OutcomeT]]:
        """(Holding ``self._lock``.) The next batch: the queued calls, in order, up to
        the batch size."""
        return [self._queue.popleft() for _ in range(min(self.size, len(self._queue)))]

    def _took(self, batch: Sequence[Slot[RequestT, OutcomeT]]) -> None:
        """(Holding ``self._lock``.) A batch was taken."""

    def _ran(self, seconds: float) -> None:
        """(Holding ``self._lock``.) The batch taken last was run in ``seconds``."""

    # -- the queue ------------------------------------------------------------------

    def _enqueue(self, slot: Slot[RequestT, OutcomeT]) -> bool:
        """(Holding ``self._lock``.) Queue ``slot``: whether it leads (the queue was idle)."""
        self._queue.append(slot)
        self._last_arrival = time.monotonic()
        if not self._busy:
            self._busy = slot.lead = True
            return True
        if 0 < self._wanted <= len(self._queue):
            self._arrived.notify()  # the regrouping leader has all it waits for
        return False

    def _call(self, slot: Slot[RequestT, OutcomeT]) -> OutcomeT:
        """A thread's call: queued, then waiting for its answer or leading batches."""
        with self._lock:
            self._enqueue(slot)
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

    async def _call_async(self, slot: Slot[RequestT, OutcomeT]) -> OutcomeT:
        """A coroutine's call: queued the same way, its answer awaited on its loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[OutcomeT] = loop.create_future()
        slot.wake = AsyncWake(slot, loop, future, self._leaders)
        self._start_leader()
        with self._lock:  # held by others only between a batch's steps
            leads = self._enqueue(slot)  # read here: once queued, it may be passed the lead
        if leads:
            self._leaders.put(slot)
        # shielded: a cancelled caller's request is still run (its answer dropped)
        return await asyncio.shield(future)

    def _start_leader(self) -> None:
        if self._leader is not None:
            return
        with self._lock:
            if self._leader is None:
                self._leader = threading.Thread(
                    target=self._lead_for_coroutines, name=self.leader_name, daemon=True
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

    def _lead(self) -> None:
        with self._lock:
            self._regroup()
            batch = self._take()
            self._took(batch)
        started = time.monotonic()
        try:
            outcomes = self._run_batch(batch)
            if len(outcomes) != len(batch):
                raise RuntimeError(f"{len(outcomes)} answers to a batch of {len(batch)}")
        except BaseException as error:  # the store failed: every caller of the batch hears it
            outcomes = [error] * len(batch)
        deferred, answered = [], []
        for slot, outcome in zip(batch, outcomes, strict=True):
            if outcome is None:  # handed back: first in the next batch
                slot.deferred, slot.lead = True, False
                slot.wake.clear()
                deferred.append(slot)
            else:
                slot.outcome, slot.done = outcome, True
                answered.append(slot)
        with self._lock:
            self._queue.extendleft(reversed([s for s in deferred if not s.abandoned]))
            self._ran(time.monotonic() - started)
            self._pass_lead()
        # only the slots this batch answered: a deferred one is the next leader's to wake
        for slot in answered:
            slot.wake.set()

    def _wait_for(self, wanted: int, alone: float, gap: float, limit: float) -> None:
        """(Holding ``self._lock``, released while waiting.) Wait until ``wanted`` calls
        are queued, while they keep coming: at most ``alone`` after the latest arrival
        while the leader is alone, ``gap`` once others joined, ``limit`` in all. Callers
        notify only once all are queued; a timer wake-up with a later arrival waits on
        from that arrival."""
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

    def _abandon(self, slot: Slot[RequestT, OutcomeT]) -> None:
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
