"""No stall on PostgreSQL (findings of a red team): a session that holds the events
table's lock (``<events>_lock()`` or an uncommitted INSERT) and idles bounds every
writer by the write lock timeout (then a typed contention error), not by the hold; the
roles that ``db grant`` sets up lose an idle transaction after a timeout; the start-up
lock held by another session times out with an error naming the holder; a seal or a
snapshot planted ahead at a stream's next snapshot version never fails a save."""

from __future__ import annotations

import select
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from secondbox_scheduler.domain.errors import SerializationContentionError
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.store.roles import grant
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError
from secondbox_scheduler.infrastructure.store.write_timeouts import WriteTimeoutError
from tests.conftest import Clock, PostgresSchema
from tests.factories import (
    RUNTIME,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
)

pytestmark = pytest.mark.postgres

EVENTS = "schedulerapplication_events"
HOLD_BOUND_SECONDS = 15  # only ends a test that stalls; never a measure of success


@dataclass
class Roles:
    owner: str
    app: str
    auditor: str


def _url(schema: PostgresSchema, role: str) -> str:
    server = schema.server
    return f"postgresql://{role}@{server.host}:{server.port}/{server.dbname}?schema={schema.name}"


def _app_env(schema: PostgresSchema, roles: Roles, **settings: str) -> dict[str, str]:
    """The request-serving role's settings: it writes no read model (docs/operations.md:
    the projector role keeps them), so its queries fold the aggregates."""
    return {
        "SECONDBOX_DATABASE_URL": _url(schema, roles.app),
        "SECONDBOX_READ_MODELS": "off",
        **settings,
    }


def _connect(
    schema: PostgresSchema, role: str, application_name: str = ""
) -> psycopg.Connection[tuple[object, ...]]:
    server = schema.server
    return psycopg.connect(
        make_conninfo(
            host=server.host,
            port=server.port,
            user=role,
            dbname=server.dbname,
            application_name=application_name or None,
        ),
        autocommit=True,
    )


@pytest.fixture
def roles(postgres_schema: PostgresSchema) -> Iterator[Roles]:
    suffix = uuid.uuid4().hex[:8]
    made = Roles(f"sbx_owner_{suffix}", f"sbx_app_{suffix}", f"sbx_audit_{suffix}")
    conninfo = postgres_schema.server.conninfo()
    with psycopg.connect(conninfo, autocommit=True) as admin:
        for role in (made.owner, made.app, made.auditor):
            admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'ALTER SCHEMA "{postgres_schema.name}" OWNER TO "{made.owner}"')
    try:
        yield made
    finally:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{postgres_schema.name}" CASCADE')
            admin.execute(f'CREATE SCHEMA "{postgres_schema.name}"')  # the fixture drops it
            for role in (made.app, made.auditor, made.owner):
                admin.execute(f'DROP OWNED BY "{role}"')
                admin.execute(f'DROP ROLE "{role}"')


def _granted(schema: PostgresSchema, roles: Roles, **options: Any) -> None:
    SchedulerApplication(env={"SECONDBOX_DATABASE_URL": _url(schema, roles.owner)}).close()
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as admin:
        grant(admin, schema.name, roles.owner, roles.app, roles.auditor, **options)


def _while_held(
    hold: psycopg.Connection[tuple[object, ...]],
    write: Callable[[], Any],
    release: Callable[[], Any] | None = None,
) -> tuple[bool, Any]:
    """Run ``write`` in a thread while ``hold``'s transaction (or ``release``'s lock)
    stays; end the hold once the write returned (or after the bound, so that a stalled
    write ends). Returns
    whether the write returned while the hold was still open, and what it returned or
    raised."""
    outcome: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(write())
        except BaseException as error:  # the answer under test
            outcome.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    returned_while_held = done.wait(HOLD_BOUND_SECONDS)
    (release or hold.rollback)()
    thread.join()
    return returned_while_held, outcome[0]


