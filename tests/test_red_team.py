"""The red team's findings as the application's own database role, each a promise
(docs/audit.md, "Threat model"; docs/operations.md, the roles procedure):

- events hidden from the audit at positions <= 0;
- a snapshot forged with a seal computed from public data (unkeyed chain);
- the chain poisoned by one far-future link (keyed chain too);
- the read models and their tracking positions rewritten;
- a heartbeat from the future appended through the save function.

The request-serving role writes the history only through the schema owner's functions
and holds no INSERT, UPDATE, DELETE or TRUNCATE on any table; the read models are
written by a projector role of their own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from eventsourcing.domain import Snapshot
from psycopg import errors
from psycopg.conninfo import make_conninfo

from secondbox_scheduler.domain.audit.chain import Chain
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.domain.lease import OBSERVED_STALE, RunnerLease
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.store.postgres_chain_sql import unnested
from secondbox_scheduler.infrastructure.store.roles import grant
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, schedule_request

KEY = "red-team-audit-key"


@dataclass
class Roles:
    owner: str
    app: str
    auditor: str
    projector: str


def _url(schema: PostgresSchema, role: str) -> str:
    server = schema.server
    return f"postgresql://{role}@{server.host}:{server.port}/{server.dbname}?schema={schema.name}"


def _connect(schema: PostgresSchema, role: str) -> psycopg.Connection[tuple[Any, ...]]:
    server = schema.server
    return psycopg.connect(
        make_conninfo(host=server.host, port=server.port, user=role, dbname=server.dbname),
        autocommit=True,
    )


def _admin(schema: PostgresSchema) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(schema.server.conninfo(), autocommit=True)


@pytest.fixture
def roles(postgres_schema: PostgresSchema) -> Iterator[Roles]:
    suffix = uuid.uuid4().hex[:8]
    made = Roles(
        f"sbx_owner_{suffix}", f"sbx_app_{suffix}", f"sbx_audit_{suffix}", f"sbx_proj_{suffix}"
    )
    with _admin(postgres_schema) as admin:
        for role in (made.owner, made.app, made.auditor, made.projector):
            admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'ALTER SCHEMA "{postgres_schema.name}" OWNER TO "{made.owner}"')
    try:
        yield made
    finally:
        with _admin(postgres_schema) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{postgres_schema.name}" CASCADE')
            admin.execute(f'CREATE SCHEMA "{postgres_schema.name}"')  # the fixture drops it
            for role in (made.app, made.auditor, made.projector, made.owner):
                admin.execute(f'DROP OWNED BY "{role}"')
                admin.execute(f'DROP ROLE "{role}"')


def _granted(schema: PostgresSchema, roles: Roles, keyed: bool = False) -> dict[str, str]:
    """The owner creates the tables, an administrator runs ``db grant``; the env of
    the request-serving role (its read models kept by the projector)."""
    extra = {"SECONDBOX_AUDIT_KEY": KEY} if keyed else {}
    SchedulerApplication(env={"SECONDBOX_DATABASE_URL": _url(schema, roles.owner), **extra}).close()
    with _admin(schema) as admin:
        grant(admin, schema.name, roles.owner, roles.app, roles.auditor, projector=roles.projector)
    return {
        "SECONDBOX_DATABASE_URL": _url(schema, roles.app),
        "SECONDBOX_READ_MODELS": "external",
        **extra,
    }


def _projector(schema: PostgresSchema, roles: Roles, keyed: bool = False) -> SchedulerApplication:
    extra = {"SECONDBOX_AUDIT_KEY": KEY} if keyed else {}
    return SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(schema, roles.projector), **extra}
    )


def _history(app: SchedulerApplication, projector: SchedulerApplication, clock: Clock) -> None:
    """A runner of 4 instances, 2 sandboxes placed on it, past a snapshot interval."""
    register(app, "r1", at=clock(), allocatable=capacity(instances=4))
    assert projector.read_models is not None
    projector.read_models.catch_up()
    for name in ("s1", "s2"):
        assert create_sandbox(app, name) == "r1"
        app.schedule(schedule_request(name, clock()))
    for n in range(9):  # placed and released: the runner passes its snapshot interval
        name = f"t{n}"
        assert create_sandbox(app, name) == "r1"
        assignment, _ = app.schedule(schedule_request(name, clock()))
        app.release(name, assignment.generation, assignment.fencing_token, {"exit": "clean"})
    for _ in range(12):
        clock.advance(seconds=1)
        app.record_heartbeat(runner_id="r1", at=clock())
    projector.read_models.catch_up()


def _table(schema: PostgresSchema, suffix: str) -> str:
    return f'"{schema.name}".schedulerapplication_{suffix}'


def test_the_request_serving_role_holds_no_write_privilege_on_any_table(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    try:
        _history(app, projector, clock)  # the service works with these privileges
        assert app.fold_runner("r1").reserved.instances == 2
    finally:
        app.close()
        projector.close()
    with _admin(postgres_schema) as admin:
        listed = admin.execute(
            "SELECT table_name, privilege_type FROM information_schema.role_table_grants "
            "WHERE grantee = %s AND table_schema = %s AND privilege_type <> 'SELECT'",
            (roles.app, postgres_schema.name),
        ).fetchall()
        held = admin.execute(
            "SELECT c.relname, p.privilege FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "CROSS JOIN unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) AS p(privilege) "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p') "
            "AND has_table_privilege(%s, c.oid, p.privilege)",
            (postgres_schema.name, roles.app),
        ).fetchall()
        tables = admin.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (postgres_schema.name,)
        ).fetchone()
    assert tables is not None
    assert tables[0] >= 8
    assert listed == []
    assert held == []


def test_no_event_can_be_hidden_below_position_one(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    try:
        _history(app, projector, clock)
        runner_id = runner_uuid("r1")
    finally:
        app.close()
        projector.close()
    events = _table(postgres_schema, "events")
    hide = (
        f"INSERT INTO {events} (notification_id, originator_id, originator_version, topic, "
        f"state) SELECT 0, originator_id, originator_version + 1, topic, state FROM {events} "
        "WHERE originator_id = %s ORDER BY originator_version DESC LIMIT 1"
    )
    with (
        _connect(postgres_schema, roles.app) as connection,  # the application role
        pytest.raises(errors.InsufficientPrivilege),
        connection.transaction(),
    ):
        connection.execute(hide, (runner_id,))
    with (
        _connect(postgres_schema, roles.owner) as connection,  # the schema refuses it too
        pytest.raises(errors.CheckViolation),
        connection.transaction(),
    ):
        connection.execute(hide, (runner_id,))


def test_an_earlier_schema_gets_the_position_check_and_verify_finds_hidden_events(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    try:
        _history(app, projector, clock)
        runner_id = runner_uuid("r1")
    finally:
        app.close()
        projector.close()
    events = _table(postgres_schema, "events")
    with _admin(postgres_schema) as admin:  # a schema of an earlier release, a hidden event
        for (name,) in admin.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'",
            (events,),
        ).fetchall():
            admin.execute(f'ALTER TABLE {events} DROP CONSTRAINT "{name}"')
        admin.execute(
            f"INSERT INTO {events} (notification_id, originator_id, originator_version, topic, "
            f"state) SELECT -7, originator_id, originator_version + 1, topic, state "
            f"FROM {events} WHERE originator_id = %s ORDER BY originator_version DESC LIMIT 1",
            (runner_id,),
        )
    auditor = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.auditor),
             "SECONDBOX_READ_MODELS": "off"}
    )  # fmt: skip
    try:
        report = verify(auditor, measure_raw=False)
    finally:
        auditor.close()
    assert not report.ok
    assert [v.rule for v in report.violations] == ["stream-not-in-log"], report.violations
    assert str(runner_id) in report.violations[0].detail
    # the owner's next start adds the check (not validated: the hidden row stays as
    # evidence for the audit), and no new position <= 0 is accepted
    SchedulerApplication(env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.owner)}).close()
    with (
        _connect(postgres_schema, roles.owner) as connection,
        pytest.raises(errors.CheckViolation),
        connection.transaction(),
    ):
        connection.execute(
            f"INSERT INTO {events} (notification_id, originator_id, originator_version, "
            f"topic, state) VALUES (0, %s, 1000, 'x', '')",
            (runner_id,),
        )


def test_a_snapshot_forged_with_a_public_seal_is_refused(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    try:
        _history(app, projector, clock)
        runner = app.load(runner_uuid("r1"), Runner)
        assert runner is not None
        assert runner.reserved["instances"] == 2
        forged = getattr(type(runner), "Snapshot", Snapshot).take(runner)
        forged.state["reserved"] = {**forged.state["reserved"], "instances": 0}
        stored = app.snapshots.mapper.to_stored_event(forged)  # type: ignore[union-attr]
    finally:
        app.close()
        projector.close()
    snapshots, seals = (
        _table(postgres_schema, "snapshots"),
        _table(postgres_schema, "snapshots_seal"),
    )
    chain, events = _table(postgres_schema, "events_chain"), _table(postgres_schema, "events")
    with _connect(postgres_schema, roles.app) as connection:
        link = connection.execute(
            f"SELECT c.digest FROM {events} e JOIN {chain} c ON c.position = e.notification_id "
            "WHERE e.originator_id = %s AND e.originator_version = %s",
            (stored.originator_id, stored.originator_version),
        ).fetchone()
        assert link is not None
        seal = Chain().seal(
            bytes(link[0]), stored.originator_id, stored.originator_version, stored.topic,
            stored.state,
        )  # fmt: skip
        for statement, params in (
            (
                f"INSERT INTO {snapshots} (originator_id, originator_version, topic, state) "
                "VALUES (%s, %s, %s, %s)",
                (stored.originator_id, stored.originator_version, stored.topic, stored.state),
            ),
            (
                f"INSERT INTO {seals} VALUES (%s, %s, %s)",
                (stored.originator_id, stored.originator_version, seal),
            ),
        ):
            with pytest.raises(errors.InsufficientPrivilege), connection.transaction():
                connection.execute(statement, params)
        # nor through the save's function: a snapshot only at an event of the same call
        with pytest.raises(errors.RaiseException), connection.transaction():
            connection.execute(
                f"SELECT * FROM {events}_append_with_snapshots('{{}}', '{{}}', '{{}}', '{{}}', "
                "'5s', %s, %s, %s, %s)",
                (
                    [stored.originator_id], [stored.originator_version], [stored.topic],
                    [stored.state],
                ),
            )  # fmt: skip
    replica = SchedulerApplication(env=env, now=clock)  # a freshly started replica
    try:
        assert replica.fold_runner("r1").reserved.instances == 2
    finally:
        replica.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_the_chain_cannot_be_poisoned_by_a_far_future_link(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock, keyed: bool
) -> None:
    env = _granted(postgres_schema, roles, keyed=keyed)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles, keyed=keyed)
    try:
        _history(app, projector, clock)  # the keyed chain's saves work under the role
    finally:
        app.close()
        projector.close()
    chain, events = _table(postgres_schema, "events_chain"), _table(postgres_schema, "events")
    with _connect(postgres_schema, roles.app) as connection:
        with pytest.raises(errors.InsufficientPrivilege), connection.transaction():
            connection.execute(f"INSERT INTO {chain} VALUES (1000000000, 999999999, '\\x00')")
        head = connection.execute(
            f"SELECT position, digest FROM {chain} ORDER BY position DESC LIMIT 1"
        ).fetchone()
        assert head is not None
        # the keyed save's link function refuses links that do not continue the head
        for positions, previous, prior in (
            ([10**9], [head[0]], bytes(head[1])),  # no such event
            ([int(head[0]) + 1], [int(head[0]) - 1], bytes(head[1])),  # not the head
            ([int(head[0]) + 1], [head[0]], b"\x00" * 32),  # not the head's digest
        ):
            with pytest.raises(errors.RaiseException), connection.transaction():
                connection.execute(
                    f"SELECT {events}_link(%s::bigint[], %s::bigint[], %s::bytea[], %s, "
                    "'{}', '{}', '{}', '{}', '{}')",
                    (positions, previous, [b"\x01" * 32], prior),
                )
    auditor = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.auditor),
             "SECONDBOX_READ_MODELS": "off", **({"SECONDBOX_AUDIT_KEY": KEY} if keyed else {})}
    )  # fmt: skip
    try:
        report = verify(auditor, measure_raw=False)
    finally:
        auditor.close()
    assert report.ok, report.violations
    assert report.chain.links_checked == report.events > 0


def test_the_read_models_are_written_by_the_projector_role_alone(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    try:
        _history(app, projector, clock)
    finally:
        app.close()
        projector.close()
    schema = postgres_schema.name
    with _connect(postgres_schema, roles.app) as connection:
        for statement in (
            f'UPDATE "{schema}".runner_snapshots SET reserved_instances = 0',
            f'UPDATE "{schema}".runner_snapshots_tracking SET notification_id = 1000000000',
            f'DELETE FROM "{schema}".assignments',
            f"INSERT INTO \"{schema}\".assignments_tracking VALUES ('x', 1)",
            f'TRUNCATE "{schema}".runner_snapshots',
        ):
            with pytest.raises(errors.InsufficientPrivilege), connection.transaction():
                connection.execute(statement)
    with _connect(postgres_schema, roles.projector) as connection:  # and nothing else
        for statement in (
            f"INSERT INTO {_table(postgres_schema, 'events_chain')} VALUES (10^9, 0, '')",
            f"DELETE FROM {_table(postgres_schema, 'events')}",
        ):
            with pytest.raises(errors.InsufficientPrivilege), connection.transaction():
                connection.execute(statement)


def test_a_heartbeat_from_the_future_appended_through_the_function_is_reported(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    """docs/spec.md (section 6a): the application role appends, through the granted
    ``<events>_append``, a heartbeat whose time and recording time are a year ahead. The
    silent runner keeps receiving placements (its real heartbeats are dropped as stale),
    and ``audit verify`` names the heartbeat from the future (rule ``time-order``)."""
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    future = clock() + timedelta(days=365)
    try:
        register(app, "r1", at=clock(), allocatable=capacity(instances=4))
        assert projector.read_models is not None
        projector.read_models.catch_up()
        lease: RunnerLease = app.repository.get(lease_uuid("r1"))
        lease.trigger_event(RunnerLease.LivenessRenewed, timestamp=future, at=future)
        stored = [app.mapper.to_stored_event(e) for e in lease.collect_events()]
        with _connect(postgres_schema, roles.app) as connection:
            connection.execute(
                f"SELECT * FROM {_table(postgres_schema, 'events')}_append("
                "%s::uuid[], %s::bigint[], %s::text[], %s::bytea[], '5s')",
                unnested(stored),
            )
        planted = app.head_position()
        clock.advance(hours=2)  # the runner is silent: its last real heartbeat is 2 h old
        assert app.record_heartbeat(runner_id="r1", at=clock()) == OBSERVED_STALE
        projector.read_models.catch_up()
        assert create_sandbox(app, "s1") == "r1"
        app.schedule(schedule_request("s1", clock()))  # placed on a silent runner
    finally:
        app.close()
        projector.close()
    auditor = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.auditor),
             "SECONDBOX_READ_MODELS": "off"}
    )  # fmt: skip
    try:
        report = verify(auditor, measure_raw=False)
    finally:
        auditor.close()
    assert not report.ok
    assert [(v.position, v.rule) for v in report.violations] == [(planted, "time-order")]
    assert "RunnerLease r1" in report.violations[0].aggregate
