"""Lost races are answers, never internal errors (issue: replicas racing one hot runner).

A command that read one aggregate before a rival's commit and the other after it sees
an inconsistent pair (a sandbox without the assignment, a runner with its
reservation). That is a lost race: the command reloads and decides again, and the
caller gets what a serial execution would give: a lost ``schedule`` answers as a replay
(the winner's assignment, ``created=False``), a lost ``release`` answers ``False``.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from secondbox_scheduler.domain import (
    Capacity,
    HomeRunnerUnavailableError,
    SchedulerError,
    SerializationContentionError,
    StaleFenceError,
)
from secondbox_scheduler.domain.errors import (
    AssignmentNotFoundError,
    InvalidTransitionError,
)
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from tests.conftest import Clock, Store
from tests.factories import capacity, create_sandbox, register, schedule_request
from tests.test_concurrency import PER_ASSIGNMENT, binding


def interleave(app: object, name: str, rival: Callable[[], object]) -> None:
    """Run ``rival`` once, just before ``app`` next loads a runner (the second read of a
    two-aggregate command): ``app`` then holds the sandbox from before the rival's
    commit and the runner from after it."""
    original = getattr(app, name)
    fired: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            rival()
        return original(*args, **kwargs)

    setattr(app, name, wrapped)


def test_a_schedule_that_lost_to_a_rival_answers_with_the_rivals_assignment(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, rival = store.open(), store.open()
    register(app, "hot", at=clock())
    create_sandbox(app, "s1")
    app.get_assignment("s1")  # cached in app before the rival commits
    theirs: list[Any] = []
    batch = PlacementBatch(app)  # a placement loads its sandboxes, then their runners
    interleave(
        batch,
        "_runners",
        lambda: theirs.append(rival.schedule(schedule_request("s1", clock()))[0]),
    )
    monkeypatch.setattr(
        "secondbox_scheduler.infrastructure.application.PlacementBatch", lambda _: batch
    )
    assignment, created = app.schedule(schedule_request("s1", clock()))
    assert not created
    assert assignment == theirs[0]
    assert rival.get_runner("hot").reserved == assignment.capacity


def test_a_schedule_refused_after_a_rival_placed_and_drained_answers_as_a_replay(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rival places the sandbox, then the runner is drained. A schedule that read
    the sandbox before the rival's placement and the runner after the drain would
    refuse (drained): no serial order gives a placement and that refusal, so it decides
    again and answers as a replay of the rival's assignment."""
    app, rival = store.open(), store.open()
    register(app, "hot", at=clock())
    create_sandbox(app, "s1")
    theirs: list[Any] = []

    def place_then_drain() -> None:
        theirs.append(rival.schedule(schedule_request("s1", clock()))[0])
        rival.start_drain("hot")

    batch = PlacementBatch(app)
    interleave(batch, "_runners", place_then_drain)
    monkeypatch.setattr(
        "secondbox_scheduler.infrastructure.application.PlacementBatch", lambda _: batch
    )
    assignment, created = app.schedule(schedule_request("s1", clock()))
    assert (assignment, created) == (theirs[0], False)


def test_a_release_that_lost_to_a_rival_answers_false(store: Store, clock: Clock) -> None:
    app, rival = store.open(), store.open()
    register(app, "hot", at=clock())
    create_sandbox(app, "s1")
    assignment, _ = app.schedule(schedule_request("s1", clock()))
    fence = (assignment.generation, assignment.fencing_token)
    app.get_assignment("s1")
    # the rival releases just before the release loads the runner (after the sandbox):
    # this test hooked ``_load_runner`` once, a name that no longer exists: it failed
    load = app.load
    fired: list[bool] = []

    def load_runner_after_rival(aggregate_id: Any, kind: type[Any], **kwargs: Any) -> Any:
        if kind is Runner and not fired:
            fired.append(rival.release("s1", *fence, {"exit": "0"}))
        return load(aggregate_id, kind, **kwargs)

    app.load = load_runner_after_rival  # type: ignore[method-assign]
    assert app.release("s1", *fence, {"exit": "0"}) is False
    assert fired == [True], "the rival's release ran between the two reads"
    assert rival.get_runner("hot").reserved == capacity(
        vcpu_count=0, memory_bytes=0, disk_bytes=0, instances=0, operations=0
    )