def _heartbeat(app: SchedulerApplication, clock: Clock) -> str:
    return app.record_heartbeat(
        runner_id="r1",
        at=clock(),
        artifact_digests=[RUNTIME],
        materializations=[materialization("x86_64")],
    )


@pytest.mark.parametrize("held_by", ["lock function", "uncommitted insert"])
def test_a_writer_waits_at_most_the_lock_timeout_for_a_session_that_holds_the_lock(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock, held_by: str
) -> None:
    _granted(postgres_schema, roles)
    env = _app_env(postgres_schema, roles, SECONDBOX_WRITE_LOCK_TIMEOUT_MS="100")
    app = SchedulerApplication(env=env, now=clock)
    try:
        register(app, "r1", at=clock())
        create_sandbox(app, "s1")
        # held by a role that may write the table (the owner, an operator's session): the
        # application role may take neither (tests/test_red_team.py, the insider phase)
        with _connect(postgres_schema, roles.owner) as hold:
            hold.autocommit = False
            events = f'"{postgres_schema.name}".{EVENTS}'
            if held_by == "lock function":
                hold.execute(f"SELECT {events}_lock()")
            else:
                hold.execute(
                    f"INSERT INTO {events} (originator_id, originator_version, topic, state) "
                    "VALUES (gen_random_uuid(), 1, 'planted', '')"
                )
            request = schedule_request("s1", clock(), serialization_retry_limit=1)
            while_held, outcomes = _while_held(hold, lambda: app.schedule_many([request]))
            assert while_held, "the placement waited for the whole hold"
            assert isinstance(outcomes[0], SerializationContentionError), outcomes
            hold.execute(f"SELECT {events}_lock()")
            clock.advance(seconds=30)  # past the lease renewal interval: a heartbeat writes
            while_held, answer = _while_held(hold, lambda: _heartbeat(app, clock))
            assert while_held, "the heartbeat waited for the whole hold"
            assert isinstance(answer, SerializationContentionError), answer
        # the hold over, the same requests go through
        request = schedule_request("s1", clock(), serialization_retry_limit=1)
        assert isinstance(app.schedule_many([request])[0], tuple)
        assert _heartbeat(app, clock) != "unchanged"
    finally:
        app.close()


def test_db_grant_sets_an_idle_in_transaction_timeout_for_the_application_and_audit_roles(
    postgres_schema: PostgresSchema, roles: Roles
) -> None:
    _granted(postgres_schema, roles, idle_in_transaction_timeout=1)
    for role in (roles.app, roles.auditor):
        with _connect(postgres_schema, role) as connection:
            row = connection.execute("SHOW idle_in_transaction_session_timeout").fetchone()
            assert row == ("1s",), role
    # a session of the application role that opens a transaction and idles loses it
    with _connect(postgres_schema, roles.app) as hold:
        hold.autocommit = False
        hold.execute(f'SELECT count(*) FROM "{postgres_schema.name}".{EVENTS}')
        # the server ends the session: its socket turns readable (the error, then EOF)
        readable, _, _ = select.select([hold.fileno()], [], [], HOLD_BOUND_SECONDS)
        assert readable, "the idle transaction was never ended"
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            hold.execute("SELECT 1")  # the next statement hears why


def test_a_start_up_lock_held_elsewhere_times_out_naming_its_holder(
    postgres_schema: PostgresSchema, roles: Roles
) -> None:
    _granted(postgres_schema, roles)
    key = zlib.crc32(f"secondbox-scheduler schema {postgres_schema.name}".encode())
    env = _app_env(postgres_schema, roles, SECONDBOX_STARTUP_LOCK_TIMEOUT_MS="200")
    with _connect(postgres_schema, roles.auditor, "nosy-auditor") as hold:
        hold.execute("SELECT pg_advisory_lock(%s)", (key,))
        pid = hold.info.backend_pid
        while_held, answer = _while_held(
            hold,
            lambda: SchedulerApplication(env=env).close(),
            lambda: hold.execute("SELECT pg_advisory_unlock_all()"),
        )
    assert while_held, "the start waited for the whole hold"
    assert isinstance(answer, StoreUnavailableError), answer
    assert answer.reason == "schema-locked"
    assert f"pid {pid}" in str(answer)
    assert "nosy-auditor" in str(answer)
    SchedulerApplication(env=env).close()  # the lock free, it starts


