"""PostgreSQL links an unkeyed chain in the server (``<events>_append``): the same links
the client makes, the same all-or-nothing save, and the client's way back when the
schema has no such function (infrastructure/event_chain.py)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from eventsourcing.persistence import IntegrityError, StoredEvent

from secondbox_scheduler.domain.chain import Chain, ChainedEvent
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit_replay import verify
from secondbox_scheduler.infrastructure.event_chain import (
    ChainedPostgresRecorder,
    append_function,
    chain_head,
    select_links,
)
from tests.conftest import Clock, PostgresSchema
from tests.factories import create_sandbox, register, schedule_request
from tests.postgres_server import PostgresServer


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
        assert not recorder.appends_in_server()
        create_sandbox(app, "s1")
        app.schedule(schedule_request("s1", clock()))
        _relinked(recorder)
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def test_a_function_dropped_while_running_makes_the_client_link(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """Found by review: the lookup is made once, and a function dropped afterwards (a
    schema rolled back to an earlier release) failed every save until a restart. The
    failed statement stored nothing: the save is made again, linked in the client."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder = _recorder(app)
        register(app, "r1", at=clock())
        assert recorder.appends_in_server()
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            conn.execute(
                f'DROP FUNCTION "{postgres_schema.name}".'
                f'"{append_function(recorder.events_table_name)}"'
            )
        create_sandbox(app, "s1")
        assert app.schedule(schedule_request("s1", clock()))[1]
        assert recorder._appends_in_server is False
        _relinked(recorder)
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def test_a_database_not_in_utf8_links_in_the_client(postgres_server: PostgresServer) -> None:
    """Found by review: ``convert_to(topic, 'UTF8')`` from EUC_JP gives other bytes
    than Python's ``str.encode()`` for some characters (U+00A2, Hangul in EUC_KR): a
    server link there would fail ``audit verify`` as an edit. Outside UTF8 the client
    links."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE {name} ENCODING 'EUC_JP' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    try:
        env = {**postgres_server.env(), "POSTGRES_DBNAME": name}
        app = SchedulerApplication(env=env)
        try:
            recorder = _recorder(app)
            assert not recorder.appends_in_server()
            recorder.insert_events([_event("odd:Pr\u00a2ice", b"{}")])
            _relinked(recorder)
        finally:
            app.close()
    finally:
        with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
