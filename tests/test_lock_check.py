"""A batch reads its runners before the locks; the locking step finds what changed.

(infrastructure/placing/runner_locks.py, infrastructure/placing/batch.py) A batch reads
its home runners and leases before it takes their locks, so the locks cover the
decision and the commit only; the statement that takes the locks is followed, in the
same round trip, by a check of the streams read, and the batch reads again those a
rival moved meanwhile. So a rival's commit between the read and the locks costs no
lost race: the batch decides against it, as a serial execution would.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from secondbox_scheduler.domain import SchedulerError, SerializationContentionError
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.placing import runner_locks
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.runner_locks import lock_key
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, schedule_request


def _rival_between_read_and_locks(
    schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, SchedulerApplication]:
    """Replica A's batch reads the hot runner; replica B places on it and commits; then
    A takes the lock, decides and saves (retry budget 0). A's answer, and A."""
    a = SchedulerApplication(env=schema.env(), now=clock)
    b = SchedulerApplication(env=schema.env(), now=clock)
    try:
        room = {"vcpu_count": 32, "memory_bytes": 64 * 2**30, "disk_bytes": 400 * 2**30}
        register(a, "hot", at=clock(), allocatable=capacity(instances=16, operations=64, **room))
        create_sandbox(a, "s1")
        create_sandbox(a, "s2")
        b.get_runner("hot")  # B has read it too (cached), as a replica would have
        read = PlacementBatch._runners

        def read_then_rival(batch: PlacementBatch, runner_ids: set[str]) -> Any:
            monkeypatch.setattr(PlacementBatch, "_runners", read)  # once
            found = read(batch, runner_ids)
            placed = b.schedule(schedule_request("s2", clock()))
            assert isinstance(placed, tuple)
            assert placed[1]
            return found

        monkeypatch.setattr(PlacementBatch, "_runners", read_then_rival)
        try:
            mine: Any = PlacementBatch(a).run(
                [schedule_request("s1", clock(), serialization_retry_limit=0)]
            )[0]
        except SchedulerError as error:
            mine = error
        return mine, a
    finally:
        b.close()


