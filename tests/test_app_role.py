"""The append-only application role on PostgreSQL (issue 13): the scheduler works under
a role that may only INSERT and SELECT its events, and the server itself refuses that
role's UPDATE, DELETE and TRUNCATE of the events and of their chain."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from eventsourcing.persistence import ProgrammingError
from psycopg import errors
from psycopg.conninfo import make_conninfo
from typer.testing import CliRunner

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.store.roles import grant
from secondbox_scheduler.infrastructure.store.server_append import (
    APPEND_ARGUMENTS,
    APPEND_WITH_SNAPSHOTS_ARGUMENTS,
)
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, schedule_request


@dataclass
class Roles:
    owner: str
    app: str
    auditor: str


def _url(schema: PostgresSchema, role: str) -> str:
    server = schema.server
    return f"postgresql://{role}@{server.host}:{server.port}/{server.dbname}?schema={schema.name}"


def _connect(schema: PostgresSchema, role: str) -> psycopg.Connection[tuple[object, ...]]:
    server = schema.server
    return psycopg.connect(
        make_conninfo(host=server.host, port=server.port, user=role, dbname=server.dbname),
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


def test_the_scheduler_runs_under_an_append_only_role_and_the_server_refuses_rewrites(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    # the schema owner creates the tables (as a migration would), then an administrator
    # grants the application and audit roles their privileges
    SchedulerApplication(env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.owner)}).close()
    with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
        statements = grant(admin, postgres_schema.name, roles.owner, roles.app, roles.auditor)
    assert any("GRANT SELECT, INSERT ON" in s and "_events" in s for s in statements)
    assert any("GRANT EXECUTE" in s and '_events_append"(' in s for s in statements)
    assert any("GRANT EXECUTE" in s and '_events_append_with_snapshots"(' in s for s in statements)

    # start-up under the application role: no CREATE privilege needed
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.app)}, now=clock
    )
    try:
        assert app.recorder.appends_in_server()  # type: ignore[attr-defined]
        register(app, "r1", at=clock())  # registration and a heartbeat
        assert create_sandbox(app, "s1") == "r1"
        assignment, _ = app.schedule(schedule_request("s1", clock()))
        assert app.release("s1", assignment.generation, assignment.fencing_token, {"exit": "clean"})
        for _ in range(12):  # past a snapshot interval: snapshots and seals written
            clock.advance(seconds=1)
            app.record_heartbeat(runner_id="r1", at=clock())
        assert app.fold_runner("r1").reserved.vcpu_count == 0
        # a batch past a runner's snapshot interval: saved, sealed in the server
        room = {"vcpu_count": 128, "memory_bytes": 256 * 2**30, "disk_bytes": 2000 * 2**30}
        register(app, "r2", at=clock(), allocatable=capacity(instances=64, operations=64, **room))
        names = [f"b{n}" for n in range(10)]
        for name in names:
            create_sandbox(app, name)
        assert all(isinstance(o, tuple) for o in app.schedule_many(
            [schedule_request(name, clock()) for name in names]
        ))  # fmt: skip
        assert app.snapshots is not None
        assert app.snapshots.recorder.appends_in_server()  # type: ignore[attr-defined]

        # found by review: a table the role may not write fails the server's save with
        # the same error as a forbidden function, and the server's linking and sealing
        # stayed off after the grant was mended. The save fails (nothing stored), the
        # functions are still used, and once the grant is back the saves go through them
        seals = f'"{postgres_schema.name}".schedulerapplication_snapshots_seal'
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
            admin.execute(f'REVOKE INSERT ON {seals} FROM "{roles.app}"')
        names = [f"d{n}" for n in range(10)]  # the runner passes 20: a snapshot
        for name in names:
            create_sandbox(app, name)
        with pytest.raises(ProgrammingError):
            app.schedule_many([schedule_request(name, clock()) for name in names])
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
            admin.execute(f'GRANT INSERT ON {seals} TO "{roles.app}"')
        assert all(isinstance(o, tuple) for o in app.schedule_many(
            [schedule_request(name, clock()) for name in names]
        ))  # fmt: skip
        assert app.recorder.appends_in_server()  # type: ignore[attr-defined]
        assert app.snapshots.recorder.appends_in_server()  # type: ignore[attr-defined]
    finally:
        app.close()

    # found by review: the function present but not the role's to run (a revoke, or
    # default privileges without PUBLIC): the client links instead of failing saves
    with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
        for function, arguments in (
            ("events_append", APPEND_ARGUMENTS),
            ("events_append_with_snapshots", APPEND_WITH_SNAPSHOTS_ARGUMENTS),
        ):
            admin.execute(
                f'REVOKE EXECUTE ON FUNCTION "{postgres_schema.name}".schedulerapplication_'
                f'{function}({arguments}) FROM "{roles.app}"'
            )
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.app)}, now=clock
    )
    try:
        assert not app.recorder.appends_in_server()  # type: ignore[attr-defined]
        clock.advance(seconds=1)
        app.record_heartbeat(runner_id="r1", at=clock())
        names = [f"c{n}" for n in range(10)]  # a batch with snapshots, sealed in the client
        for name in names:
            create_sandbox(app, name)
        assert all(isinstance(o, tuple) for o in app.schedule_many(
            [schedule_request(name, clock()) for name in names]
        ))  # fmt: skip
        assert not app.snapshots.recorder.appends_in_server()  # type: ignore[union-attr]
    finally:
        app.close()

    events = f'"{postgres_schema.name}".schedulerapplication_events'
    chain = f'"{postgres_schema.name}".schedulerapplication_events_chain'
    with _connect(postgres_schema, roles.app) as connection:
        for statement in (
            f"UPDATE {events} SET state = state WHERE notification_id = 1",
            f"DELETE FROM {events} WHERE notification_id = 1",
            f"TRUNCATE {events}",
            f"UPDATE {chain} SET digest = digest",
            f"DELETE FROM {chain}",
            f"LOCK TABLE {events} IN EXCLUSIVE MODE",
        ):
            with pytest.raises(errors.InsufficientPrivilege), connection.transaction():
                connection.execute(statement)

    # the audit role reads and verifies, and may write nothing
    auditor = SchedulerApplication(
        env={
            "SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.auditor),
            "SECONDBOX_READ_MODELS": "off",
        }
    )
    try:
        report = verify(auditor, measure_raw=False)
        assert report.ok, report.violations
        assert report.chain.links_checked == report.events > 0
    finally:
        auditor.close()
    for command in (["audit", "verify"], ["audit", "checkpoint"]):  # as an operator runs them
        run = CliRunner().invoke(
            cli, [*command, "--database-url", _url(postgres_schema, roles.auditor)]
        )
        assert run.exit_code == 0, run.output
    with (
        _connect(postgres_schema, roles.auditor) as connection,
        pytest.raises(errors.InsufficientPrivilege),
        connection.transaction(),
    ):
        connection.execute(f"INSERT INTO {chain} VALUES (0, 0, '')")
    with (
        _connect(postgres_schema, roles.auditor) as connection,
        pytest.raises(errors.InsufficientPrivilege),
        connection.transaction(),
    ):  # the save's function is the application role's alone
        connection.execute(f"SELECT * FROM {events}_append('{{}}', '{{}}', '{{}}', '{{}}', '0s')")
