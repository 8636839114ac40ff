"""Replicas whose batches meet on a runner take turns (infrastructure/runner_locks.py).

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
from typing import Any

import psycopg
import pytest

from secondbox_scheduler.domain import SchedulerError, SerializationContentionError
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit_replay import verify
from secondbox_scheduler.infrastructure.runner_locks import lock_key
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, schedule_request

WAIT = 60.0  # seconds: only a hang would reach it


def _advisory_waiters(schema: PostgresSchema) -> int:
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _race(
    schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch, locks: str
) -> tuple[Any, Any, SchedulerApplication]:
    """A decides; B places on the same runner before A's save; then A saves."""
    env = {**schema.env(), "SECONDBOX_RUNNER_LOCKS": locks}
    a, b = (SchedulerApplication(env=dict(env), now=clock) for _ in range(2))
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
        deadline = time.monotonic() + WAIT
        while thread.is_alive() and not _advisory_waiters(schema):
            assert time.monotonic() < deadline, "B neither finished nor waited for A's locks"
            time.sleep(0.01)
        save(events, aggregates)

    monkeypatch.setattr(a, "save_in_order", b_first)
    try:
        mine: Any = a.schedule(schedule_request("s1", clock(), serialization_retry_limit=0))
    except SchedulerError as error:
        mine = error
    thread.join(WAIT)
    b.close()
    return mine, rival["outcome"], a


def test_a_rival_replica_waits_for_the_runner_and_decides_after_the_commit(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, theirs, a = _race(postgres_schema, clock, monkeypatch, "on")
    try:
        assert isinstance(mine, tuple), mine
        assert mine[1]
        assert isinstance(theirs, tuple), theirs
        assert theirs[1]
        assert a.get_runner("hot").reserved.instances == 2
        assert a.metrics.contention_retries == a.metrics.contention_errors == 0
        assert verify(a, measure_raw=False).ok
    finally:
        a.close()


def test_without_the_locks_the_same_interleaving_is_a_lost_race(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, theirs, a = _race(postgres_schema, clock, monkeypatch, "off")
    try:
        assert isinstance(theirs, tuple), theirs
        assert theirs[1]
        assert isinstance(mine, SerializationContentionError), mine
        assert a.get_runner("hot").reserved.instances == 1
    finally:
        a.close()


def test_lock_keys_differ_by_store_and_runner() -> None:
    keys = {lock_key(ns, r) for ns in ("a.events", "b.events") for r in ("r1", "r2")}
    assert len(keys) == 4
    assert all(-(2**63) <= key < 2**63 for key in keys)
