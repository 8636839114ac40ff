"""PostgreSQL links an unkeyed chain in the server (``<events>_append``): the same links
the client makes, the same all-or-nothing save, and the client's way back when the
schema has no such function (infrastructure/store/chained_postgres.py)."""

from __future__ import annotations

import logging
import uuid

import psycopg
import pytest
from eventsourcing.persistence import IntegrityError, ProgrammingError, StoredEvent

from secondbox_scheduler.domain.audit.chain import Chain, ChainedEvent
from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.store.chain_reads import chain_head, select_links
from secondbox_scheduler.infrastructure.store.chain_tables import seal_table
from secondbox_scheduler.infrastructure.store.chained_postgres import ChainedPostgresRecorder
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from secondbox_scheduler.infrastructure.store.server_append import (
    append_function,
    append_with_snapshots_function,
)
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, schedule_request
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


def _odd_events() -> list[StoredEvent]:
    """A topic outside ASCII, an empty state, a state of every byte value, a large one."""
    return [
        _event("tøpic:Ünïcode", b"{}"),
        _event("topic:empty", b""),
        _event("topic:bytes", bytes(range(256)) * 3),
        _event("topic:large", b"x" * 300_000),
    ]


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
        odd = _odd_events()
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


def test_a_refused_save_ends_its_transaction_before_the_connection_goes_back(
    postgres_schema: PostgresSchema, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The save's transaction is written out as statements (``_appended``): one the
    server refused is rolled back as the error leaves the pool's connection block, so
    the pool gets its connection back idle (it warns and rolls back a connection that
    comes back inside a transaction), and the next save commits."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder = _recorder(app)
        first = _event("topic:a", b"1")
        recorder.insert_events([first])
        with caplog.at_level(logging.WARNING, logger="psycopg.pool"):
            for _ in range(3):  # whichever of the pool's connections the save took
                with pytest.raises(IntegrityError):
                    recorder.insert_events([_event("topic:b", b"2"), first])
        assert not [r for r in caplog.records if "rolling back" in r.getMessage()]
        with recorder.datastore.get_connection() as conn:
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        later = _event("topic:c", b"3")
        assert recorder.insert_events([later])
        assert len(recorder.select_notifications(start=1, limit=10)) == 2
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


ROOMY = capacity(
    instances=64, operations=64, vcpu_count=128, memory_bytes=256 * 2**30, disk_bytes=2000 * 2**30
)


def _sealed(app: SchedulerApplication) -> SealedPostgresSnapshots:
    assert app.snapshots is not None
    sealed = app.snapshots.recorder
    assert isinstance(sealed, SealedPostgresSnapshots)
    return sealed


def _drop(schema: PostgresSchema, function: str) -> None:
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as conn:
        conn.execute(f'DROP FUNCTION "{schema.name}"."{function}"')


def _batch_past_the_interval(app: SchedulerApplication, clock: Clock, prefix: str) -> None:
    """Ten placements on one runner in one batch: its version passes a multiple of the
    runner's snapshot interval, so the save writes a snapshot."""
    names = [f"{prefix}{n}" for n in range(10)]
    for name in names:
        create_sandbox(app, name)
    outcomes = app.schedule_many([schedule_request(name, clock()) for name in names])
    assert all(isinstance(o, tuple) and o[1] for o in outcomes)


def test_the_server_seals_snapshots_as_the_client_would(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """``<events>_append_with_snapshots`` writes each snapshot with the seal
    ``Chain.seal`` computes from its event's new link: a batch's runner snapshot (the
    audit checks it), and odd topics and states (no events of the domain: not the
    audit); a snapshot at a version outside the save is refused with the whole save
    (found by the red team: the function is the owner's, and a snapshot at an event
    of an earlier save is how a forged one got in), and the snapshots read back through
    the seal check."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder, sealed = _recorder(app), _sealed(app)
        assert sealed.appends_in_server()
        register(app, "r1", at=clock(), allocatable=ROOMY)
        _batch_past_the_interval(app, clock, "s")
        assert len(sealed.select_events(runner_uuid("r1"))) == 1  # the batch's, checked
        assert verify(app, measure_raw=False).ok
        odd = _odd_events()
        snapshots = [
            StoredEvent(e.originator_id, e.originator_version, "snäpshot:" + e.topic, e.state)
            for e in odd
        ]
        outside = StoredEvent(uuid.uuid4(), 7, "snapshot:outside", b"{}")
        head = app.head_position()
        with pytest.raises(ProgrammingError, match="not at an event of this save"):
            recorder.insert_events(odd, snapshots=sealed.within([*snapshots, outside]))
        assert app.head_position() == head
        positions = recorder.insert_events(odd, snapshots=sealed.within(snapshots))
        assert positions is not None
        assert len(positions) == len(odd)
        _relinked(recorder)
        digests = {(k.position): k.digest for k in select_links(recorder, 0, None)}
        chain = Chain()
        with psycopg.connect(postgres_schema.server.conninfo()) as conn:
            stored = {
                (row[0], row[1]): bytes(row[2])
                for row in conn.execute(
                    f'SELECT originator_id, originator_version, seal FROM "{postgres_schema.name}"'
                    f'."{seal_table(sealed.events_table_name)}"'
                )
            }
        for snapshot, position in zip(snapshots, positions, strict=True):
            assert stored[(snapshot.originator_id, 1)] == chain.seal(
                digests[position], snapshot.originator_id, 1, snapshot.topic, snapshot.state
            )
            assert sealed.select_events(snapshot.originator_id) == [snapshot]
        assert (outside.originator_id, 7) not in stored
        assert sealed.select_events(outside.originator_id) == []  # unsealed: refused
    finally:
        app.close()


def test_a_schema_without_the_sealing_function_seals_in_the_client(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """A schema of the release before ``<events>_append_with_snapshots``: the server
    links, the client seals (two round trips), and the history verifies."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder, sealed = _recorder(app), _sealed(app)
        register(app, "r1", at=clock(), allocatable=ROOMY)
        _drop(postgres_schema, append_with_snapshots_function(recorder.events_table_name))
        sealed._appends_in_server = None  # a new process looks again
        assert not sealed.appends_in_server()
        assert recorder.appends_in_server()
        _batch_past_the_interval(app, clock, "s")
        assert len(sealed.select_events(runner_uuid("r1"))) == 1
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def test_a_sealing_function_dropped_while_running_makes_the_client_seal(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """Dropped after the lookup: the failed statement stored nothing, the save is made
    again with the seals made in the client, and so are the next ones."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        recorder, sealed = _recorder(app), _sealed(app)
        register(app, "r1", at=clock(), allocatable=ROOMY)
        assert sealed.appends_in_server()
        _drop(postgres_schema, append_with_snapshots_function(recorder.events_table_name))
        _batch_past_the_interval(app, clock, "s")
        assert sealed._appends_in_server is False
        assert recorder.appends_in_server()
        _batch_past_the_interval(app, clock, "t")
        assert len(sealed.select_events(runner_uuid("r1"))) == 2
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def _compressions(schema: PostgresSchema) -> dict[str, str]:
    with psycopg.connect(schema.server.conninfo()) as conn:
        return {
            str(row[0]): str(row[1])
            for row in conn.execute(
                "SELECT c.relname, a.attcompression FROM pg_attribute a "
                "JOIN pg_class c ON c.oid = a.attrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND a.attname = 'state' AND c.relkind = 'r' "
                "AND c.relname LIKE 'schedulerapplication_%%'",
                (schema.name,),
            )
        }


def test_event_and_snapshot_states_are_compressed_with_lz4(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """The states of the events and snapshots tables are compressed with LZ4 (pglz took
    about 2 ms of the server's time per hot runner snapshot, under the table lock). A
    schema of an earlier release (pglz) is changed at the next start, and what it
    stored with pglz still reads and verifies."""
    with psycopg.connect(postgres_schema.server.conninfo()) as conn:
        row = conn.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        ).fetchone()
    assert row is not None
    assert row[0], "this server was built without LZ4"
    tables = ["schedulerapplication_events", "schedulerapplication_snapshots"]
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        assert _compressions(postgres_schema) == dict.fromkeys(tables, "l")
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
            for table in tables:  # as an earlier release left them
                conn.execute(
                    f'ALTER TABLE "{postgres_schema.name}"."{table}" '
                    "ALTER COLUMN state SET COMPRESSION pglz"
                )
        assert _compressions(postgres_schema) == dict.fromkeys(tables, "p")
        register(app, "r1", at=clock(), allocatable=ROOMY)
        _batch_past_the_interval(app, clock, "s")  # a 3 KB AssignmentFenced each: pglz
    finally:
        app.close()
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        assert _compressions(postgres_schema) == dict.fromkeys(tables, "l")
        _batch_past_the_interval(app, clock, "t")  # LZ4 now
        with psycopg.connect(postgres_schema.server.conninfo()) as conn:
            methods = {
                str(row[0])
                for row in conn.execute(
                    f'SELECT pg_column_compression(state) FROM "{postgres_schema.name}".'
                    "schedulerapplication_events WHERE pg_column_compression(state) IS NOT NULL"
                )
            }
        assert methods == {"pglz", "lz4"}
        assert len(_sealed(app).select_events(runner_uuid("r1"))) == 2
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def test_a_table_in_use_keeps_its_compression_until_a_later_start(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """Found by review: the ``ALTER`` to LZ4 waited for a session holding the table (a
    long audit, a dump), and every save and read queued behind it meanwhile. A table
    another session holds is left as it is, and a later start changes it."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    app.close()
    events = f'"{postgres_schema.name}"."schedulerapplication_events"'
    with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {events} ALTER COLUMN state SET COMPRESSION pglz")
    with psycopg.connect(postgres_schema.server.conninfo()) as reader:
        reader.execute(f"SELECT count(*) FROM {events}")  # holds ACCESS SHARE until it ends
        app = SchedulerApplication(env=postgres_schema.env(), now=clock)
        try:
            assert _compressions(postgres_schema)["schedulerapplication_events"] == "p"
            register(app, "r1", at=clock())  # saves go on
        finally:
            app.close()
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    app.close()
    assert _compressions(postgres_schema)["schedulerapplication_events"] == "l"


def test_a_schema_name_with_dollar_quotes_opens(
    postgres_server: PostgresServer, clock: Clock
) -> None:
    """Found by review: the first version changed the compression in a ``DO $$ ... $$``
    block with the schema's name inside, and a name holding ``$$`` ended the block."""
    name = f"t_{uuid.uuid4().hex[:8]}$$x"
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    try:
        env = {**postgres_server.env(), "POSTGRES_SCHEMA": name}
        app = SchedulerApplication(env=env, now=clock)
        try:
            register(app, "r1", at=clock(), allocatable=ROOMY)
            _batch_past_the_interval(app, clock, "s")
            assert verify(app, measure_raw=False).ok
        finally:
            app.close()
    finally:
        with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')