def test_a_rival_commit_between_the_read_and_the_locks_is_read_again(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, a = _rival_between_read_and_locks(postgres_schema, clock, monkeypatch)
    try:
        assert isinstance(mine, tuple), mine
        assert mine[1], mine
        assert a.get_runner("hot").reserved.instances == 2
        assert a.metrics.contention_retries == a.metrics.contention_errors == 0
        assert verify(a, measure_raw=False).ok
    finally:
        a.close()


def test_a_runner_found_changed_is_read_after_its_locks_by_the_next_batches(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hot runner changes under nearly every read made before its lock: once the
    locking step found it changed, the next LATE_BATCHES batches on it read it after
    the lock only (no read before, nothing to check), then read it early again."""
    mine, a = _rival_between_read_and_locks(postgres_schema, clock, monkeypatch)
    try:
        assert isinstance(mine, tuple), mine
        checked: list[list[Any]] = []
        hold = runner_locks.RunnerLocks.hold

        def recording(locks: Any, runner_ids: Any, **options: Any) -> Any:
            checked.append(list(options.get("check", ())))
            return hold(locks, runner_ids, **options)

        monkeypatch.setattr(runner_locks.RunnerLocks, "hold", recording)
        for number in range(runner_locks.LATE_BATCHES + 1):
            create_sandbox(a, f"late{number}")
            placed: Any = PlacementBatch(a).run([schedule_request(f"late{number}", clock())])[0]
            assert isinstance(placed, tuple), placed
            assert placed[1], placed
        assert checked[: runner_locks.LATE_BATCHES] == [[]] * runner_locks.LATE_BATCHES
        assert {stream for stream, _ in checked[-1]} == {runner_uuid("hot"), lease_uuid("hot")}
        assert a.get_runner("hot").reserved.instances == 2 + runner_locks.LATE_BATCHES + 1
        assert a.metrics.contention_retries == 0
        assert verify(a, measure_raw=False).ok
    finally:
        a.close()


def test_without_the_check_the_same_interleaving_is_a_lost_race(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check broken on purpose (it never finds a change): the batch decides on
    the runner as it read it, and its save loses to B's commit."""
    monkeypatch.setattr(runner_locks, "CHECK", runner_locks.CHECK + " WHERE false")
    mine, a = _rival_between_read_and_locks(postgres_schema, clock, monkeypatch)
    try:
        assert isinstance(mine, SerializationContentionError), mine
        assert a.get_runner("hot").reserved.instances == 1
    finally:
        a.close()


def test_the_locking_step_reports_the_streams_moved_past_the_versions_read(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting, trying, and trying then waiting whole: the changed streams come back
    with the locks; a step that failed reports None (read everything again)."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "r1", at=clock())
        register(app, "r2", at=clock())
        version = app.load_many([runner_uuid("r1")])[runner_uuid("r1")].version
        current = [(runner_uuid("r1"), version), (runner_uuid("r2"), 1)]
        behind = [(runner_uuid("r1"), version - 1), (lease_uuid("r2"), 0)]
        absent = [(runner_uuid("r3"), 0)]
        locks = app.runner_locks
        with locks.hold(["r1", "r2"], check=current + absent) as held:
            assert held.locked
            assert held.changed == frozenset()
        with locks.hold(["r1", "r2"], check=current + behind) as held:
            assert held.locked
            assert held.changed == frozenset({runner_uuid("r1"), lease_uuid("r2")})
        with locks.hold(["r1", "r2"], wait_for=[], check=behind) as held:  # tried
            assert held.locked
            assert held.busy == frozenset()
            assert held.changed == frozenset({runner_uuid("r1"), lease_uuid("r2")})
        with locks.hold(["r1", "r2"]) as held:  # nothing to check
            assert held.locked
            assert held.changed == frozenset()
        monkeypatch.setattr(runner_locks, "LOCK_WAIT_MS", 50)
        key = lock_key(locks.namespace, "r2")
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as rival:
            rival.execute("SELECT pg_advisory_lock(%s)", (key,))
            with locks.hold(["r1", "r2"], wait_for=["r1"], check=behind) as held:  # deferred
                assert held.locked
                assert held.busy == {"r2"}
                assert held.changed == frozenset({runner_uuid("r1"), lease_uuid("r2")})
            with locks.hold(["r1", "r2"], check=current) as held:  # not granted
                assert held.locked is False
                assert held.changed is None
            # tried, most of the batch busy: released and waited whole (not granted)
            with locks.hold(
                ["r1", "r2"], wait_for=[], worth_deferring=lambda busy: False, check=current
            ) as held:
                assert held.locked is False
                assert held.changed is None
            rival.execute("SELECT pg_advisory_unlock_all()")
            with locks.hold(
                ["r1", "r2"], wait_for=[], worth_deferring=lambda busy: False, check=behind
            ) as held:
                assert held.locked
                assert held.changed == frozenset({runner_uuid("r1"), lease_uuid("r2")})
    finally:
        app.close()


def test_a_failed_locking_step_reads_every_runner_again(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No lock held after the locking step (here: not granted in time): the batch goes
    on without the locks, on runners read again after the wait, and places."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "hot", at=clock(), allocatable=capacity(instances=4))
        create_sandbox(app, "s1")
        monkeypatch.setattr(runner_locks, "LOCK_WAIT_MS", 50)
        reads: list[set[str]] = []
        read = PlacementBatch._runners

        def counted(batch: PlacementBatch, runner_ids: set[str]) -> Any:
            reads.append(set(runner_ids))
            return read(batch, runner_ids)

        monkeypatch.setattr(PlacementBatch, "_runners", counted)
        key = lock_key(app.runner_locks.namespace, "hot")
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as rival:
            rival.execute("SELECT pg_advisory_lock(%s)", (key,))
            outcome = PlacementBatch(app).run([schedule_request("s1", clock())])[0]
        assert isinstance(outcome, tuple)
        assert outcome[1]
        assert reads == [{"hot"}, {"hot"}]
    finally:
        app.close()
