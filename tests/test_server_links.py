"""PostgreSQL links an unkeyed chain in the server (``<events>_append``): the same links
the client makes, the same all-or-nothing save, and the client's way back when the
schema has no such function (infrastructure/event_chain.py); a batch's save on the
session that holds its runner locks releases them with its commit
(infrastructure/lent_connection.py)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from eventsourcing.persistence import IntegrityError, StoredEvent
from psycopg.pq import TransactionStatus

from secondbox_scheduler.domain.chain import Chain, ChainedEvent
from secondbox_scheduler.infrastructure import SchedulerApplication, runner_locks
from secondbox_scheduler.infrastructure.audit_replay import verify
from secondbox_scheduler.infrastructure.event_chain import (
    ChainedPostgresRecorder,
    append_function,
    chain_head,
    select_links,
)
from secondbox_scheduler.infrastructure.lent_connection import Lent, lend
from secondbox_scheduler.infrastructure.placement_batch import PlacementBatch
from tests.conftest import Clock, PostgresSchema
from tests.factories import create_sandbox, register, schedule_request


def _recorder(app: SchedulerApplication) -> ChainedPostgresRecorder:
    recorder = app.recorder
    assert isinstance(recorder, ChainedPostgresRecorder)
    return recorder


def _relinked(recorder: ChainedPostgresRecorder) -> None:
    """Every stored link equals the one the client's Chain computes from the events."""
    events = recorder.select_notifications(start=1, limit=1_000_000)
    links = select_links(recorder, 0, None)
    expected = Chain().links(
        None,
        [
            ChainedEvent(e.id, e.originator_id, e.originator_version, e.topic, e.state)
            for e in events
        ],
    )
    assert links == expected


def _event(topic: str, state: bytes, version: int = 1) -> StoredEvent:
    return StoredEvent(uuid.uuid4(), version, topic, state)


def test_the_server_makes_the_links_the_client_would(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """From the genesis on, over the application's own events and over odd ones: a
    topic outside ASCII, an empty state, a state of every byte value, a large one."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder = _recorder(app)
        assert recorder.appends_in_server()
        assert chain_head(recorder) is None
        register(app, "r1", at=clock())
        create_sandbox(app, "s1")
        app.schedule(schedule_request("s1", clock()))
        assert verify(app, measure_raw=False).ok
        odd = [
            _event("tøpic:Ünïcode", b"{}"),
            _event("topic:empty", b""),
            _event("topic:bytes", bytes(range(256)) * 3),
            _event("topic:large", b"x" * 300_000),
        ]
        positions = recorder.insert_events(odd)
        assert positions is not None
        assert len(positions) == len(odd)
        assert positions == sorted(positions)
        _relinked(recorder)  # (not the audit: these are no events of the domain)
    finally:
        app.close()


def test_a_save_refused_by_the_server_stores_nothing(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """A version already stored fails the whole save: no event, no link of it."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder = _recorder(app)
        first = _event("topic:a", b"1")
        recorder.insert_events([first])
        head = chain_head(recorder)
        with pytest.raises(IntegrityError):
            recorder.insert_events([_event("topic:b", b"2"), first])
        assert chain_head(recorder) == head
        assert len(recorder.select_notifications(start=1, limit=10)) == 1
        _relinked(recorder)
    finally:
        app.close()


def test_a_schema_without_the_function_links_in_the_client(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """A schema an earlier release created, under a role that may not create the
    function: the client links, and the history reads as one chain."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder = _recorder(app)
        register(app, "r1", at=clock())  # linked in the server
        assert recorder.appends_in_server()
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            conn.execute(
                f'DROP FUNCTION "{postgres_schema.name}".'
                f'"{append_function(recorder.events_table_name)}"'
            )
        recorder._appends_in_server = None  # a new process looks again
        create_sandbox(app, "s1")
        app.schedule(schedule_request("s1", clock()))
        assert recorder._appends_in_server is False
        _relinked(recorder)
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def _advisory_locks(schema: PostgresSchema, pid: int) -> int:
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_lent_session_commits_then_runs_what_follows_and_a_refused_save_runs_nothing(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """The save on a session lent by a batch that holds runner locks: a refused save
    keeps the locks (nothing after the failed append runs, the transaction is rolled
    back, the session is usable); a saved one commits and then releases them."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    released: list[bool] = []
    try:
        recorder = _recorder(app)
        first = _event("topic:a", b"1")
        recorder.insert_events([first])
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as session:
            session.execute("SELECT pg_advisory_lock(42)")
            pid = session.info.backend_pid
            lent = Lent(
                recorder.datastore,
                session,
                b"SELECT pg_advisory_unlock_all()",
                lambda: released.append(True),
            )
            with lend(lent):
                with pytest.raises(IntegrityError):
                    recorder.insert_events([_event("topic:b", b"2"), first])
                assert _advisory_locks(postgres_schema, pid) == 1
                assert released == []
                assert session.info.transaction_status == TransactionStatus.IDLE
                positions = recorder.insert_events([_event("topic:c", b"3")])
            assert _advisory_locks(postgres_schema, pid) == 0
            assert released == [True]
            assert lent.used
        assert positions is not None
        assert len(recorder.select_notifications(start=1, limit=10)) == 2
        _relinked(recorder)
    finally:
        app.close()


def test_a_batch_releases_its_runner_locks_with_its_commit(
    postgres_schema: PostgresSchema, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No separate unlock after a batch's save: the save's round trip released them."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    unlocks: list[bytes] = []
    execute = psycopg.Connection.execute

    def spied(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == runner_locks.UNLOCK:
            unlocks.append(query)
        return execute(self, query, *args, **kwargs)

    try:
        register(app, "r1", at=clock())
        for sandbox_id in ("s1", "s2"):
            create_sandbox(app, sandbox_id)
        monkeypatch.setattr(psycopg.Connection, "execute", spied)
        outcomes = PlacementBatch(app).run([schedule_request(s, clock()) for s in ("s1", "s2")])
        monkeypatch.undo()
        assert all(isinstance(o, tuple) and o[1] for o in outcomes)
        assert unlocks == []
        assert app.get_runner("r1").reserved.instances == 2
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()
