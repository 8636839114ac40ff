"""Concurrent ``create_sandbox`` calls of one process are decided and committed together
(``infrastructure/creating``): each answer, and each home and evidence recorded, equals
what the same creation made alone gives.

A creation changes no runner (the runner snapshots projection ignores
``Sandbox.Created``), so creations made one by one after a batch, with the same
arguments but other ids, at the same clock, meet the state the batch met: their homes,
home decisions and refusals must equal the batch's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain.actors import ActorRecord
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    NoCompatibleRunnerError,
    SchedulerError,
)
from secondbox_scheduler.domain.ids import refusal_log_uuid, sandbox_uuid
from secondbox_scheduler.domain.placement.evidence import Unlisted
from secondbox_scheduler.domain.placement.home_choice import HomeChoice
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Requirements
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.acting import acting_as
from secondbox_scheduler.infrastructure.creating.batch import CreateBatch, Created, CreateRequest
from secondbox_scheduler.infrastructure.creating.batcher import CreateBatcher
from secondbox_scheduler.testing.builders import T0, compatible_runner
from tests.conftest import Clock, Store
from tests.factories import HEARTBEAT_TIMEOUT, capacity, register, schedule_request
from tests.factories import requirements as profile

# (requirements, heartbeat timeout) of each creation: shared searches, a second pool,
# a refusal (a capability no runner offers) and a longer timeout
KINDS: list[tuple[Requirements, timedelta]] = [
    (profile(), HEARTBEAT_TIMEOUT),
    (profile(), HEARTBEAT_TIMEOUT),
    (profile(pool_name="pool-b"), HEARTBEAT_TIMEOUT),
    (profile(required_capabilities=frozenset({"gpu"})), HEARTBEAT_TIMEOUT),
    (profile(), HEARTBEAT_TIMEOUT * 2),
    (profile(), HEARTBEAT_TIMEOUT),
]


def fleet(app: SchedulerApplication, clock: Clock) -> None:
    """Runners of unequal free capacity, one of them placed on, and the roomiest one
    silent for longer than the heartbeat timeout, not twice as long."""
    register(app, "a-silent", at=clock(), allocatable=capacity(instances=64))
    clock.advance(seconds=HEARTBEAT_TIMEOUT.total_seconds() * 1.5)
    for index in range(5):
        register(app, f"a-{index}", at=clock(), allocatable=capacity(instances=2 + index))
    register(app, "b-0", at=clock(), pool_name="pool-b")
    app.create_sandbox(
        sandbox_id="placed",
        workspace_id="workspace-placed",
        profile_revision_id="profile-1",
        requirements=profile(),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    assert app.schedule(schedule_request("placed", clock()))[1]


def request(sandbox_id: str, kind: int, actor: ActorRecord | None = None) -> CreateRequest:
    requirements, timeout = KINDS[kind]
    return CreateRequest(
        sandbox_id, f"workspace-{sandbox_id}", "profile-1", requirements, timeout, actor
    )


def alone(app: SchedulerApplication, creation: CreateRequest) -> Created:
    try:
        return app.create_sandbox(
            sandbox_id=creation.sandbox_id,
            workspace_id=creation.workspace_id,
            profile_revision_id=creation.profile_revision_id,
            requirements=creation.requirements,
            heartbeat_timeout=creation.heartbeat_timeout,
        )
    except SchedulerError as error:
        return error


def answer(outcome: Created | BaseException) -> Any:
    """An answer without its sandbox id: the home, or the error's class and evidence."""
    if isinstance(outcome, str):
        return outcome
    evidence = getattr(outcome, "evaluations", None)
    return type(outcome).__name__, evidence, getattr(outcome, "unlisted", None)


def recorded(app: SchedulerApplication, sandbox_id: str) -> list[Any]:
    """What the creation recorded, but for the sandbox's own ids: the home and its
    decision, or the refusals with their evidence."""
    found: list[Any] = []
    for event in app.events.get(sandbox_uuid(sandbox_id)):
        fields = vars(event)
        found.append((type(event).__name__, fields["home_runner_id"], fields["home_decision"]))
    for event in app.events.get(refusal_log_uuid(sandbox_id)):
        fields = dict(vars(event))
        for name in ("originator_id", "originator_version", "timestamp", "actor", "sandbox_id"):
            fields.pop(name, None)
        found.append((type(event).__name__, fields))
    return found


