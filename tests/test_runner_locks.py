"""Replicas whose batches meet on a runner take turns (infrastructure/placing/runner_locks.py).

The interleaving that used to cost a placement a lost race: replica A has read the hot
runner and decided, replica B places on the same runner before A commits, A's save fails
on the runner's version and A must decide again (with a retry budget of 0: a contention
error while the runner has room). With the runner's advisory lock, B waits for A's
commit and decides against it: both are placed, neither retries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from secondbox_scheduler.domain import SchedulerError, SerializationContentionError
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.placing import runner_locks
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.runner_locks import lock_key
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, schedule_request

WAIT = 60.0  # seconds: only a hang would reach it


def _advisory_waiters(schema: PostgresSchema, app: SchedulerApplication, runner_id: str) -> int:
    """Sessions of this database waiting for the runner's lock of ``app``'s store."""
    unsigned = lock_key(app.runner_locks.namespace, runner_id) & (2**64 - 1)
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid = %s AND objid = %s AND objsubid = 1",
            (unsigned >> 32, unsigned & (2**32 - 1)),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _until_waiting(schema: PostgresSchema, app: SchedulerApplication, thread: Any) -> None:
    """Until ``thread`` has finished or waits for the hot runner's lock of ``app``."""
    deadline = time.monotonic() + WAIT
    while thread.is_alive() and not _advisory_waiters(schema, app, "hot"):
        assert time.monotonic() < deadline, "neither finished nor waited for the lock"
        time.sleep(0.01)


@dataclass
class Race:
    mine: Any  # A's answer
    theirs: Any  # B's answer
    reserved: int  # instances reserved on the hot runner at the end
    retries: int  # A's lost races retried, and past the budget
    errors: int
    audit_ok: bool


