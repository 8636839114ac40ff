"""Placements in batches: the answers of a serial execution, committed together.

A batch of requests (``schedule_many``, or concurrent ``schedule`` calls that the
batcher groups) is decided in order against the state the earlier requests left, and
committed in one transaction; each caller gets exactly what the same requests run one
by one in the same order would give.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from eventsourcing.persistence import PersistenceError, ProgrammingError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain import InvalidRequestError, ScheduleRequest, SchedulerError
from secondbox_scheduler.domain.audit.chain import Link
from secondbox_scheduler.domain.errors import PlacementError
from secondbox_scheduler.domain.ids import refusal_log_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import Requirements
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.placing import batcher as batcher_module
from secondbox_scheduler.infrastructure.placing.batcher import (
    PlacementBatcher,
    batcher_from_settings,
)
from secondbox_scheduler.infrastructure.settings import AUDIT_KEY, BATCH_SIZE
from secondbox_scheduler.infrastructure.store.chain_tables import seal_table
from secondbox_scheduler.infrastructure.store.chained_postgres import ChainedPostgresRecorder
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from tests.conftest import Clock, PostgresSchema, Store
from tests.factories import (
    capacity,
    create_sandbox,
    register,
    requirements,
    schedule_request,
    token,
)

TOKENS = [token() for _ in range(12)]
SANDBOXES = [f"s{i}" for i in range(5)]
REQUEST = st.tuples(
    st.sampled_from(SANDBOXES),
    st.sampled_from(range(len(TOKENS))),
    st.sampled_from(["ok"] * 6 + ["other-workspace", "other-requirements"]),
)


def build(app: SchedulerApplication, clock: Clock) -> None:
    """Two runners, room for three placements each; five sandboxes homed on them."""
    register(app, "ra", at=clock(), allocatable=capacity(instances=3))
    register(app, "rb", at=clock(), allocatable=capacity(instances=3))
    for sandbox_id in SANDBOXES:
        create_sandbox(app, sandbox_id)


def request_of(spec: tuple[str, int, str], clock: Clock) -> ScheduleRequest:
    sandbox_id, token_index, variant = spec
    overrides: dict[str, Any] = {"fencing_token": TOKENS[token_index]}
    if variant == "other-workspace":
        overrides["workspace_id"] = "elsewhere"
    elif variant == "other-requirements":
        overrides["requirements"] = requirements(capacity=capacity(instances=2))
    request = schedule_request(sandbox_id, clock(), **overrides)
    # the same assignment id for the same sandbox and token, whichever run makes it
    return request.model_copy(update={"assignment_id": f"a-{sandbox_id}-{token_index}"})


def answer(outcome: tuple[Any, bool] | SchedulerError) -> tuple[Any, ...]:
    if isinstance(outcome, SchedulerError):
        return ("error", type(outcome).__name__)
    assignment, created = outcome
    return ("ok", created, assignment.id, assignment.runner_id, assignment.generation)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=st.lists(REQUEST, min_size=1, max_size=14))
def test_a_batch_answers_as_the_same_requests_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, clock: Clock, specs: list[tuple[str, int, str]]
) -> None:
    """On SQLite files (the batch logic is the same on both stores; the racing tests
    below run on PostgreSQL)."""
    directory = tmp_path_factory.mktemp("batch")
    serial = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{directory}/serial.db"}, now=clock
    )
    batched = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{directory}/batched.db"}, now=clock
    )
    try:
        build(serial, clock)
        build(batched, clock)
        requests = [request_of(spec, clock) for spec in specs]
        one_by_one = []
        for request in requests:
            try:
                one_by_one.append(answer(serial.schedule(request)))
            except SchedulerError as error:
                one_by_one.append(answer(error))
        together = [answer(outcome) for outcome in batched.schedule_many(requests)]
        assert together == one_by_one
        for runner_id in ("ra", "rb"):
            assert batched.get_runner(runner_id).reserved == serial.get_runner(runner_id).reserved
        assert verify(batched, measure_raw=False).ok
    finally:
        serial.close()
        batched.close()


FIXED = [("s0", 0, "ok"), ("s0", 0, "ok"), ("s1", 1, "ok"), ("s1", 2, "ok"),
         ("s2", 3, "other-workspace"), ("s2", 3, "ok"), ("s3", 4, "ok"), ("s4", 5, "ok"),
         ("s0", 6, "ok"), ("s2", 7, "other-requirements")]  # fmt: skip


def test_a_batch_answers_as_one_by_one_on_both_stores(
    store: Store, tmp_path: Path, clock: Clock
) -> None:
    batched = store.open()
    serial = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path}/serial.db"}, now=clock
    )
    store.opened.append(serial)
    build(batched, clock)
    build(serial, clock)
    requests = [request_of(spec, clock) for spec in FIXED]
    one_by_one = []
    for request in requests:
        try:
            one_by_one.append(answer(serial.schedule(request)))
        except SchedulerError as error:
            one_by_one.append(answer(error))
    assert [answer(o) for o in batched.schedule_many(requests)] == one_by_one
    assert ("ok", False, "a-s0-0", one_by_one[0][3], 1) == one_by_one[1]  # a replay
    assert verify(batched, measure_raw=False).ok


def test_an_invalid_request_in_a_batch_refuses_only_itself(
    app: SchedulerApplication, clock: Clock
) -> None:
    build(app, clock)
    good = schedule_request("s0", clock())
    bad = schedule_request("s1", clock()).model_copy(update={"fencing_token": b"short"})
    outcomes = app.schedule_many([bad, good])
    assert isinstance(outcomes[0], InvalidRequestError)
    assert outcomes[0].field == "fencing_token"
    assert not isinstance(outcomes[1], SchedulerError)
    assert outcomes[1][1] is True


def test_concurrent_calls_are_grouped_and_each_gets_its_own_answer(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    build(app, clock)
    for index in range(30):
        create_sandbox(app, f"t{index}")
    answers: dict[str, Any] = {}
    lock = threading.Lock()

    def call(sandbox_id: str) -> None:
        try:
            outcome: Any = app.schedule(schedule_request(sandbox_id, clock()))
        except SchedulerError as error:
            outcome = error
        with lock:
            answers[sandbox_id] = outcome

    threads = [threading.Thread(target=call, args=(f"t{i}",)) for i in range(30)]
    threads += [threading.Thread(target=call, args=(f"t{i}",)) for i in range(5)]  # repeats
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    placed = [a for a in answers.values() if isinstance(a, tuple)]
    refused = [a for a in answers.values() if isinstance(a, SchedulerError)]
    assert len(placed) + len(refused) == 30
    reserved = sum(app.get_runner(r).reserved.instances for r in ("ra", "rb"))
    assert reserved == sum(1 for a in placed) <= 6  # never past allocatable
    # every call was decided in a batch, and no batch was larger than the setting
    assert sum(size * count for size, count in app.metrics.batch_sizes.items()) == 35
    assert max(app.metrics.batch_sizes) <= app.batcher.size if app.batcher else True
    assert verify(app, measure_raw=False).ok


@pytest.mark.postgres
def test_racing_batchers_in_several_replicas_never_oversubscribe(
    postgres_schema: Any, clock: Clock
) -> None:
    env = postgres_schema.env()
    replicas = [SchedulerApplication(env=dict(env), now=clock) for _ in range(3)]
    try:
        roomy_but_seven = capacity(
            instances=7, vcpu_count=100, memory_bytes=2**40, disk_bytes=2**40, operations=100
        )
        register(replicas[0], "hot", at=clock(), allocatable=roomy_but_seven)
        for index in range(24):
            create_sandbox(replicas[0], f"h{index}")
        outcomes: Counter[str] = Counter()
        lock = threading.Lock()

        def call(app: SchedulerApplication, sandbox_id: str) -> None:
            try:
                _, created = app.schedule(schedule_request(sandbox_id, clock()))
                kind = "placed" if created else "replay"
            except SchedulerError as error:
                kind = type(error).__name__
            with lock:
                outcomes[kind] += 1

        threads = [
            threading.Thread(target=call, args=(replicas[i % 3], f"h{i % 24}")) for i in range(72)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        hot = replicas[0].get_runner("hot")
        assert hot.reserved.instances == outcomes["placed"] == 7, outcomes
        assert set(outcomes) <= {"placed", "replay", "HomeRunnerUnavailableError"}
        assert verify(replicas[0], measure_raw=False).ok
    finally:
        for app in replicas:
            app.close()


def test_batching_can_be_switched_off(store: Store, clock: Clock) -> None:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_BATCHING": "off"}, now=clock)
    store.opened.append(app)
    assert app.batcher is None
    build(app, clock)
    assert app.schedule(schedule_request("s0", clock()))[1]


@pytest.mark.parametrize(
    ("name", "value"),
    [("SECONDBOX_BATCH_SIZE", "0"), ("SECONDBOX_BATCH_SIZE", "many"),
     ("SECONDBOX_BATCH_WAIT_MS", "-1")],
)  # fmt: skip
def test_bad_batch_settings_are_refused(store: Store, name: str, value: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SchedulerApplication(env={**store.env, name: value})
    assert refused.value.field == name


def test_a_lone_call_waits_for_nobody(app: SchedulerApplication, clock: Clock) -> None:
    build(app, clock)
    assert app.batcher is not None
    assert app.batcher.wait == 0  # the default: a lone call leads at once
    assert app.schedule(schedule_request("s0", clock()))[1]
    assert app.metrics.batch_sizes == {1: 1}


def _cached(app: SchedulerApplication, aggregate_id: UUID) -> Any:
    """The repository's cached instance, or None."""
    assert app.repository.cache is not None
    try:
        return app.repository.cache.get(aggregate_id)
    except KeyError:
        return None