def test_a_batch_answers_and_records_what_each_creation_alone_does(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    fleet(app, clock)
    app.create_sandbox(
        sandbox_id="kept", workspace_id="workspace-kept", profile_revision_id="profile-1",
        requirements=profile(), heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )  # fmt: skip
    batch = [request(f"batch-{i}", kind) for i, kind in enumerate(range(len(KINDS)))]
    repeat = request("kept", 0)  # already recorded with these arguments: its home
    other = CreateRequest("kept", "another", "profile-1", profile(), HEARTBEAT_TIMEOUT)
    outcomes = CreateBatch(app).run([*batch, repeat])
    assert outcomes[-1] == app.sandbox_home("kept")
    assert isinstance(CreateBatch(app).run([other])[0], AlreadyExistsError)
    assert isinstance(outcomes[3], NoCompatibleRunnerError)
    assert outcomes[4] == "a-silent"  # fresh enough for the longer timeout alone
    assert outcomes[0] == outcomes[1] != outcomes[2] != "a-silent"
    for index, kind in enumerate(range(len(KINDS))):
        serial = request(f"serial-{index}", kind)
        assert answer(alone(app, serial)) == answer(outcomes[index])
        assert recorded(app, serial.sandbox_id) == recorded(app, batch[index].sandbox_id)
        assert recorded(app, serial.sandbox_id)  # something to compare


def test_concurrent_creations_answer_as_one_by_one(store: Store, clock: Clock) -> None:
    app = store.open()
    fleet(app, clock)
    callers = 8
    start = threading.Barrier(callers)
    outcomes: dict[int, Created | BaseException] = {}

    def create(index: int) -> None:
        start.wait()
        outcomes[index] = alone(app, request(f"concurrent-{index}", index % len(KINDS)))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert app.creations is not None
    for index in range(callers):
        serial = request(f"serial-{index}", index % len(KINDS))
        assert answer(alone(app, serial)) == answer(outcomes[index])
        assert recorded(app, serial.sandbox_id) == recorded(app, f"concurrent-{index}")


def test_a_rival_creation_is_answered_from_its_record(store: Store, clock: Clock) -> None:
    """Another replica created one of the batch's sandboxes after the batch looked: the
    batch's save fails, each is saved alone, the lost one answers the rival's home."""
    app, rival = store.open(), store.open()
    fleet(app, clock)
    register(app, "a-9", at=clock(), allocatable=capacity(instances=64))
    batch = CreateBatch(app)
    looked = batch.store.load_many

    def look_then_rival(ids: Sequence[Any], *, cache_new: bool = True) -> dict[Any, Any]:
        found = looked(ids, cache_new=cache_new)
        rival.create_sandbox(
            sandbox_id="raced", workspace_id="workspace-raced", profile_revision_id="profile-1",
            requirements=profile(), heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )  # fmt: skip
        return found

    batch.store.load_many = look_then_rival  # type: ignore[method-assign,assignment]
    outcomes = batch.run([request("first", 0), request("raced", 0), request("third", 0)])
    assert outcomes == ["a-9", rival.sandbox_home("raced"), "a-9"]
    assert app.sandbox_home("first") == app.sandbox_home("third") == "a-9"
    clashing = CreateRequest("raced", "elsewhere", "profile-1", profile(), HEARTBEAT_TIMEOUT)
    assert isinstance(CreateBatch(app).run([clashing])[0], AlreadyExistsError)


def test_each_sandbox_records_its_own_callers_actor(store: Store, clock: Clock) -> None:
    app = store.open()
    fleet(app, clock)
    with acting_as("alice") as alice:
        pass
    with acting_as("bob") as bob:
        pass
    refused = request("refused-bob", 3, bob)
    CreateBatch(app).run([request("by-alice", 0, alice), request("by-bob", 0, bob), refused])
    actors = {
        sandbox_id: [vars(event)["actor"] for event in app.events.get(stream)]
        for sandbox_id, stream in [
            ("by-alice", sandbox_uuid("by-alice")), ("by-bob", sandbox_uuid("by-bob")),
            ("refused-bob", refusal_log_uuid("refused-bob")),
        ]
    }  # fmt: skip
    assert actors == {"by-alice": [alice], "by-bob": [bob], "refused-bob": [bob, bob]}


# -- the batcher: who leads, what a batch holds, who hears what ----------------------


class GatedRun:
    """A batch function whose first batch waits until ``queued`` more calls are queued
    behind it, so that the second batch holds them all (no timing involved)."""

    def __init__(self, batcher_of: list[CreateBatcher], queued: int) -> None:
        self.batches: list[list[str]] = []
        self.batcher_of = batcher_of
        self.queued = queued
        self.release = threading.Event()

    def __call__(self, requests: Sequence[CreateRequest]) -> list[Created]:
        self.batches.append([r.sandbox_id for r in requests])
        if len(self.batches) == 1:
            self.release.wait(timeout=30)
        return [f"home-of-{r.sandbox_id}-{len(self.batches)}" for r in requests]

    def wait_for_queue(self) -> None:
        batcher = self.batcher_of[0]
        while True:
            with batcher._lock:
                if len(batcher._queue) >= self.queued:
                    break
            threading.Event().wait(0.001)
        self.release.set()


def test_the_batcher_answers_each_caller_its_own_outcome_and_keeps_ids_apart() -> None:
    batchers: list[CreateBatcher] = []
    run = GatedRun(batchers, queued=4)
    batcher = CreateBatcher(run, size=8)
    batchers.append(batcher)
    answers: list[tuple[str, str]] = []

    def call(sandbox_id: str) -> None:
        answers.append((sandbox_id, batcher.create(request(sandbox_id, 0))))

    first = threading.Thread(target=call, args=("s0",))
    first.start()
    while not run.batches:
        threading.Event().wait(0.001)
    others = [threading.Thread(target=call, args=(sid,)) for sid in ("s1", "s2", "s1", "s3")]
    for thread in others:
        thread.start()
    run.wait_for_queue()
    for thread in [first, *others]:
        thread.join()
    assert run.batches[0] == ["s0"]
    assert sorted(run.batches[1]) == ["s1", "s2", "s3"]  # one of the two s1 calls
    assert run.batches[2] == ["s1"]  # the repeat: in the next batch, alone
    assert sorted(answers) == [
        ("s0", "home-of-s0-1"), ("s1", "home-of-s1-2"), ("s1", "home-of-s1-3"),
        ("s2", "home-of-s2-2"), ("s3", "home-of-s3-2"),
    ]  # fmt: skip


def test_a_failed_batch_raises_in_every_caller_and_the_lead_passes_on() -> None:
    batchers: list[CreateBatcher] = []
    run = GatedRun(batchers, queued=2)
    failing = {"bad"}

    def runs(requests: Sequence[CreateRequest]) -> list[Created]:
        outcomes = run(requests)
        if any(r.sandbox_id in failing for r in requests):
            raise RuntimeError("the store failed")
        return outcomes

    batcher = CreateBatcher(runs, size=8)
    batchers.append(batcher)
    heard: dict[str, str] = {}

    def call(sandbox_id: str) -> None:
        try:
            heard[sandbox_id] = batcher.create(request(sandbox_id, 0))
        except RuntimeError as error:
            heard[sandbox_id] = str(error)

    first = threading.Thread(target=call, args=("good",))
    first.start()
    while not run.batches:
        threading.Event().wait(0.001)
    others = [threading.Thread(target=call, args=(sid,)) for sid in ("bad", "also")]
    for thread in others:
        thread.start()
    run.wait_for_queue()
    for thread in [first, *others]:
        thread.join()
    assert heard == {
        "good": "home-of-good-1",
        "bad": "the store failed",
        "also": "the store failed",
    }
    assert batcher.create(request("after", 0)) == "home-of-after-3"  # the batcher is idle


def test_batching_off_creates_alone(store: Store, clock: Clock) -> None:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_BATCHING": "off"}, now=clock)
    store.opened.append(app)
    assert app.creations is None
    fleet(app, clock)
    assert alone(app, request("lone", 0)) == alone(app, request("lone-too", 0))


@pytest.mark.parametrize("size", [0, -1])
def test_a_batch_size_below_one_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        CreateBatcher(lambda requests: [], size=size)


def test_a_shared_home_choice_records_what_each_creation_alone_does() -> None:
    """``Sandbox.create_at_home`` with one ``HomeChoice`` for several sandboxes (a
    batch's one decision per search) records for each the home and evidence that
    ``Sandbox.create`` over the same candidates records; a refused choice raises the
    same refusal; a choice made for other requirements is refused."""
    wanted = profile()
    runners = [
        compatible_runner(wanted, "r-small"),
        compatible_runner(wanted, "r-big", allocatable=capacity(instances=40)),
        compatible_runner(wanted, "r-drained", drain_phase="drained"),
    ]
    unlisted = Unlisted(refused=3, not_evaluated=2, reasons={"draining": 3})
    choice = HomeChoice.decided(wanted, runners, T0, HEARTBEAT_TIMEOUT, unlisted)
    for sandbox_id in ("s-1", "s-2"):
        alone = Sandbox.create(
            sandbox_id=sandbox_id, workspace_id="w", profile_revision_id="p",
            requirements=wanted, runners=runners, now=T0,
            heartbeat_timeout=HEARTBEAT_TIMEOUT, unlisted=unlisted,
        )  # fmt: skip
        shared = Sandbox.create_at_home(
            sandbox_id=sandbox_id, workspace_id="w", profile_revision_id="p",
            requirements=wanted, choice=choice,
        )  # fmt: skip
        assert shared.home_runner_id == alone.home_runner_id == "r-big"
        (created_alone,) = alone.collect_events()
        (created_shared,) = shared.collect_events()
        assert vars(created_shared) == vars(created_alone)
    gpu = profile(required_capabilities=frozenset({"gpu"}))
    refused = HomeChoice.decided(gpu, runners, T0, HEARTBEAT_TIMEOUT)
    with pytest.raises(NoCompatibleRunnerError) as alone_error:
        Sandbox.create(
            sandbox_id="s-3", workspace_id="w", profile_revision_id="p", requirements=gpu,
            runners=runners, now=T0, heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )  # fmt: skip
    with pytest.raises(NoCompatibleRunnerError) as shared_error:
        Sandbox.create_at_home(
            sandbox_id="s-3", workspace_id="w", profile_revision_id="p", requirements=gpu,
            choice=refused,
        )  # fmt: skip
    assert str(shared_error.value) == str(alone_error.value)
    assert shared_error.value.evaluations == alone_error.value.evaluations
    with pytest.raises(ValueError, match="other requirements"):
        Sandbox.create_at_home(
            sandbox_id="s-4", workspace_id="w", profile_revision_id="p", requirements=gpu,
            choice=choice,
        )  # fmt: skip