@pytest.mark.parametrize("planted", ["seal", "snapshot"])
def test_a_row_planted_at_the_next_snapshot_version_never_fails_a_save(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock, planted: str
) -> None:
    _granted(postgres_schema, roles)
    app = SchedulerApplication(env=_app_env(postgres_schema, roles), now=clock)
    snapshots = f'"{postgres_schema.name}".schedulerapplication_snapshots'
    try:
        room = {"vcpu_count": 128, "memory_bytes": 256 * 2**30, "disk_bytes": 2000 * 2**30}
        register(app, "r1", at=clock(), allocatable=capacity(instances=64, operations=64, **room))
        stream, lease = runner_uuid("r1"), lease_uuid("r1")
        versions = app.stream_versions([stream, lease])
        # at every version ahead (a snapshot is taken at the last version of a save
        # that passes a multiple of the interval: where depends on the batches)
        ahead = range(versions[stream] + 1, versions[stream] + 40)
        lease_ahead = range(versions[lease] + 1, versions[lease] + 30)
        plants = [(stream, v) for v in ahead] + [(lease, v) for v in lease_ahead]
        # planted by a role that may write the tables (the application role may not)
        with _connect(postgres_schema, roles.owner) as attacker:
            for stream_id, at in plants:
                if planted == "seal":
                    attacker.execute(
                        f"INSERT INTO {snapshots}_seal VALUES (%s, %s, %s)",
                        (stream_id, at, b"\x00" * 32),
                    )
                else:
                    attacker.execute(
                        f"INSERT INTO {snapshots} (originator_id, originator_version, topic, "
                        "state) VALUES (%s, %s, 'planted', '')",
                        (stream_id, at),
                    )
        for _ in range(25):  # heartbeats across the planted version of the lease
            clock.advance(seconds=30)
            _heartbeat(app, clock)
        assert app.stream_versions([lease])[lease] > versions[lease] + 20
        names = [f"s{n}" for n in range(30)]
        for name in names:
            create_sandbox(app, name)
        for group in (names[:10], names[10:20], names[20:]):  # placements across the others
            outcomes = app.schedule_many(
                [schedule_request(n, clock(), serialization_retry_limit=2) for n in group]
            )
            assert all(isinstance(o, tuple) for o in outcomes), outcomes
        assert app.stream_versions([stream])[stream] > versions[stream] + 20
        assert app.fold_runner("r1").reserved.instances == 30
    finally:
        app.close()
    again = SchedulerApplication(env=_app_env(postgres_schema, roles), now=clock)
    try:  # a fresh replica refuses the planted rows and loads the runner from its events
        assert again.get_runner("r1").reserved.instances == 30
    finally:
        again.close()


def test_a_write_timeout_is_contention_not_an_existing_runner_or_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that gave up waiting for a lock stored nothing: registering the runner or
    creating the sandbox is refused as contention (retryable), never as "already
    registered" (the registration was not made) or a crash."""
    clock = Clock()
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'timeouts.db'}"}, now=clock
    )
    try:
        register(app, "r1", at=clock())

        def timed_out(*_: Any, **__: Any) -> Any:
            raise WriteTimeoutError("lock timeout")

        monkeypatch.setattr(app, "save", timed_out)
        with pytest.raises(SerializationContentionError):
            register(app, "r2", at=clock())
        with pytest.raises(SerializationContentionError):
            create_sandbox(app, "s1")
    finally:
        app.close()
