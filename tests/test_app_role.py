"""The request-serving application role on PostgreSQL: the scheduler works under a
role that may only SELECT the tables and write the history through the schema owner's
functions; the server refuses its INSERT, UPDATE, DELETE and TRUNCATE (the red team's
findings as this role: tests/test_red_team.py)."""

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
from secondbox_scheduler.infrastructure.access.tokens import issue_token, list_tokens, revoke_token
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
    projector: str


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
    made = Roles(
        f"sbx_owner_{suffix}", f"sbx_app_{suffix}", f"sbx_audit_{suffix}", f"sbx_proj_{suffix}"
    )
    conninfo = postgres_schema.server.conninfo()
    with psycopg.connect(conninfo, autocommit=True) as admin:
        for role in (made.owner, made.app, made.auditor, made.projector):
            admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'ALTER SCHEMA "{postgres_schema.name}" OWNER TO "{made.owner}"')
    try:
        yield made
    finally:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{postgres_schema.name}" CASCADE')
            admin.execute(f'CREATE SCHEMA "{postgres_schema.name}"')  # the fixture drops it
            for role in (made.app, made.auditor, made.projector, made.owner):
                admin.execute(f'DROP OWNED BY "{role}"')
                admin.execute(f'DROP ROLE "{role}"')


def test_the_scheduler_runs_under_a_role_that_writes_only_through_functions(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    # the schema owner creates the tables (as a migration would), then an administrator
    # grants the application, projector and audit roles their privileges
    SchedulerApplication(env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.owner)}).close()
    with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
        statements = grant(
            admin, postgres_schema.name, roles.owner, roles.app, roles.auditor, roles.projector
        )
    granted_to_app = [s for s in statements if s.startswith("GRANT") and roles.app in s]
    assert any("GRANT SELECT ON" in s and "_events" in s for s in granted_to_app)
    assert not any("INSERT" in s or "UPDATE" in s for s in granted_to_app)
    for function in ("append", "append_with_snapshots", "insert", "link"):
        assert any(f'_events_{function}"(' in s for s in granted_to_app), function

    # start-up under the application role: no CREATE privilege needed; its read models
    # are kept by the projector role
    env = {
        "SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.app),
        "SECONDBOX_READ_MODELS": "external",
    }
    app = SchedulerApplication(env=env, now=clock)
    projector = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.projector)}
    )
    assert projector.read_models is not None
    try:
        assert app.recorder.appends_in_server()  # type: ignore[attr-defined]
        register(app, "r1", at=clock())  # registration and a heartbeat
        issued = issue_token(app, role="auditor")  # access tokens: events like any other
        assert revoke_token(app, issued.token_id)
        assert [t.state for t in list_tokens(app)] == ["revoked"]
        projector.read_models.catch_up()
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
        projector.read_models.catch_up()
        names = [f"b{n}" for n in range(10)]
        for name in names:
            create_sandbox(app, name)
        assert all(isinstance(o, tuple) for o in app.schedule_many(
            [schedule_request(name, clock()) for name in names]
        ))  # fmt: skip
        assert app.snapshots is not None
        assert app.snapshots.recorder.appends_in_server()  # type: ignore[attr-defined]

        # found by review: a function no longer the role's to run fails the save (the
        # role cannot write the tables itself: nothing stored), and once the grant is
        # mended the saves go through the functions again
        with_snapshots = (
            f'"{postgres_schema.name}".schedulerapplication_events_append_with_snapshots'
            f"({APPEND_WITH_SNAPSHOTS_ARGUMENTS})"
        )
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
            admin.execute(f'REVOKE EXECUTE ON FUNCTION {with_snapshots} FROM "{roles.app}"')
        names = [f"d{n}" for n in range(10)]  # the runner passes 20: a snapshot
        for name in names:
            create_sandbox(app, name)
        head = app.head_position()
        with pytest.raises(ProgrammingError):
            app.schedule_many([schedule_request(name, clock()) for name in names])
        assert app.head_position() == head
        with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
            admin.execute(f'GRANT EXECUTE ON FUNCTION {with_snapshots} TO "{roles.app}"')
        assert all(isinstance(o, tuple) for o in app.schedule_many(
            [schedule_request(name, clock()) for name in names]
        ))  # fmt: skip
        assert app.recorder.appends_in_server()  # type: ignore[attr-defined]
        assert app.snapshots.recorder.appends_in_server()  # type: ignore[attr-defined]
    finally:
        app.close()
        projector.close()

    # the functions not the role's to run: its saves fail (it cannot link itself)
    with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as admin:
        for function, arguments in (
            ("events_append", APPEND_ARGUMENTS),
            ("events_append_with_snapshots", APPEND_WITH_SNAPSHOTS_ARGUMENTS),
        ):
            admin.execute(
                f'REVOKE EXECUTE ON FUNCTION "{postgres_schema.name}".schedulerapplication_'
                f'{function}({arguments}) FROM "{roles.app}"'
            )
    app = SchedulerApplication(env=env, now=clock)
    try:
        assert not app.recorder.appends_in_server()  # type: ignore[attr-defined]
        head = app.head_position()
        with pytest.raises(ProgrammingError, match="permission denied"):
            register(app, "r3", at=clock())
        assert app.head_position() == head
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
            f"INSERT INTO {events} (originator_id, originator_version, topic, state) "
            "SELECT originator_id, originator_version + 100, topic, state "
            f"FROM {events} LIMIT 1",
            f"INSERT INTO {chain} VALUES (1000000, 999999, '')",
            f"SELECT {events}_lock()",
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
