"""A Runner's snapshot interval grows with its active reservations
(``infrastructure/snapshot_intervals.py``): the snapshots a busy runner stores, and a
cold load of it from the latest one, on both stores."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.snapshot_intervals import (
    RESERVATIONS_AT_BASE_INTERVAL,
    reservations_factor,
    snapshotting_interval,
)
from tests.conftest import Store

AT = datetime(2026, 1, 5, 9, tzinfo=UTC)
ONE = Capacity(vcpu_count=1, memory_bytes=1, disk_bytes=1, instances=1, operations=1)
BASE = SchedulerApplication.snapshotting_intervals[Runner]


def test_the_factor_doubles_with_each_doubling_of_the_reservations() -> None:
    edge = RESERVATIONS_AT_BASE_INTERVAL
    assert [reservations_factor(n) for n in (0, 1, edge)] == [1, 1, 1]
    assert [reservations_factor(n) for n in (edge + 1, 2 * edge)] == [2, 2]
    assert [reservations_factor(n) for n in (2 * edge + 1, 4 * edge)] == [4, 4]
    assert reservations_factor(4 * edge + 1) == 8


@given(st.integers(min_value=0, max_value=10**7), st.integers(min_value=0, max_value=10**7))
def test_every_interval_is_the_base_times_a_power_of_two_growing_with_the_reservations(
    smaller: int, larger: int
) -> None:
    """So a version at a multiple of a longer interval is one of every shorter one, and
    the snapshot work per event stays bounded: at most twice the base's reservations per
    base events."""
    smaller, larger = sorted((smaller, larger))
    factor = reservations_factor(larger)
    assert factor & (factor - 1) == 0
    assert reservations_factor(smaller) <= factor
    assert larger <= 2 * RESERVATIONS_AT_BASE_INTERVAL * factor
    if factor > 1:
        assert larger > RESERVATIONS_AT_BASE_INTERVAL * factor // 2


def test_only_a_runner_interval_moves() -> None:
    sandbox = object.__new__(Sandbox)
    assert snapshotting_interval(sandbox, 20) == 20


def _busy_runner(app: SchedulerApplication, runner_id: str, reservations: int) -> list[int]:
    """``runner_id`` registered, then ``reservations`` reservations saved 7 at a time
    (saves that pass several versions, as batches do); the versions a snapshot is due
    at: the last of each save that passes a multiple of the interval of the runner it
    leaves (version v holds v - 1 reservations: version 1 registers the runner)."""
    app.register_runner(
        runner_id=runner_id,
        pool_name="pool-a",
        backend_kind="firecracker",
        architecture="x86_64",
        capabilities=["compute"],
        allocatable=_large(),
        guest_protocol_minimum=1,
        guest_protocol_maximum=1,
    )
    made, due = 0, []
    while made < reservations:
        runner: object = app.repository.get(runner_uuid(runner_id))
        assert isinstance(runner, Runner)
        for _ in range(min(7, reservations - made)):
            key = f"sbx-{made}"
            runner.reserve(
                assignment_id=key,
                sandbox_id=key,
                generation=1,
                capacity=ONE,
                at=AT + timedelta(seconds=made),
            )
            made += 1
        app.save(runner)
        interval = BASE * reservations_factor(made)
        if any(v % interval == 0 for v in range(runner.version - 6, runner.version + 1)):
            due.append(runner.version)
    return due


def _large() -> Capacity:
    return Capacity(
        vcpu_count=10**6, memory_bytes=10**6, disk_bytes=10**6, instances=10**6, operations=10**6
    )


def test_a_busy_runner_is_snapshotted_less_often_and_loads_cold_as_its_fold(
    store: Store,
) -> None:
    """Up to 128 active reservations a save passing every 10th version stores a
    snapshot; then every 20th up to 256, every 40th up to 512, every 80th: and a new
    replica loads the runner (latest snapshot and the events after it) equal to a replay
    of the whole stream."""
    app = store.open(now=lambda: AT)
    due = _busy_runner(app, "busy", 600)
    assert app.snapshots is not None
    versions = [s.originator_version for s in app.snapshots.get(runner_uuid("busy"))]
    assert versions == due
    gaps = {later - earlier for earlier, later in itertools.pairwise(versions)}
    assert max(gaps) > 70
    assert len(versions) < 600 // BASE // 2
    cold_env = {**store.env, "AGGREGATE_CACHE_MAXSIZE": ""}
    replay_env = {**cold_env, "IS_SNAPSHOTTING_ENABLED": "n"}
    cold = SchedulerApplication(env=cold_env, now=lambda: AT)
    replay = SchedulerApplication(env=replay_env, now=lambda: AT)
    try:
        loaded: object = cold.repository.get(runner_uuid("busy"))
        folded: object = replay.repository.get(runner_uuid("busy"))
        assert isinstance(loaded, Runner)
        assert isinstance(folded, Runner)
        assert loaded.version == folded.version == 601
        assert loaded.reservations == folded.reservations
        assert loaded.reserved == folded.reserved
    finally:
        cold.close()
        replay.close()
