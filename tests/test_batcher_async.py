"""The batcher's entry for coroutines (``PlacementBatcher.schedule_async``, the HTTP
service's): coroutine callers queue in the same queue as threads, meet them in the same
batches, and each gets its own answer, deferrals, errors and actors included; no
coroutine blocks its loop waiting, and a failure of the leader thread reaches its
caller instead of stalling everyone after it."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from secondbox_scheduler.domain import ScheduleRequest
from secondbox_scheduler.domain.actors import Actor
from secondbox_scheduler.domain.errors import HomeRunnerUnavailableError
from secondbox_scheduler.infrastructure.acting import acting_as
from secondbox_scheduler.infrastructure.placing.batcher import PlacementBatcher
from tests.conftest import Clock
from tests.factories import schedule_request


class Recorder:
    """A batch ``run`` that answers each request with its sandbox id (after a pause, so
    that others queue meanwhile), defers the ``busy-*`` ones once, refuses ``full-*``."""

    def __init__(self, pause: float = 0.02) -> None:
        self.pause = pause
        self.batches: list[list[tuple[str, bool, Any]]] = []
        self.lock = threading.Lock()

    def __call__(
        self,
        requests: Sequence[ScheduleRequest],
        deferrable: Sequence[bool],
        actors: Sequence[Any],
    ) -> list[Any]:
        with self.lock:
            self.batches.append(
                [(r.sandbox_id, d, a) for r, d, a in zip(requests, deferrable, actors, strict=True)]
            )
        threading.Event().wait(self.pause)
        answers: list[Any] = []
        for request, may_defer in zip(requests, deferrable, strict=True):
            name = request.sandbox_id
            if may_defer and name.startswith("busy"):
                answers.append(None)
            elif name.startswith("full"):
                answers.append(HomeRunnerUnavailableError((), f"{name}: no room"))
            else:
                answers.append((name, True))
        return answers


def test_coroutines_and_threads_meet_in_batches_and_each_gets_its_own_answer(
    clock: Clock,
) -> None:
    run = Recorder()
    batcher = PlacementBatcher(run)
    names = [f"{('free', 'busy', 'full')[n % 3]}-{n}" for n in range(24)]
    coroutine_names, thread_names = names[::2], names[1::2]
    answers: dict[str, Any] = {}

    async def ask(name: str) -> None:
        with acting_as(f"async-{name}"):
            try:
                answers[name] = await batcher.schedule_async(schedule_request(name, clock()))
            except HomeRunnerUnavailableError as error:
                answers[name] = error

    def in_thread(name: str) -> None:
        with acting_as(f"thread-{name}"):
            try:
                answers[name] = batcher.schedule(schedule_request(name, clock()))
            except HomeRunnerUnavailableError as error:
                answers[name] = error

    async def main() -> None:
        threads = [threading.Thread(target=in_thread, args=(n,)) for n in thread_names]
        for thread in threads:
            thread.start()
        await asyncio.gather(*(ask(n) for n in coroutine_names))
        for thread in threads:
            await asyncio.to_thread(thread.join, 10)

    asyncio.run(main())
    batcher.close()
    for name in names:
        if name.startswith("full"):
            assert isinstance(answers[name], HomeRunnerUnavailableError), name
            assert name in str(answers[name])
        else:
            assert answers[name] == (name, True), name
    tried = Counter(name for batch in run.batches for name, _, _ in batch)
    assert tried == {n: 2 if n.startswith("busy") else 1 for n in names}  # deferred once
    mixed = [
        batch for batch in run.batches
        if {n for n, _, _ in batch} & set(coroutine_names)
        and {n for n, _, _ in batch} & set(thread_names)
    ]  # fmt: skip
    assert mixed, run.batches  # the two kinds of caller did share batches
    for batch in run.batches:  # each request carries its own caller's actor
        for name, _, actor in batch:
            kind = "async" if name in coroutine_names else "thread"
            assert actor == Actor.library(f"{kind}-{name}").to_record()


def test_a_failed_batch_fails_its_coroutine_callers_and_the_batcher_goes_on(
    clock: Clock,
) -> None:
    failures = [RuntimeError("the store is gone")]

    def run(requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        if failures:
            raise failures.pop()
        return [(r.sandbox_id, True) for r in requests]

    batcher = PlacementBatcher(run)

    async def main() -> Any:
        with pytest.raises(RuntimeError, match="the store is gone"):
            await batcher.schedule_async(schedule_request("s0", clock()))
        return await batcher.schedule_async(schedule_request("s1", clock()))

    assert asyncio.run(main()) == ("s1", True)
    batcher.close()


def test_a_failure_of_the_leader_thread_reaches_its_caller_and_passes_the_lead(
    clock: Clock,
) -> None:
    """Not the batch's error (those are answers) but the leader's own, here in its
    regroup wait: its coroutine is answered with it, and the next call is answered."""
    batcher = PlacementBatcher(lambda requests, *_: [(r.sandbox_id, True) for r in requests])
    original = batcher._regroup
    calls = [0]

    def failing() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("regroup failed")
        original()

    batcher._regroup = failing  # type: ignore[method-assign]

    async def main() -> Any:
        with pytest.raises(OSError, match="regroup failed"):
            await batcher.schedule_async(schedule_request("s0", clock()))
        assert not batcher._queue
        return await asyncio.wait_for(batcher.schedule_async(schedule_request("s1", clock())), 10)

    assert asyncio.run(main()) == ("s1", True)
    batcher.close()


def test_a_cancelled_coroutine_s_request_is_still_placed(clock: Clock) -> None:
    """As a thread-pool call is not withdrawn when its request is cancelled: the batch
    that holds it decides and commits it; its answer is dropped; the others are answered."""
    started, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def run(requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        seen.extend(r.sandbox_id for r in requests)
        started.set()
        release.wait(10)
        return [(r.sandbox_id, True) for r in requests]

    batcher = PlacementBatcher(run)

    async def main() -> Any:
        first = asyncio.ensure_future(batcher.schedule_async(schedule_request("s0", clock())))
        await asyncio.to_thread(started.wait, 10)
        first.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await batcher.schedule_async(schedule_request("s1", clock()))

    assert asyncio.run(main()) == ("s1", True)
    assert seen == ["s0", "s1"]
    batcher.close()


def test_a_waiting_coroutine_leaves_its_loop_free(clock: Clock) -> None:
    """While a batch is being committed, the loop of its coroutine callers goes on."""
    release = threading.Event()

    def run(requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        release.wait(10)
        return [(r.sandbox_id, True) for r in requests]

    batcher = PlacementBatcher(run)
    ticks: list[int] = []

    async def main() -> Any:
        placing = asyncio.ensure_future(batcher.schedule_async(schedule_request("s0", clock())))
        for tick in range(5):
            await asyncio.sleep(0.001)
            ticks.append(tick)
        release.set()
        return await placing

    assert asyncio.run(main()) == ("s0", True)
    assert ticks == [0, 1, 2, 3, 4]
    batcher.close()