def test_a_batch_caches_its_runners_and_not_its_sandboxes(
    app: SchedulerApplication, clock: Clock
) -> None:
    """Each sandbox is placed once, and a cached copy would be stale at the commit:
    caching them filled the cache with 10,000 sandboxes, most of the objects a full
    garbage collection walks (the bench's p99). A sandbox cached before is still brought
    up to date, and commands never touch the cached instance."""
    build(app, clock)
    read_before: Any = app.repository.get(sandbox_uuid("s4"))
    outcomes = app.schedule_many([schedule_request(s, clock()) for s in ("s0", "s1", "s4")])
    assert all(not isinstance(o, SchedulerError) and o[1] for o in outcomes)
    assert _cached(app, sandbox_uuid("s0")) is None
    assert _cached(app, sandbox_uuid("s1")) is None
    assert _cached(app, runner_uuid("ra")) is not None
    assert _cached(app, runner_uuid("rb")) is not None
    cached = _cached(app, sandbox_uuid("s4"))
    assert cached is not None
    assert cached.version == read_before.version  # untouched by the commands
    again = app.schedule_many([schedule_request(s, clock()) for s in ("s0", "s4")])
    assert [o[1] for o in again if not isinstance(o, SchedulerError)] == [False, False]
    assert [o[0].id for o in again if not isinstance(o, SchedulerError)] == [
        outcomes[0][0].id,  # type: ignore[index]
        outcomes[2][0].id,  # type: ignore[index]
    ]


