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


def race(
    store: Store, clock: Clock, *, threads: int, per_thread: int, slots: int
) -> tuple[Counter[str], SchedulerApplication]:
    """``threads`` replicas schedule sandboxes all homed on r1, which has ``slots``."""
    setup = store.open()
    roomy = capacity(
        vcpu_count=1000, memory_bytes=2**50, disk_bytes=2**50, instances=slots, operations=1000
    )
    register(setup, "r1", at=clock(), allocatable=roomy)
    sandboxes = [f"s{i}" for i in range(threads * per_thread)]
    for sandbox_id in sandboxes:
        assert create_sandbox(setup, sandbox_id) == "r1"
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    replicas = [store.open() for _ in range(threads)]
    start = threading.Barrier(threads, timeout=60)

    def worker(index: int) -> None:
        replica = replicas[index]
        start.wait()
        for sandbox_id in sandboxes[index::threads]:
            try:
                _, created = replica.schedule(
                    schedule_request(sandbox_id, clock(), serialization_retry_limit=50)
                )
                outcome = "placed" if created else "replayed"
            except HomeRunnerUnavailableError:
                outcome = "refused"
            except SerializationContentionError:
                outcome = "contention"
            with lock:
                outcomes[outcome] += 1

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return outcomes, setup


def assert_never_oversubscribed(app: SchedulerApplication, placed: int, slots: int) -> None:
    runner = app.get_runner("r1")
    for dim, reserved in runner.reserved.as_dict().items():
        assert reserved <= runner.allocatable.as_dict()[dim], dim
    per_assignment = requirements().capacity
    assert runner.reserved.instances == placed * per_assignment.instances
    assert runner.reserved.vcpu_count == placed * per_assignment.vcpu_count
    assert len(app.runner_assignments("r1")) == placed
    assert placed <= slots


def test_threads_racing_on_one_runner_never_oversubscribe(store: Store, clock: Clock) -> None:
    outcomes, app = race(store, clock, threads=4, per_thread=6, slots=4)
    assert outcomes["placed"] + outcomes["refused"] + outcomes["contention"] == 24
    assert_never_oversubscribed(app, outcomes["placed"], slots=4)
    assert outcomes["placed"] == 4 or outcomes["contention"] > 0


@pytest.mark.slow
def test_eight_threads_times_200_schedules_on_postgres(postgres_schema: Any, clock: Clock) -> None:
    """The issue's acceptance run: 1,600 schedules racing for 100 slots on one runner."""
    store = Store("postgres", postgres_schema.env(), clock)
    try:
        outcomes, app = race(store, clock, threads=8, per_thread=200, slots=100)
        assert sum(outcomes.values()) == 1600
        assert_never_oversubscribed(app, outcomes["placed"], slots=100)
        assert outcomes["placed"] == 100 or outcomes["contention"] > 0
    finally:
        store.close()