def _race(
    schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch, locks: str
) -> Race:
    """A decides; B places on the same runner before A's save; then A saves."""
    env = {**schema.env(), "SECONDBOX_RUNNER_LOCKS": locks}
    a, b = (SchedulerApplication(env=dict(env), now=clock) for _ in range(2))
    try:
        register(a, "hot", at=clock(), allocatable=capacity(instances=4))
        create_sandbox(a, "s1")
        create_sandbox(a, "s2")
        rival: dict[str, Any] = {}

        def place_b() -> None:
            try:
                rival["outcome"] = b.schedule(
                    schedule_request("s2", clock(), serialization_retry_limit=0)
                )
            except SchedulerError as error:
                rival["outcome"] = error

        thread = threading.Thread(target=place_b)
        save = a.save_in_order

        def b_first(events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None:
            monkeypatch.setattr(a, "save_in_order", save)  # once
            thread.start()
            _until_waiting(schema, a, thread)
            save(events, aggregates)

        monkeypatch.setattr(a, "save_in_order", b_first)
        try:
            mine: Any = a.schedule(schedule_request("s1", clock(), serialization_retry_limit=0))
        except SchedulerError as error:
            mine = error
        thread.join(WAIT)
        return Race(
            mine,
            rival["outcome"],
            a.get_runner("hot").reserved.instances,
            a.metrics.contention_retries,
            a.metrics.contention_errors,
            verify(a, measure_raw=False).ok,
        )
    finally:
        a.close()
        b.close()


def test_a_rival_replica_waits_for_the_runner_and_decides_after_the_commit(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    race = _race(postgres_schema, clock, monkeypatch, "on")
    assert isinstance(race.mine, tuple), race
    assert race.mine[1]
    assert isinstance(race.theirs, tuple), race
    assert race.theirs[1]
    assert race.reserved == 2
    assert race.retries == race.errors == 0
    assert race.audit_ok


def test_without_the_locks_the_same_interleaving_is_a_lost_race(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    race = _race(postgres_schema, clock, monkeypatch, "off")
    assert isinstance(race.theirs, tuple), race
    assert race.theirs[1]
    assert isinstance(race.mine, SerializationContentionError), race
    assert race.reserved == 1


def test_two_batches_of_one_process_never_starve_its_connection_pool(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch holding runner locks needs a store connection to load and save; the locks
    live on connections of their own, so a rival batch of the same process waiting for
    them holds none of the store's (a pool of 2: with the locks on a store connection,
    each held one and waited for another until the pool gave up)."""
    env = {
        **postgres_schema.env(),
        "POSTGRES_POOL_SIZE": "2",
        "POSTGRES_MAX_OVERFLOW": "0",
        "SECONDBOX_BATCHING": "off",
        "SECONDBOX_READ_MODELS": "off",
    }
    app = SchedulerApplication(env=env, now=clock)
    try:
        register(app, "hot", at=clock(), allocatable=capacity(instances=4))
        create_sandbox(app, "s1")
        create_sandbox(app, "s2")
        outcomes: dict[str, Any] = {}

        def place(sandbox_id: str) -> None:
            try:
                outcomes[sandbox_id] = app.schedule(schedule_request(sandbox_id, clock()))
            except SchedulerError as error:
                outcomes[sandbox_id] = error

        rival = threading.Thread(target=place, args=("s2",))
        decide = PlacementBatch._decide

        def first_waits_for_the_rival(self: PlacementBatch, *args: Any) -> Any:
            if not rival.is_alive() and "s2" not in outcomes:
                rival.start()
                _until_waiting(postgres_schema, app, rival)
            return decide(self, *args)

        monkeypatch.setattr(PlacementBatch, "_decide", first_waits_for_the_rival)
        place("s1")
        rival.join(WAIT)
        assert isinstance(outcomes["s1"], tuple), outcomes
        assert isinstance(outcomes["s2"], tuple), outcomes
        assert app.get_runner("hot").reserved.instances == 2
    finally:
        app.close()


def test_a_lock_not_granted_in_time_leaves_none_of_the_batch_held(
    postgres_schema: PostgresSchema, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The locks are taken in key order; when one is refused after LOCK_WAIT_MS, those
    taken before it are released before the batch goes on without them."""
    app = SchedulerApplication(env=postgres_schema.env())
    try:
        locks = app.runner_locks
        first, last = sorted(("r-a", "r-b"), key=lambda r: lock_key(locks.namespace, r))
        monkeypatch.setattr(runner_locks, "LOCK_WAIT_MS", 50)
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as rival:
            rival.execute("SELECT pg_advisory_lock(%s)", (lock_key(locks.namespace, last),))
            with locks.hold([first, last]) as held:
                assert held.locked is False
                row = rival.execute(
                    "SELECT pg_try_advisory_lock(%s)", (lock_key(locks.namespace, first),)
                ).fetchone()
                assert row == (True,)  # the batch's session kept nothing
            rival.execute("SELECT pg_advisory_unlock_all()")
        with locks.hold([first, last]) as held:  # and the locks work again
            assert held.locked is True
    finally:
        app.close()


def test_lock_keys_differ_by_store_and_runner() -> None:
    keys = {lock_key(ns, r) for ns in ("a.events", "b.events") for r in ("r1", "r2")}
    assert len(keys) == 4
    assert all(-(2**63) <= key < 2**63 for key in keys)


def test_a_batch_defers_only_the_requests_whose_runner_a_rival_holds(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """A batch tries its runners' locks without waiting: the requests on a runner
    another replica's batch holds come back deferred (None), the others are placed at
    once; the deferred ones, decided next with the lock waited for, are placed too.
    (Deferred only when they are a quarter of the batch at most: the next test.)"""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "r-1", at=clock(), allocatable=capacity(instances=8))
        homes = {"s1": create_sandbox(app, "s1")}
        register(app, "r-2", at=clock(), allocatable=capacity(instances=64))
        homes |= {s: create_sandbox(app, s) for s in ("s2", "s3", "s4", "s5")}
        busy = homes["s1"]
        assert set(homes.values()) == {"r-1", "r-2"}
        requests = [schedule_request(s, clock()) for s in homes]
        key = lock_key(app.runner_locks.namespace, busy)
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as rival:
            rival.execute("SELECT pg_advisory_lock(%s)", (key,))
            first = PlacementBatch(app).run_deferring(requests, [True] * len(requests))
            assert [o is None for o in first] == [homes[s] == busy for s in homes]
            assert all(isinstance(o, tuple) and o[1] for o in first if o is not None)
            assert app.get_runner(busy).reserved.instances == 0
            rival.execute("SELECT pg_advisory_unlock_all()")
        later = [r for r, o in zip(requests, first, strict=True) if o is None]
        second = PlacementBatch(app).run_deferring(later, [False] * len(later))
        assert all(isinstance(o, tuple) and o[1] for o in second)
        for runner_id in ("r-1", "r-2"):
            placed = sum(1 for home in homes.values() if home == runner_id)
            assert app.get_runner(runner_id).reserved.instances == placed
        assert app.metrics.placements_deferred == len(later)
        assert app.metrics.contention_retries == 0
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def _waits_for_hot(
    schema: PostgresSchema, app: SchedulerApplication, requests: Any, deferrable: list[bool]
) -> list[Any]:
    """Run the batch while a rival session holds the hot runner's lock: it must wait
    for it (not defer), and finish once the rival lets go; its outcomes."""
    answer: dict[str, Any] = {}
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as rival:
        rival.execute("SELECT pg_advisory_lock(%s)", (lock_key(app.runner_locks.namespace, "hot"),))
        thread = threading.Thread(
            target=lambda: answer.update(
                outcomes=PlacementBatch(app).run_deferring(requests, deferrable)
            )
        )
        thread.start()
        _until_waiting(schema, app, thread)
        assert thread.is_alive()  # waiting for the lock, not deferring
        rival.execute("SELECT pg_advisory_unlock_all()")
        thread.join(WAIT)
    outcomes: list[Any] = answer["outcomes"]
    return outcomes


def test_a_request_deferred_once_waits_for_its_runner(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """Deferred once, a request is not deferrable in its next batch (the batcher's
    side: tests/test_batching.py): that batch waits for its runner's lock, held here
    until the rival lets go, so no request is put off for ever."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "hot", at=clock(), allocatable=capacity(instances=4))
        create_sandbox(app, "s1")
        register(app, "roomy", at=clock(), allocatable=capacity(instances=64))
        for sandbox_id in ("s2", "s3", "s4", "s5"):
            assert create_sandbox(app, sandbox_id) == "roomy"
        requests = [schedule_request(s, clock()) for s in ("s1", "s2", "s3", "s4", "s5")]
        outcomes = _waits_for_hot(postgres_schema, app, requests, [False, True, True, True, True])
        assert [o[1] for o in outcomes] == [True] * 5
        assert app.metrics.placements_deferred == 0
        assert app.get_runner("hot").reserved.instances == 1
    finally:
        app.close()


def test_a_batch_mostly_on_busy_runners_waits_for_them_whole(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """Hot runners that every batch needs: deferring most of a batch would commit a
    few placements per transaction, so the batch waits for all its locks instead."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "hot", at=clock(), allocatable=capacity(instances=8))
        for sandbox_id in ("s1", "s2"):
            create_sandbox(app, sandbox_id)
        requests = [schedule_request(s, clock()) for s in ("s1", "s2")]
        outcomes = _waits_for_hot(postgres_schema, app, requests, [True, True])
        assert [o[1] for o in outcomes] == [True, True]
        assert app.metrics.placements_deferred == 0
        assert app.get_runner("hot").reserved.instances == 2
    finally:
        app.close()


def test_a_lock_session_broken_before_the_fallback_is_not_an_error_of_the_batch(
    postgres_schema: PostgresSchema,
) -> None:
    """Found by review: a lock session lost between the try and the release before
    waiting whole (most of the batch busy) failed the batch, every caller of the
    batcher hearing the error; a broken session means going on without the locks."""
    app = SchedulerApplication(env=postgres_schema.env())
    try:
        locks = app.runner_locks
        keys = {r: lock_key(locks.namespace, r) for r in ("a", "b")}
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as rival:
            rival.execute("SELECT pg_advisory_lock(%s)", (keys["b"],))
            me = rival.info.backend_pid

            def session_lost_then_no(busy: frozenset[str]) -> bool:
                # the lock session dies (network, failover, pg_terminate_backend) here
                unsigned = keys["a"] & (2**64 - 1)  # only this test's lock session
                rival.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = "
                    "'advisory' AND granted AND pid <> %s AND classid = %s AND objid = %s "
                    "AND objsubid = 1",
                    (me, unsigned >> 32, unsigned & (2**32 - 1)),
                )
                return False  # most of the batch busy: release and wait whole

            with locks.hold(keys, wait_for=[], worth_deferring=session_lost_then_no) as held:
                assert held.locked is False  # goes on without the locks
    finally:
        app.close()