def test_a_deferred_call_goes_first_into_the_next_batch_and_is_not_deferred_again(
    clock: Clock,
) -> None:
    """The batcher's side of a deferral (the store's side: tests/test_runner_locks.py):
    a call whose runner was busy is queued again before the later calls, its next batch
    may not defer it, and every caller gets its own answer, the leader's included."""
    runs: list[list[tuple[str, bool]]] = []
    guard = threading.Lock()

    def run(
        requests: Sequence[ScheduleRequest], deferrable: Sequence[bool], _: Sequence[Any]
    ) -> list[Any]:
        with guard:
            runs.append([(r.sandbox_id, d) for r, d in zip(requests, deferrable, strict=True)])
        return [
            None if d and r.sandbox_id.startswith("busy") else (r.sandbox_id, True)
            for r, d in zip(requests, deferrable, strict=True)
        ]

    batcher = PlacementBatcher(run)
    lone: Any = batcher.schedule(schedule_request("busy-0", clock()))
    assert lone == ("busy-0", True)
    assert runs == [[("busy-0", True)], [("busy-0", False)]]  # the lone leader led again
    runs.clear()
    names = [f"{'busy' if n % 2 else 'free'}-{n}" for n in range(1, 17)]
    answers: dict[str, Any] = {}
    threads = [
        threading.Thread(
            target=lambda n=n: answers.update({n: batcher.schedule(schedule_request(n, clock()))})
        )
        for n in names
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert answers == {n: (n, True) for n in names}
    tried = Counter(name for batch in runs for name, _ in batch)
    assert tried == {n: 2 if n.startswith("busy") else 1 for n in names}
    for batch in runs:  # a deferred call comes back before any call queued after it
        flags = [d for _, d in batch]
        assert flags == sorted(flags)  # the not-deferrable (deferred before) come first


class _Rounds:
    """A batcher over a recording ``run``, and callers that come back like a bench's: a
    first batch of ``callers`` (gathered behind a lone call whose run waits for them),
    then each caller calls again after its own delay."""

    def __init__(self, callers: int) -> None:
        self.callers = callers
        self.batches: list[list[str]] = []
        self.first = threading.Event()
        self.batcher = PlacementBatcher(self._run)

    def _run(self, requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        self.batches.append([r.sandbox_id for r in requests])
        if requests[0].sandbox_id == "opener":
            assert self.first.wait(10)  # the callers queue meanwhile: one batch of them
        return [(r.sandbox_id, True) for r in requests]

    def play(self, clock: Clock, delays: Sequence[float]) -> dict[str, Any]:
        answers: dict[str, Any] = {}
        deadline = time.monotonic() + 20

        def caller(n: int) -> None:
            answers[f"a{n}"] = self.batcher.schedule(schedule_request(f"a{n}", clock()))
            if n < len(delays):
                time.sleep(delays[n])
                answers[f"b{n}"] = self.batcher.schedule(schedule_request(f"b{n}", clock()))

        opener = threading.Thread(
            target=lambda: self.batcher.schedule(schedule_request("opener", clock())),
            daemon=True,  # a failing test leaves no thread behind to hold pytest
        )
        opener.start()
        while not self.batches and time.monotonic() < deadline:
            time.sleep(0.001)
        threads = [
            threading.Thread(target=caller, args=(n,), daemon=True) for n in range(self.callers)
        ]
        for thread in threads:
            thread.start()
        while len(self.batcher._queue) < self.callers and time.monotonic() < deadline:
            time.sleep(0.001)
        self.first.set()
        for thread in [opener, *threads]:
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), "a caller was never answered"
        return answers


def test_under_load_a_leader_waits_for_the_callers_of_its_previous_batch(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callers a batch of 8 answered come back one by one (30 ms apart, against waits
    widened to 0.2 and 0.5 s so that a slow machine cannot split them; the bench's come
    back over a few ms): the next batch takes all 8, instead of leading with the first
    one back and leaving the others a whole batch to wait."""
    monkeypatch.setattr(batcher_module, "REGROUP_WAIT", 0.2)
    monkeypatch.setattr(batcher_module, "REGROUP_GAP", 0.5)
    monkeypatch.setattr(batcher_module, "REGROUP_LIMIT", 5.0)
    rounds = _Rounds(8)
    answers = rounds.play(clock, [0.03 * n for n in range(8)])
    assert len(answers) == 16
    assert all(answers[k] == (k, True) for k in answers)
    assert sorted(rounds.batches[1]) == [f"a{n}" for n in range(8)]
    assert sorted(rounds.batches[2]) == [f"b{n}" for n in range(8)]
    assert len(rounds.batches) == 3


def test_a_pause_in_the_arrivals_ends_the_regroup_wait(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only 3 of the 8 callers come back: the leader stops waiting after a pause with no
    arrival, not at the longest wait (30 s here: the callers' joins would time out)."""
    monkeypatch.setattr(batcher_module, "REGROUP_GAP", 0.05)
    monkeypatch.setattr(batcher_module, "REGROUP_LIMIT", 30.0)
    rounds = _Rounds(8)
    answers = rounds.play(clock, [0.0, 0.0, 0.0])
    assert len(answers) == 11
    assert all(answers[k] == (k, True) for k in answers)
    assert sorted(n for batch in rounds.batches[2:] for n in batch) == ["b0", "b1", "b2"]


def test_how_long_a_leader_regroups() -> None:
    """A lone call after a lone call never waits, and a leader nobody joins waits 1 ms at
    most whatever came before (the low-load promise); after a batch of two or three, 1 ms
    in all; under load, once joined, while calls keep arriving; a configured wait is for
    a full batch."""
    regroup = batcher_module.regroup
    wait, gap, limit = (
        batcher_module.REGROUP_WAIT,
        batcher_module.REGROUP_GAP,
        batcher_module.REGROUP_LIMIT,
    )
    assert regroup(0, 64, 0.0)[0] == 0
    assert regroup(1, 64, 0.0)[0] == 1  # itself, queued: no wait
    assert wait <= 0.001
    assert regroup(3, 64, 0.0) == (3, wait, wait, wait)
    assert regroup(4, 64, 0.0) == (4, wait, gap, limit)
    assert gap < limit
    assert regroup(100, 64, 0.0) == (64, wait, gap, limit)
    assert regroup(1, 64, 0.005) == (64, 0.005, 0.005, 0.005)


def test_a_leader_that_nobody_joins_goes_after_the_first_wait(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a batch of 8, only one caller comes back: it goes alone after the first
    wait (widened to 0.2 s here, against a longest wait of 30 s that would time out the
    join), not after the pause or the longest wait meant for callers coming back."""
    monkeypatch.setattr(batcher_module, "REGROUP_WAIT", 0.2)
    monkeypatch.setattr(batcher_module, "REGROUP_GAP", 30.0)
    monkeypatch.setattr(batcher_module, "REGROUP_LIMIT", 30.0)
    rounds = _Rounds(8)
    answers = rounds.play(clock, [0.0])
    assert answers["b0"] == ("b0", True)
    assert rounds.batches[2:] == [["b0"]]


def test_an_interrupted_caller_leaves_the_queue_and_passes_the_lead_on(clock: Clock) -> None:
    """A leader interrupted while it regroups (a KeyboardInterrupt raised in its wait)
    leaves the queue and passes the lead on: the next call is answered. (Before, the
    lead stayed with the interrupted caller, and every later call hung.)"""

    def run(requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        return [(r.sandbox_id, True) for r in requests]

    batcher = PlacementBatcher(run)
    original = batcher._regroup
    calls = [0]

    def interrupted() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        original()

    batcher._regroup = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        batcher.schedule(schedule_request("s0", clock()))
    assert not batcher._queue
    done: list[Any] = []
    thread = threading.Thread(
        target=lambda: done.append(batcher.schedule(schedule_request("s1", clock()))),
        daemon=True,
    )
    thread.start()
    thread.join(10)
    assert done == [("s1", True)]


def test_once_joined_a_leader_waits_for_the_pause_not_the_first_wait(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a batch of 8, two callers come back at once and a third 0.5 s later: the
    leader, joined, waits on for the pause after the latest arrival (1.5 s), not for the
    first wait meant for a leader still alone (0.2 s), so the three go in one batch."""
    monkeypatch.setattr(batcher_module, "REGROUP_WAIT", 0.2)
    monkeypatch.setattr(batcher_module, "REGROUP_GAP", 1.5)
    monkeypatch.setattr(batcher_module, "REGROUP_LIMIT", 10.0)
    rounds = _Rounds(8)
    answers = rounds.play(clock, [0.0, 0.0, 0.5])
    assert len(answers) == 11
    assert sorted(rounds.batches[2]) == ["b0", "b1", "b2"]
    assert len(rounds.batches) == 3


def test_the_batch_size_setting_bounds_every_batch(clock: Clock) -> None:
    """SECONDBOX_BATCH_SIZE=2: five callers queued behind a running batch are taken two
    at a time."""
    batches: list[list[str]] = []
    first = threading.Event()

    def run(requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        batches.append([r.sandbox_id for r in requests])
        if requests[0].sandbox_id == "opener":
            assert first.wait(10)
        return [(r.sandbox_id, True) for r in requests]

    batcher = batcher_from_settings({BATCH_SIZE: "2"}, run)
    assert batcher is not None
    opener = threading.Thread(
        target=lambda: batcher.schedule(schedule_request("opener", clock())), daemon=True
    )
    opener.start()
    deadline = time.monotonic() + 20
    while not batches and time.monotonic() < deadline:
        time.sleep(0.001)
    callers = [
        threading.Thread(
            target=lambda n=n: batcher.schedule(schedule_request(f"c{n}", clock())), daemon=True
        )
        for n in range(5)
    ]
    for thread in callers:
        thread.start()
    while len(batcher._queue) < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    first.set()
    for thread in [opener, *callers]:
        thread.join(10)
        assert not thread.is_alive()
    assert [len(batch) for batch in batches] == [1, 2, 2, 1]


def test_an_interrupted_waiting_caller_leaves_the_lead_where_it_is(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller interrupted while it waits behind a running batch (not leading) only
    leaves the queue: the batch's leader keeps the lead, so a later call waits for that
    batch instead of running a second batch beside it."""
    running = threading.Event()
    release = threading.Event()
    later_waits = threading.Event()
    active = [0]
    overlapped = threading.Event()
    guard = threading.Lock()

    def run(requests: Sequence[ScheduleRequest], *_: Sequence[Any]) -> list[Any]:
        with guard:
            active[0] += 1
            if active[0] > 1:
                overlapped.set()
        try:
            if requests[0].sandbox_id == "s0":
                running.set()
                assert release.wait(10)
            return [(r.sandbox_id, True) for r in requests]
        finally:
            with guard:
                active[0] -= 1

    original_wait = batcher_module._Signal.wait

    def wait(signal: Any) -> None:
        name = threading.current_thread().name
        if name == "interrupted":
            raise KeyboardInterrupt
        if name == "later":
            later_waits.set()
        original_wait(signal)

    monkeypatch.setattr(batcher_module._Signal, "wait", wait)
    batcher = PlacementBatcher(run)
    answers: dict[str, Any] = {}
    interrupted: list[BaseException] = []

    def call(sandbox_id: str) -> None:
        try:
            answers[sandbox_id] = batcher.schedule(schedule_request(sandbox_id, clock()))
        except KeyboardInterrupt as error:
            interrupted.append(error)

    leader = threading.Thread(target=call, args=("s0",), daemon=True)
    leader.start()
    assert running.wait(10)
    waiting = threading.Thread(target=call, args=("s1",), name="interrupted", daemon=True)
    waiting.start()
    waiting.join(10)
    assert len(interrupted) == 1
    assert not batcher._queue
    later = threading.Thread(target=call, args=("s2",), name="later", daemon=True)
    later.start()
    deadline = time.monotonic() + 10
    while not (later_waits.is_set() or overlapped.is_set()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert later_waits.is_set()  # queued behind s0's batch
    assert not overlapped.is_set()
    release.set()
    for thread in (leader, later):
        thread.join(10)
        assert not thread.is_alive()
    assert answers == {"s0": ("s0", True), "s2": ("s2", True)}
    assert not overlapped.is_set()


def test_a_batch_answered_with_too_few_outcomes_fails_every_caller_of_it(clock: Clock) -> None:
    """A ``run`` that breaks its contract (one answer missing) fails the batch's callers
    with an error that says so, and the batcher goes on."""
    answers: list[list[Any]] = [[], [("s1", True)]]
    batcher = PlacementBatcher(lambda requests, *_: answers.pop(0))
    with pytest.raises(RuntimeError, match="0 answers to a batch of 1"):
        batcher.schedule(schedule_request("s0", clock()))
    answer: Any = batcher.schedule(schedule_request("s1", clock()))
    assert answer == ("s1", True)


def test_a_batch_leaves_its_committed_runners_in_the_cache(
    app: SchedulerApplication, clock: Clock
) -> None:
    """The next batch on a runner reads only what others wrote since, not this
    batch's own events back: the cached runner is the committed state."""
    build(app, clock)
    outcomes = app.schedule_many([schedule_request(s, clock()) for s in ("s0", "s1", "s2")])
    assert all(not isinstance(o, SchedulerError) and o[1] for o in outcomes)
    for runner_id in ("ra", "rb"):
        cached = _cached(app, runner_uuid(runner_id))
        assert cached is not None
        stored = app.stream_versions([runner_uuid(runner_id)])[runner_uuid(runner_id)]
        assert cached.version == stored
    # and a later command never changes the cached instance in place
    before = _cached(app, runner_uuid("ra")).version
    app.schedule_many([schedule_request("s3", clock())])
    assert _cached(app, runner_uuid("ra")).version >= before


def test_placing_many_sandboxes_keeps_no_parsed_requirements_alive(
    tmp_path: Path, clock: Clock
) -> None:
    """A batch reads its sandboxes afresh; their parsed requirements must not outlive
    them (10,000 kept alive were most of what each young garbage collection walked)."""
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path}/many.db"}, now=clock
    )
    try:
        room = {"vcpu_count": 2000, "memory_bytes": 4000 * 2**30, "disk_bytes": 30000 * 2**30}
        register(
            app, "roomy", at=clock(),
            allocatable=capacity(instances=1000, operations=4000, **room),
        )  # fmt: skip
        names = [f"m{n}" for n in range(600)]
        for name in names:
            create_sandbox(app, name)
        gc.collect()
        before = sum(1 for o in gc.get_objects() if isinstance(o, Requirements))
        for start in range(0, len(names), 50):
            batch = [schedule_request(n, clock()) for n in names[start : start + 50]]
            assert all(not isinstance(o, SchedulerError) for o in app.schedule_many(batch))
        gc.collect()
        after = sum(1 for o in gc.get_objects() if isinstance(o, Requirements))
        assert after - before <= 300  # bounded, not one per placement
    finally:
        app.close()


def _chained_env(schema: PostgresSchema, keyed: bool) -> dict[str, str]:
    """A keyed chain links in the client; an unkeyed one in the server."""
    return {**schema.env(), **({AUDIT_KEY: "a test audit key"} if keyed else {})}


def _recorder(app: SchedulerApplication) -> ChainedPostgresRecorder:
    recorder = app.recorder
    assert isinstance(recorder, ChainedPostgresRecorder)
    return recorder


# the three ways a save with snapshots is made on PostgreSQL
SERVER_SEALS = "links and seals in the server"  # <events>_append_with_snapshots
CLIENT_SEALS = "links in the server, seals in the client"  # that function absent
CLIENT_LINKS = "links and seals in the client"  # a keyed chain (stored by <events>_link)


@pytest.mark.parametrize("path", [SERVER_SEALS, CLIENT_SEALS, CLIENT_LINKS])
def test_snapshots_are_written_in_the_transaction_of_their_events(
    postgres_schema: PostgresSchema, clock: Clock, path: str
) -> None:
    """PostgreSQL: the snapshots a batch takes (a runner passing a multiple of its
    interval) are sealed with the links of the same transaction and committed with the
    events, one commit for both: a snapshot that cannot be written leaves nothing
    stored, not placements without their snapshot and an error after the commit. Each
    way of linking and sealing (the server refuses the seals' insert with a trigger)."""
    app = SchedulerApplication(env=_chained_env(postgres_schema, path == CLIENT_LINKS), now=clock)
    try:
        assert app.snapshots is not None
        sealed = app.snapshots.recorder
        assert isinstance(sealed, SealedPostgresSnapshots)
        assert _recorder(app).appends_in_server()  # a keyed chain: <events>_insert and _link
        if path == CLIENT_SEALS:
            sealed._appends_in_server = False
        room = {"vcpu_count": 128, "memory_bytes": 256 * 2**30, "disk_bytes": 2000 * 2**30}
        register(app, "ra", at=clock(), allocatable=capacity(instances=64, operations=64, **room))
        names = [f"s{n}" for n in range(12)]
        for name in names:
            create_sandbox(app, name)
        version = app.stream_versions([runner_uuid("ra")])[runner_uuid("ra")]
        assert version < 10 <= version + len(names)  # the batch passes the interval

        seals = f'"{postgres_schema.name}"."{seal_table(sealed.events_table_name)}"'
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            conn.execute(
                f'CREATE FUNCTION "{postgres_schema.name}".refuse() RETURNS trigger '
                "LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'snapshot not written'; END$$"
            )
            conn.execute(
                f"CREATE TRIGGER refuse BEFORE INSERT ON {seals} FOR EACH STATEMENT "
                f'EXECUTE FUNCTION "{postgres_schema.name}".refuse()'
            )
        with pytest.raises(PersistenceError, match="snapshot not written"):
            app.schedule_many([schedule_request(n, clock()) for n in names])
        assert app.stream_versions([runner_uuid("ra")])[runner_uuid("ra")] == version
        assert app.get_runner("ra").reserved.instances == 0
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            conn.execute(f"DROP TRIGGER refuse ON {seals}")
        outcomes = app.schedule_many([schedule_request(n, clock()) for n in names])
        assert all(not isinstance(o, SchedulerError) and o[1] for o in outcomes)
        assert sealed.appends_in_server() is (path == SERVER_SEALS)
        snapshot = sealed.select_events(runner_uuid("ra"), desc=True, limit=1)  # seal checked
        stored = app.stream_versions([runner_uuid("ra")])[runner_uuid("ra")]
        assert [s.originator_version for s in snapshot] == [stored]  # taken at the batch's end
        assert verify(app, measure_raw=False).ok  # its seal checks against the chain
    finally:
        app.close()


PROOF = {"stopped": "yes"}


def _used_by_generation_1(app: SchedulerApplication, clock: Clock, sandbox_id: str) -> bytes:
    """A token the sandbox's generation 1 was placed with; the sandbox is at 2 now."""
    used = token()
    app.schedule(schedule_request(sandbox_id, clock(), fencing_token=used))
    app.release(sandbox_id, 1, used, PROOF)
    app.advance_generation(sandbox_id, 1)
    return used


def test_a_reused_token_dropped_from_a_batch_leaves_no_reservation_in_the_cached_runner(
    store: Store, clock: Clock
) -> None:
    """Found by review: a request whose token an earlier generation used is dropped
    from the save (refused, not retried); the runner it reserved on was not treated as
    holding unsaved state, so it was cached (and could be snapshotted) with the dropped
    request's reservation and one version more than the store."""
    app: SchedulerApplication = store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    create_sandbox(app, "s2")
    used = _used_by_generation_1(app, clock, "s2")

    outcomes = app.schedule_many([
        schedule_request("s1", clock(), fencing_token=token()),
        schedule_request("s2", clock(), fencing_token=used),
    ])  # fmt: skip
    assert isinstance(outcomes[0], tuple)
    assert outcomes[0][1]
    assert isinstance(outcomes[1], InvalidRequestError)

    cached = app.load(runner_uuid("r1"), Runner)
    stored = store.open().load(runner_uuid("r1"), Runner)  # another replica: no cache
    assert cached is not None
    assert stored is not None
    assert cached.version == stored.version
    assert cached.holds("s2", 2) == stored.holds("s2", 2) is False


def test_a_placement_after_a_reused_token_keeps_the_runner_stream_readable(
    store: Store, clock: Clock
) -> None:
    """The consequence (review): the next placement on the runner was decided on that
    cached copy and saved its event past a gap: a replica without the cache could no
    longer read the runner."""
    app: SchedulerApplication = store.open()
    register(app, "r1", at=clock())
    for sandbox in ("s1", "s2", "s3"):
        create_sandbox(app, sandbox)
    used = _used_by_generation_1(app, clock, "s2")
    app.schedule_many([
        schedule_request("s1", clock(), fencing_token=token()),
        schedule_request("s2", clock(), fencing_token=used),
    ])  # fmt: skip
    outcome = app.schedule_many([schedule_request("s3", clock(), fencing_token=token())])[0]
    assert isinstance(outcome, tuple)
    assert outcome[1]

    other = store.open()
    runner = other.load(runner_uuid("r1"), Runner)  # must not raise
    assert runner is not None
    assert runner.holds("s1", 1)
    assert runner.holds("s3", 1)
    assert not runner.holds("s2", 2)


def test_a_refused_request_with_a_reused_token_is_answered_as_invalid(
    store: Store, clock: Clock
) -> None:
    """A request the placement rules refuse (its runner full) whose token an earlier
    generation used is invalid whatever the runner's state: its answer is the token's
    refusal, and no placement refusal is recorded for it; the other refusal of the same
    batch is answered and recorded as one. (The tokens are read once for the batch,
    after the runners' locks.)"""
    app: SchedulerApplication = store.open()
    register(app, "r1", at=clock(), allocatable=capacity(instances=1))
    for sandbox in ("s1", "s2", "s3"):
        create_sandbox(app, sandbox)
    used = _used_by_generation_1(app, clock, "s2")
    app.schedule(schedule_request("s1", clock()))  # the runner is full
    reused, full = app.schedule_many([
        schedule_request("s2", clock(), fencing_token=used),
        schedule_request("s3", clock(), fencing_token=token()),
    ])  # fmt: skip
    assert isinstance(reused, InvalidRequestError)
    assert reused.field == "fencing_token"
    assert isinstance(full, PlacementError)
    assert app.load(refusal_log_uuid("s2"), RefusalLog) is None
    assert app.load(refusal_log_uuid("s3"), RefusalLog) is not None


def test_the_refusals_of_a_batch_are_recorded_together_once(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several refusals in one batch (a full runner): each sandbox's log records its
    refusal (one read and one save for all), a first refusal opens the log, and the
    same refusal again, in the next batch, is not recorded twice and saves nothing."""
    app: SchedulerApplication = store.open()
    register(app, "r1", at=clock(), allocatable=capacity(instances=1))
    names = ["s0", "s1", "s2", "s3"]
    for name in names:
        create_sandbox(app, name)
    app.schedule(schedule_request("s0", clock()))  # the runner is full
    refused = [schedule_request(name, clock()) for name in names[1:]]
    assert all(isinstance(o, PlacementError) for o in app.schedule_many(refused))
    assert app.metrics.refusals_recorded == 3
    versions = app.stream_versions([refusal_log_uuid(name) for name in names[1:]])
    assert sorted(versions.values()) == [2, 2, 2]  # opened, refused
    saves: list[int] = []
    insert_events = app.recorder.insert_events

    def counted(stored: Any, **kwargs: Any) -> Any:
        saves.append(len(stored))
        return insert_events(stored, **kwargs)

    monkeypatch.setattr(app.recorder, "insert_events", counted)
    assert all(isinstance(o, PlacementError) for o in app.schedule_many(refused))
    assert app.metrics.refusals_recorded == 3
    assert app.stream_versions(list(versions)) == versions
    assert saves == []  # found by review: an empty save took the events table's lock


def _failing(links: Any) -> Any:
    def failing(*_: Any) -> list[Any]:
        raise RuntimeError("links not computed")

    return failing


def _unadaptable(links: Any) -> Any:
    def unadaptable(*args: Any) -> list[Any]:  # a digest psycopg cannot send
        return [Link(k.position, k.previous, object()) for k in links(*args)]  # type: ignore[arg-type]

    return unadaptable


@pytest.mark.parametrize(
    ("breaking", "error"), [(_failing, RuntimeError), (_unadaptable, ProgrammingError)]
)
def test_an_error_between_the_insert_and_the_commit_stores_nothing(
    postgres_schema: PostgresSchema,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    breaking: Any,
    error: type[Exception],
) -> None:
    """Found with the snapshot test above: an error of ours between the insert and the
    commit (computing the links) was caught to be raised after the pipeline closed, as
    the library does with the database's errors, and the transaction committed the
    events without their links. The first fix spared psycopg's errors, taking them all
    for the database's; review found psycopg raises some before sending anything (a
    value it cannot adapt; the library wraps it in its ProgrammingError), and those
    still committed. Any error there now rolls back. (A keyed chain: the client links,
    between ``<events>_insert`` and ``<events>_link``. An unkeyed one links in the
    server, where the step between the insert and the commit is the snapshots' write:
    the test above.)"""
    app = SchedulerApplication(env=_chained_env(postgres_schema, keyed=True), now=clock)
    try:
        assert _recorder(app).appends_in_server()
        assert _recorder(app).chain.keyed
        build(app, clock)
        runners = [runner_uuid("ra"), runner_uuid("rb")]
        versions = app.stream_versions(runners)
        chain = app.recorder.chain  # type: ignore[attr-defined]
        monkeypatch.setattr(chain, "links", breaking(chain.links))
        with pytest.raises(error):
            app.schedule_many([schedule_request("s0", clock()), schedule_request("s1", clock())])
        monkeypatch.undo()
        assert app.stream_versions(runners) == versions
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def first_leader_waits_for(monkeypatch: pytest.MonkeyPatch, calls: int) -> threading.Event:
    """Replace the batcher's wall-clock window by a count: the first leader waits until
    ``calls`` requests are queued (60 s is only a guard against a hang: the last arrival
    ends the wait), later leaders take what is queued at once. The event is set once the
    first leader is regrouping, so the test starts the next caller then, not after a
    sleep that a loaded machine could outlast."""
    leading = threading.Event()

    def regroup(previous: int, size: int, wait: float) -> tuple[int, float, float, float]:
        if leading.is_set():
            return 1, 0.0, 0.0, 0.0
        leading.set()
        return calls, 60.0, 60.0, 60.0

    monkeypatch.setattr(batcher_module, "regroup", regroup)
    return leading


def test_a_leader_wakes_only_the_callers_its_own_batch_answered(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """Found by review: a leader's last loop woke every slot of its batch it found
    answered, a deferred one too, which the next leader had answered and woken
    meanwhile; a wake-up is a bare lock, and two threads setting it at once could
    release it twice (an error to one caller, the rest of its batch never woken). Here
    the first leader is held in its last loop until the next one has woken the
    deferred caller: it must not wake that caller again."""
    made: list[Any] = []
    woken = threading.Event()
    sets: list[tuple[str, int]] = []

    class Recording(batcher_module._Signal):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

        def set(self) -> None:
            who, index = threading.current_thread().name, made.index(self)
            sets.append((who, index))
            if (who, index) == ("a", 0):  # the first leader waking its own caller
                assert woken.wait(10)
            super().set()
            if (who, index) == ("b", 1):  # the next leader woke the deferred caller
                woken.set()

    monkeypatch.setattr(batcher_module, "_Signal", Recording)

    def run(
        requests: Sequence[ScheduleRequest], deferrable: Sequence[bool], _: Sequence[Any]
    ) -> list[Any]:
        names = [r.sandbox_id for r in requests]
        if names == ["a", "b"]:
            return [("a", True), None]  # b's runner was busy: deferred
        return [(name, True) for name in names]

    leading = first_leader_waits_for(monkeypatch, 2)  # a waits for b: one batch of both
    batcher = PlacementBatcher(run, size=2)
    answers: dict[str, Any] = {}
    threads = {
        name: threading.Thread(
            target=lambda n=name: answers.update(
                {n: batcher.schedule(schedule_request(n, clock()))}
            ),
            name=name,
            daemon=True,
        )
        for name in ("a", "b")
    }
    threads["a"].start()
    assert leading.wait(10)  # a leads and waits for b
    threads["b"].start()
    deadline = time.monotonic() + 20
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive()
    assert answers == {"a": ("a", True), "b": ("b", True)}
    assert sets.count(("a", 1)) == 1  # a passed b the lead, and woke it no more


def test_an_interrupted_caller_whose_request_is_deferred_is_not_queued_again(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """Found by review (older than the review's change): a caller interrupted while its
    request was in a batch being run left nothing to undo; the batch then deferred it,
    the dead call went back to the head of the queue and was handed the lead, which
    nobody took: every later call waited for ever."""

    class Interrupted(BaseException):
        pass

    in_run, gone = threading.Event(), threading.Event()

    class Interruptible(batcher_module._Signal):
        def wait(self) -> None:
            if threading.current_thread().name == "b":
                assert in_run.wait(10)
                raise Interrupted  # as a KeyboardInterrupt in a waiting caller would
            super().wait()

    monkeypatch.setattr(batcher_module, "_Signal", Interruptible)

    def run(
        requests: Sequence[ScheduleRequest], deferrable: Sequence[bool], _: Sequence[Any]
    ) -> list[Any]:
        names = [r.sandbox_id for r in requests]
        if names == ["a", "b"]:
            in_run.set()
            assert gone.wait(10)  # b's caller left before its batch answered
            return [("a", True), None]  # and its runner was busy: deferred
        return [(name, True) for name in names]

    leading = first_leader_waits_for(monkeypatch, 2)  # a waits for b: one batch of both
    batcher = PlacementBatcher(run, size=2)
    answers: dict[str, Any] = {}

    def call(name: str) -> None:
        try:
            answers[name] = batcher.schedule(schedule_request(name, clock()))
        except Interrupted:
            answers[name] = "interrupted"
            gone.set()

    first = [threading.Thread(target=call, args=(n,), name=n, daemon=True) for n in "ab"]
    first[0].start()
    assert leading.wait(10)  # a leads and waits for b
    first[1].start()
    for thread in first:
        thread.join(20)
        assert not thread.is_alive()
    later = threading.Thread(target=call, args=("c",), name="c", daemon=True)
    later.start()
    later.join(20)
    assert not later.is_alive(), "a later call waited for the interrupted one's lead"
    assert answers == {"a": ("a", True), "b": "interrupted", "c": ("c", True)}
