"""``SchedulerApplication.create_sandbox_async`` (the HTTP service's creations): the same
checks and answers as ``create_sandbox``, the same records, each caller's own actor,
awaited on the event loop without a thread per call; and an answer tells whether the
call created the sandbox or found it recorded (``RecordedHome``).

A creation changes no runner, so creations made after others with the same arguments
but other ids, at the same clock, meet the same state: their answers and records must
be equal, but for the ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain.actors import Actor
from secondbox_scheduler.domain.ids import refusal_log_uuid, sandbox_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.acting import acting_as
from secondbox_scheduler.infrastructure.creating.batch import CreateBatch, RecordedHome
from tests.conftest import Clock, Store
from tests.factories import HEARTBEAT_TIMEOUT
from tests.factories import requirements as profile
from tests.test_create_batch import KINDS, fleet, recorded, request

Call = dict[str, Any]


def calls(prefix: str) -> list[Call]:
    """One new sandbox of each kind (a refusal among them), the first again, the first's
    id with another workspace, and two invalid calls."""
    made: list[Call] = [
        {
            "sandbox_id": f"{prefix}-{index}",
            "workspace_id": f"workspace-{prefix}-{index}",
            "profile_revision_id": "profile-1",
            "requirements": wanted,
            "heartbeat_timeout": timeout,
        }
        for index, (wanted, timeout) in enumerate(KINDS)
    ]
    first = made[0]
    return [
        *made,
        dict(first),  # the same call again: the recorded home
        {**first, "workspace_id": "another"},  # already_exists
        {**first, "sandbox_id": f"{prefix}-bad", "workspace_id": ""},  # invalid
        {**first, "sandbox_id": f"{prefix}-zero", "heartbeat_timeout": timedelta(0)},
    ]


def answer(outcome: object, prefix: str) -> Any:
    """An answer without the call's ids: its type (``RecordedHome`` or ``str`` for a
    home) and its text, or the error's type, text and evidence."""
    text = str(outcome).replace(prefix, "<id>")
    if isinstance(outcome, str):
        return type(outcome).__name__, text
    return type(outcome).__name__, text, getattr(outcome, "evaluations", None)


def synchronous(app: SchedulerApplication, call: Call) -> object:
    try:
        return app.create_sandbox(**call)
    except Exception as error:
        return error


async def awaited(app: SchedulerApplication, call: Call) -> object:
    try:
        return await app.create_sandbox_async(**call)
    except Exception as error:
        return error


def opened(store: Store, clock: Clock, batching: str) -> SchedulerApplication:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_BATCHING": batching}, now=clock)
    store.opened.append(app)
    fleet(app, clock)
    return app


@pytest.mark.parametrize("batching", ["on", "off"])
def test_create_sandbox_async_answers_and_records_as_create_sandbox(
    store: Store, clock: Clock, batching: str
) -> None:
    app = opened(store, clock, batching)
    serial = [answer(synchronous(app, call), "sync") for call in calls("sync")]

    async def one_by_one() -> list[object]:
        with acting_as("alice"):
            return [await awaited(app, call) for call in calls("async")]

    outcomes = asyncio.run(one_by_one())
    assert [answer(outcome, "async") for outcome in outcomes] == serial
    assert [kind for kind, *_ in serial] == [
        "str", "str", "str", "NoCompatibleRunnerError", "str", "str",
        "RecordedHome", "AlreadyExistsError", "InvalidRequestError", "InvalidRequestError",
    ]  # fmt: skip
    alice = Actor.library("alice").to_record()
    for index in range(len(KINDS)):
        mine, theirs = f"async-{index}", f"sync-{index}"
        assert recorded(app, mine) == recorded(app, theirs)
        for stream in (sandbox_uuid(mine), refusal_log_uuid(mine)):
            assert all(vars(event)["actor"] == alice for event in app.events.get(stream))
    assert not list(app.events.get(sandbox_uuid("async-bad")))


@pytest.mark.parametrize("batching", ["on", "off"])
def test_concurrent_async_creations_answer_as_one_by_one(
    store: Store, clock: Clock, batching: str
) -> None:
    """Coroutines creating at once, one sandbox id twice among them: each answer is
    the serial one; of the two calls of one id, one created it and the other found it."""
    app = opened(store, clock, batching)
    creations = calls("gathered")[: len(KINDS)]
    serial = [answer(synchronous(app, call), "sync") for call in calls("sync")[: len(KINDS)]]

    async def at_once() -> list[object]:
        async def as_caller(index: int, call: Call) -> object:
            with acting_as(f"caller-{index}"):
                return await awaited(app, call)

        twice = [*creations, creations[0]]
        return await asyncio.gather(*(as_caller(i, call) for i, call in enumerate(twice)))

    *outcomes, repeat = asyncio.run(at_once())
    first = outcomes[0]
    assert sorted(type(o).__name__ for o in (first, repeat)) == ["RecordedHome", "str"]
    assert str(first) == str(repeat)
    outcomes[0] = str(first)  # which of the two created it is the order they met in
    assert [answer(outcome, "gathered") for outcome in outcomes] == serial
    for index, call in enumerate(creations[1:], start=1):
        sandbox_id = call["sandbox_id"]
        assert recorded(app, sandbox_id) == recorded(app, f"sync-{index}")
        actor = Actor.library(f"caller-{index}").to_record()
        for stream in (sandbox_uuid(sandbox_id), refusal_log_uuid(sandbox_id)):
            assert all(vars(event)["actor"] == actor for event in app.events.get(stream))


class NoThreads(ThreadPoolExecutor):
    """A default executor that refuses work: a call that needs a thread fails."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise AssertionError("a creation was handed to a thread")


def test_batched_async_creations_take_no_thread_of_the_loop(store: Store, clock: Clock) -> None:
    app = opened(store, clock, "on")

    async def main() -> list[object]:
        asyncio.get_running_loop().set_default_executor(NoThreads())
        return list(await asyncio.gather(*(awaited(app, call) for call in calls("loop")[:3])))

    homes = asyncio.run(main())
    assert all(type(home) is str for home in homes), homes
    assert [app.sandbox_home(f"loop-{index}") for index in range(3)] == homes


def test_a_batch_tells_a_found_sandbox_from_a_new_one(store: Store, clock: Clock) -> None:
    app = store.open()
    fleet(app, clock)
    app.create_sandbox(
        sandbox_id="kept", workspace_id="workspace-kept", profile_revision_id="profile-1",
        requirements=profile(), heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )  # fmt: skip
    new, kept = CreateBatch(app).run([request("new", 0), request("kept", 0)])
    assert type(new) is str
    assert isinstance(kept, RecordedHome)
    (again,) = CreateBatch(app).run([request("new", 0)])
    assert isinstance(again, RecordedHome)
    assert again == new
