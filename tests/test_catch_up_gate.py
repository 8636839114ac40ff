"""The catch-up gate (``projections/catch_up_gate.py``): a replica that finds another's
catch-up under way waits for it and then reads only what it left; the gate is never
required (a wait that runs out, or no gate at all, catches up as before)."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator
from typing import Any

import psycopg
import pytest

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.projections import catch_up_gate
from secondbox_scheduler.testing import run_history
from tests.conftest import Clock, Store
from tests.test_projections import folded, projected, read_models_of


def replicas(store: Store, clock: Clock) -> tuple[SchedulerApplication, list[SchedulerApplication]]:
    writer = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "off"}, now=clock)
    store.opened.append(writer)
    run_history(
        writer, clock, [("create", 0, b) for b in range(4)] + [("schedule", 0, b) for b in range(4)]
    )
    external = {**store.env, "SECONDBOX_READ_MODELS": "external"}
    apps = [SchedulerApplication(env=external), SchedulerApplication(env=external)]
    store.opened += apps
    return writer, apps


def pages_read(app: SchedulerApplication) -> list[tuple[int, int]]:
    """The (after, end) of every page read by ``app``'s catch-ups from now on."""
    read_models = read_models_of(app)
    original = read_models._pages
    seen: list[tuple[int, int]] = []

    def counted(
        after: int, end: int, page_size: int = 1000, names: Collection[str] | None = None
    ) -> Iterator[Any]:
        for events, reached in original(after, end, page_size, names):
            seen.append((after, reached))
            yield events, reached

    read_models._pages = counted  # type: ignore[method-assign]
    return seen


def holder(store: Store, app: SchedulerApplication) -> psycopg.Connection[Any]:
    """A session of its own holding ``app``'s gate (another replica's catch-up)."""
    gate = read_models_of(app)._gate
    assert gate.recorder is not None
    stored = gate.recorder.datastore.pool.kwargs
    assert isinstance(stored, dict)
    kwargs = {k: v for k, v in stored.items() if k != "row_factory"}
    connection = psycopg.connect(**{**kwargs, "autocommit": True})
    connection.execute("SELECT pg_advisory_lock(%s)", (gate.key,))
    return connection


def waiting_for(connection: psycopg.Connection[Any], key: int) -> bool:
    row = connection.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid::text::bigint = %s AND objid::text::bigint = %s AND objsubid = 1",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
    ).fetchone()
    return row is not None and row[0] > 0


@pytest.mark.parametrize("store", ["postgres"], indirect=True)  # the gate is PostgreSQL's
def test_a_replica_waits_for_the_catch_up_under_way_and_reads_only_what_it_left(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catch_up_gate, "GATE_WAIT_MS", 60_000)  # waits for as long as it takes
    writer, (first, second) = replicas(store, clock)
    head = writer.head_position()
    connection = holder(store, first)
    try:
        ahead, behind = read_models_of(first), read_models_of(second)
        behind_pages = pages_read(second)
        waiter = threading.Thread(target=behind.catch_up)
        waiter.start()
        deadline = time.monotonic() + 30
        while not waiting_for(connection, behind._gate.key):
            assert time.monotonic() < deadline, "the second replica never waited"
            time.sleep(0.01)
        monkeypatch.setattr(ahead._gate, "held", lambda needed=True: _no_gate())
        ahead.catch_up()  # the catch-up under way, which the holder's session stands for
        assert ahead.position("runner_snapshots") == head
    finally:
        connection.execute("SELECT pg_advisory_unlock_all()")
        connection.close()
    waiter.join(30)
    assert not waiter.is_alive()
    assert behind_pages == []  # the positions read again: nothing left to read
    assert {behind.position(name) for name in behind.views} == {head}
    assert projected(second) == folded(writer)


def test_a_gate_held_too_long_is_not_waited_for(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait runs out: the catch-up goes on without the gate, as before (and on
    SQLite there is no gate)."""
    monkeypatch.setattr(catch_up_gate, "GATE_WAIT_MS", 50)
    writer, (_, second) = replicas(store, clock)
    connection = holder(store, second) if store.kind == "postgres" else None
    try:
        read_models_of(second).catch_up()
    finally:
        if connection is not None:
            connection.close()
    head = writer.head_position()
    assert {read_models_of(second).position(name) for name in read_models_of(second).views} == {
        head
    }
    assert projected(second) == folded(writer)


@pytest.mark.parametrize("store", ["postgres"], indirect=True)  # the gate is PostgreSQL's
def test_the_gate_is_released_after_each_catch_up(store: Store, clock: Clock) -> None:
    writer, (first, second) = replicas(store, clock)
    read_models_of(first).catch_up()
    run_history(writer, clock, [("create", 1, b) for b in range(2)])
    started = time.monotonic()
    read_models_of(second).catch_up()  # not held by the first's finished catch-up
    read_models_of(first).catch_up()
    assert time.monotonic() - started < catch_up_gate.GATE_WAIT_MS / 1000 * 20
    assert projected(first) == projected(second) == folded(writer)


class _NoGate:
    def __enter__(self) -> bool:
        return False

    def __exit__(self, *exc: object) -> None:
        return None


def _no_gate() -> _NoGate:
    return _NoGate()
