"""Optimistic concurrency: forced conflicts, full-jitter retry, racing replicas."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain import (
    Capacity,
    HomeRunnerUnavailableError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.retrying import backoff_ceiling
from tests.conftest import Clock, Store
from tests.factories import capacity, create_sandbox, register, requirements, schedule_request


class Interfering:
    """Makes the next ``times`` placement saves of ``app`` lose a race against ``rival``.

    Just before each save, the rival replica changes the same runner, so the save's
    expected stream version is taken and the recorder raises IntegrityError.
    """

    def __init__(self, app: SchedulerApplication, rival: SchedulerApplication, times: int) -> None:
        self.app, self.rival, self.left = app, rival, times
        self.real_save = app.save_in_order
        self.allocatable = [capacity(instances=i) for i in range(10, 10 + times)]

    def __call__(self, *objs: Any, **kwargs: Any) -> Any:
        if self.left:
            self.left -= 1
            self.rival.change_allocatable("r1", self.allocatable[self.left])
        return self.real_save(*objs, **kwargs)


def test_a_lost_race_is_retried_with_full_jitter(store: Store, clock: Clock) -> None:
    delays: list[float] = []
    app, rival = store.open(sleep=delays.append), store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.save_in_order = Interfering(app, rival, times=3)  # type: ignore[method-assign]
    assignment, created = app.schedule(schedule_request("s1", clock(), serialization_retry_limit=3))
    assert created
    assert app.metrics.contention_retries == 3
    assert len(delays) == 3
    for retry, delay in enumerate(delays):
        assert 0.0 <= delay <= backoff_ceiling(retry)
    assert rival.get_runner("r1").reserved == assignment.capacity


def test_backoff_ceiling_doubles_from_2ms_to_a_250ms_cap() -> None:
    assert [backoff_ceiling(n) for n in range(9)] == [
        0.002,
        0.004,
        0.008,
        0.016,
        0.032,
        0.064,
        0.128,
        0.25,
        0.25,
    ]


@pytest.mark.parametrize("retry", [10, 64, 1024, 10**6])
def test_backoff_ceiling_is_defined_for_every_attempt(retry: int) -> None:
    assert backoff_ceiling(retry) == 0.25  # the exponent is capped (at 10, as the original)


def test_a_schedule_that_keeps_losing_races_ends_in_contention_not_overflow(
    tmp_path: Path, clock: Clock
) -> None:
    """On SQLite only: 1,100 lost rounds, each of which reads the store again."""
    delays: list[float] = []
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 's.db'}"},
        now=clock,
        sleep=delays.append,
    )
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")

    def always_lose(*_: Any, **__: Any) -> None:
        raise IntegrityError("a rival committed first")

    app.save_in_order = always_lose  # type: ignore[method-assign]
    with pytest.raises(SerializationContentionError):
        app.schedule(schedule_request("s1", clock(), serialization_retry_limit=1100))
    assert len(delays) == 1100  # retries 0..1099: past 2 ** 1024, which overflows a float
    assert max(delays) <= 0.25
    app.close()


def test_contention_past_the_limit_raises_and_writes_nothing(store: Store, clock: Clock) -> None:
    app, rival = store.open(sleep=lambda _: None), store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.save_in_order = Interfering(app, rival, times=3)  # type: ignore[method-assign]
    before = rival.event_count()
    with pytest.raises(SerializationContentionError, match="retryable") as raised:
        app.schedule(schedule_request("s1", clock(), serialization_retry_limit=2))
    assert raised.value.retryable
    assert raised.value.attempts == 3
    assert rival.event_count() == before + 3, "only the rival's three changes were written"
    assert rival.get_runner("r1").reserved == Capacity()
    assert rival.get_assignment("s1") is None
    assert len(list(rival.events.get(sandbox_uuid("s1")))) == 1


# What one default-profile assignment reserves, and allocatable that is roomy on every
# dimension: a race below makes exactly one dimension tight.
PER_ASSIGNMENT = requirements().capacity.as_dict()
ROOMY = {
    "vcpu_count": 1000, "memory_bytes": 2**50, "disk_bytes": 2**50, "instances": 1000,
    "operations": 1000,
}  # fmt: skip


def binding(dimension: str, slots: int) -> Capacity:
    """Allocatable on which only ``dimension`` binds, at ``slots`` assignments: it holds
    ``slots`` of them plus all but one unit of another (so the boundary is exact)."""
    per = PER_ASSIGNMENT[dimension]
    return Capacity(**{**ROOMY, dimension: slots * per + per - 1})


def race(
    store: Store,
    clock: Clock,
    *,
    threads: int,
    per_thread: int,
    slots: int,
    dimension: str = "instances",
) -> tuple[Counter[str], SchedulerApplication]:
    """``threads`` replicas schedule sandboxes all homed on r1, which has room for
    ``slots`` of them on ``dimension`` only (every other dimension is roomy).

    A request loses a race only to a commit on r1 or on its own sandbox; each sandbox is
    scheduled once, and r1 takes at most ``slots`` placements, so a request can lose at
    most ``slots`` times: with a retry budget above that, no request may end in
    ``SerializationContentionError``. A refusal must be for capacity on ``dimension``.
    """
    setup = store.open()
    register(setup, "r1", at=clock(), allocatable=binding(dimension, slots))
    sandboxes = [f"s{i}" for i in range(threads * per_thread)]
    for sandbox_id in sandboxes:
        assert create_sandbox(setup, sandbox_id) == "r1"
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    replicas = [store.open() for _ in range(threads)]
    start = threading.Barrier(threads, timeout=60)
    budget = slots + 1

    def worker(index: int) -> None:
        replica = replicas[index]
        start.wait()
        for sandbox_id in sandboxes[index::threads]:
            try:
                _, created = replica.schedule(
                    schedule_request(sandbox_id, clock(), serialization_retry_limit=budget)
                )
                outcome = "placed" if created else "replayed"
            except HomeRunnerUnavailableError as error:
                short = f"insufficient {dimension}" in str(error)
                outcome = "refused for capacity" if short else f"refused: {error}"
            except SerializationContentionError:
                outcome = "contention"
            with lock:
                outcomes[outcome] += 1

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return outcomes, setup


def assert_exactly_full(
    app: SchedulerApplication, outcomes: Counter[str], requested: int, slots: int
) -> None:
    """Exactly ``slots`` placed, every other request refused for capacity, none lost to
    contention (see :func:`race`), and r1 holds exactly the placed assignments: never
    more than allocatable on any dimension."""
    assert outcomes == Counter({"placed": slots, "refused for capacity": requested - slots})
    runner = app.get_runner("r1")
    reserved, allocatable = runner.reserved.as_dict(), runner.allocatable.as_dict()
    for dim, amount in reserved.items():
        assert amount == slots * PER_ASSIGNMENT[dim], dim
        assert amount <= allocatable[dim], dim
    assert len(app.runner_assignments("r1")) == slots


def test_threads_racing_on_one_runner_never_oversubscribe(store: Store, clock: Clock) -> None:
    outcomes, app = race(store, clock, threads=4, per_thread=6, slots=4)
    assert_exactly_full(app, outcomes, requested=24, slots=4)


@pytest.mark.parametrize("dimension", ["vcpu_count", "memory_bytes", "disk_bytes", "operations"])
def test_threads_racing_fill_exactly_the_one_dimension_that_binds(
    store: Store, clock: Clock, dimension: str
) -> None:
    """As above with each other dimension the only tight one (instances roomy)."""
    outcomes, app = race(store, clock, threads=3, per_thread=3, slots=3, dimension=dimension)
    assert_exactly_full(app, outcomes, requested=9, slots=3)


@pytest.mark.slow
def test_eight_threads_times_200_schedules_on_postgres(postgres_schema: Any, clock: Clock) -> None:
    """The issue's acceptance run: 1,600 schedules racing for 100 slots on one runner."""
    store = Store("postgres", postgres_schema.env(), clock)
    try:
        outcomes, app = race(store, clock, threads=8, per_thread=200, slots=100)
        assert_exactly_full(app, outcomes, requested=1600, slots=100)
    finally:
        store.close()