DOCUMENTED = (
    StaleFenceError,  # the generation moved on, or the token is another one
    InvalidTransitionError,  # e.g. advancing before the release
    AssignmentNotFoundError,  # the generation is not scheduled yet
    HomeRunnerUnavailableError,  # the hot runner is full
    SerializationContentionError,  # past the caller's own retry budget
)


@pytest.mark.postgres
@pytest.mark.parametrize("dimension", Capacity.DIMENSIONS)
def test_replicas_racing_one_hot_runner_only_ever_get_documented_outcomes(
    postgres_schema: Any, clock: Clock, dimension: str
) -> None:
    """Three replicas, a random mix of commands on four sandboxes homed on one runner
    with room for three, on ``dimension`` alone (every other dimension roomy)."""
    env = postgres_schema.env()
    replicas = [SchedulerApplication(env=dict(env), now=clock) for _ in range(3)]
    try:
        register(replicas[0], "hot", at=clock(), allocatable=binding(dimension, 3))
        sandboxes = [f"s{i}" for i in range(4)]
        for sandbox_id in sandboxes:
            create_sandbox(replicas[0], sandbox_id)
        outcomes: Counter[str] = Counter()
        internal: list[BaseException] = []
        refusals: list[str] = []
        lock = threading.Lock()

        def work(index: int) -> None:
            app, rng = replicas[index], random.Random(index)
            for _ in range(60):
                sandbox_id = rng.choice(sandboxes)
                kind = rng.choice(["schedule", "release", "advance", "running"])
                try:
                    outcome = act(app, kind, sandbox_id, clock)
                except DOCUMENTED as error:
                    outcome = f"{kind}: {type(error).__name__}"
                    if isinstance(error, HomeRunnerUnavailableError):
                        with lock:
                            refusals.append(str(error))
                except BaseException as error:  # anything else is a leak
                    with lock:
                        internal.append(error)
                    continue
                with lock:
                    outcomes[outcome] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(f"\n180 operations by 3 replicas on one hot runner: {dict(sorted(outcomes.items()))}")
        assert internal == []
        assert sum(outcomes.values()) == 180
        assert outcomes["schedule: placed"] > 0
        hot = replicas[0].get_runner("hot")
        held = [replicas[0].get_assignment(s) for s in sandboxes]
        holding = [a for a in held if a is not None and a.state != "released"]
        assert len(holding) <= 3
        for dim, reserved in hot.reserved.as_dict().items():
            assert reserved == len(holding) * PER_ASSIGNMENT[dim], dim
            assert reserved <= hot.allocatable.as_dict()[dim], dim
        # every refusal of a schedule was the hot runner full on the binding dimension
        for text in refusals:
            assert f"insufficient {dimension}" in text, text
    finally:
        for app in replicas:
            app.close()


def act(app: SchedulerApplication, kind: str, sandbox_id: str, clock: Clock) -> str:
    current = app.get_assignment(sandbox_id)
    if kind == "schedule":
        _, created = app.schedule(schedule_request(sandbox_id, clock()))
        return "schedule: placed" if created else "schedule: replay"
    if current is None:
        raise AssignmentNotFoundError(sandbox_id)
    fence = (current.generation, current.fencing_token)
    if kind == "release":
        released = app.release(sandbox_id, *fence, {"exit": "0"})
        return f"release: {released}"
    if kind == "running":
        app.mark_running(sandbox_id, *fence)
        return "running"
    app.advance_generation(sandbox_id, current.generation)
    return "advance"


def test_documented_outcomes_are_scheduler_errors() -> None:
    assert all(issubclass(kind, SchedulerError) for kind in DOCUMENTED)
