"""Tampering with a stored history is detected: the hash chain over the log,
sealed snapshots, and checkpoints.

A small simulated history is written once per session (SQLite, chained as the
application writes it); each test edits a private copy, on SQLite or copied into a fresh
PostgreSQL schema, and runs ``audit verify``.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from secondbox_scheduler.domain.audit.chain import Checkpoint
from secondbox_scheduler.domain.errors import CapacityExceededError
from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import checkpoint, verify
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.tools.simulation.config import SimulationConfig
from secondbox_scheduler.infrastructure.tools.simulation.run import run_simulation
from tests.conftest import Clock, PostgresSchema, Store
from tests.factories import capacity, create_sandbox, register, schedule_request
from tests.histories import copy_history
from tests.postgres_server import PostgresServer

SMALL = {"seed": 7, "runners": 9, "sandboxes": 30, "cycles": 2}


@pytest.fixture(scope="session")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small simulated SQLite history (chained as written), made once per session."""
    path = tmp_path_factory.mktemp("simulated") / "history.db"
    run_simulation(SimulationConfig(database_url=f"sqlite:///{path}", **SMALL))  # type: ignore[arg-type]
    return path


# -- raw access to the stored tables of either store ------------------------------


@dataclass
class Raw:
    """The stored tables of one store, edited behind the application's back."""

    kind: str
    execute: Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]
    events: str
    position: str
    chain: str
    snapshots: str

    def sql(self, text: str) -> str:
        return text.format(
            events=self.events, p=self.position, chain=self.chain, snapshots=self.snapshots
        ).replace("?", "%s" if self.kind == "postgres" else "?")

    def rows(self, text: str, *params: Any) -> list[tuple[Any, ...]]:
        return self.execute(self.sql(text), params)

    def positions(self) -> list[int]:
        return [r[0] for r in self.rows("SELECT {p} FROM {events} ORDER BY {p}")]

    def event(self, position: int) -> tuple[Any, int, str, bytes]:
        row = self.rows(
            "SELECT originator_id, originator_version, topic, state FROM {events} WHERE {p} = ?",
            position,
        )[0]
        return row[0], row[1], row[2], bytes(row[3])

    def set_state(self, position: int, state: bytes) -> None:
        self.rows("UPDATE {events} SET state = ? WHERE {p} = ?", state, position)

    def delete(self, position: int, link: bool = False) -> None:
        self.rows("DELETE FROM {events} WHERE {p} = ?", position)
        if link:
            self.rows("DELETE FROM {chain} WHERE position = ?", position)


def sqlite_raw(path: Path) -> Raw:
    def execute(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(path)) as connection, connection:
            return connection.execute(statement, params).fetchall()

    return Raw(
        "sqlite", execute, "stored_events", "rowid", "stored_events_chain", "stored_snapshots"
    )


def postgres_raw(schema: PostgresSchema) -> Raw:
    def execute(statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with psycopg.connect(schema.server.conninfo(), autocommit=True) as connection:
            connection.execute(f'SET search_path TO "{schema.name}"')
            cursor = connection.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    name = "schedulerapplication"
    return Raw(
        "postgres",
        execute,
        f"{name}_events",
        "notification_id",
        f"{name}_events_chain",
        f"{name}_snapshots",
    )


@dataclass
class Copy:
    raw: Raw
    open: Callable[[], SchedulerApplication]


@pytest.fixture
def copy_of(
    simulated: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], Copy]]:
    """Private copies of the simulated history on SQLite or PostgreSQL (each in a schema
    of its own, dropped afterwards)."""
    opened: list[SchedulerApplication] = []
    schemas: list[PostgresSchema] = []

    def make(kind: str) -> Copy:
        if kind == "sqlite":
            path = tmp_path / f"copy-{len(opened)}.db"
            shutil.copyfile(simulated, path)
            env = {"SECONDBOX_DATABASE_URL": f"sqlite:///{path}"}
            raw = sqlite_raw(path)
        else:
            server: PostgresServer = request.getfixturevalue("postgres_server")
            schema = PostgresSchema(server, f"t_{uuid.uuid4().hex[:16]}")
            with psycopg.connect(server.conninfo(), autocommit=True) as connection:
                connection.execute(f'CREATE SCHEMA "{schema.name}"')
            schemas.append(schema)
            env = schema.env()
            raw = postgres_raw(schema)
            app = SchedulerApplication(env=env)
            copy_history(simulated, app)
            app.close()

        def open_app() -> SchedulerApplication:
            app = SchedulerApplication(env={**env, "SECONDBOX_READ_MODELS": "off"})
            opened.append(app)
            return app

        return Copy(raw, open_app)

    yield make
    for app in opened:
        app.close()
    for schema in schemas:
        with psycopg.connect(schema.server.conninfo(), autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA IF EXISTS "{schema.name}" CASCADE')


def first_bad(copy: Copy, against: Checkpoint | None = None) -> int | None:
    app = copy.open()
    try:
        return verify(app, measure_raw=False, checkpoint=against).first_bad_position
    finally:
        app.close()


def edit_json(raw: Raw, position: int, change: Callable[[dict[str, Any]], None]) -> None:
    state = json.loads(raw.event(position)[3])
    change(state)
    raw.set_state(position, json.dumps(state, separators=(",", ":")).encode())


def nth(raw: Raw, topic_suffix: str, index: int = 0) -> int:
    rows = raw.rows("SELECT {p}, topic FROM {events} ORDER BY {p}")
    found = [int(row[0]) for row in rows if row[1].endswith(topic_suffix)]
    return found[index if index >= 0 else len(found) + index]


# -- the edits of the issue, each on its own copy (SQLite, through the CLI) ---------


def _fenced_token(raw: Raw) -> int:
    position = nth(raw, "Sandbox.AssignmentFenced", 3)

    def change(state: dict[str, Any]) -> None:
        token = state["assignment"]["fencing_token"]
        state["assignment"]["fencing_token"] = ("1" if token[0] != "1" else "2") + token[1:]

    edit_json(raw, position, change)
    return position


def _refusal(field: str) -> Callable[[Raw], int]:
    def edit(raw: Raw) -> int:
        position = nth(raw, "RefusalLog.Refused")

        def change(state: dict[str, Any]) -> None:
            if field == "summary":
                state["summary"] = state["summary"].replace("0/", "1/", 1) + " "
            elif field == "candidates":
                state["candidates"] = state["candidates"][:-1]
            else:
                state["error"] = "NoCompatibleRunnerError"

        edit_json(raw, position, change)
        return position

    return edit


def _placement(field: str, value: Any) -> Callable[[Raw], int]:
    def edit(raw: Raw) -> int:
        position = nth(raw, "Sandbox.AssignmentFenced", 5)

        def change(state: dict[str, Any]) -> None:
            if field == "decided_at":
                state["placement"]["decided_at"]["_data_"] = "2026-01-05T08:00:00+00:00"
            else:
                state["placement"][field] = value

        edit_json(raw, position, change)
        return position

    return edit


def _field(topic: str, field: str, value: Any) -> Callable[[Raw], int]:
    def edit(raw: Raw) -> int:
        position = nth(raw, topic)
        edit_json(raw, position, lambda state: state.__setitem__(field, value))
        return position

    return edit


def _delete(topic: str, index: int = 0) -> Callable[[Raw], int]:
    def edit(raw: Raw) -> int:
        position = nth(raw, topic, index)
        raw.delete(position)
        return position

    return edit


def _delete_last(raw: Raw) -> int:
    position = raw.positions()[-1]
    raw.delete(position)
    return position


def _swap_renewals(raw: Raw) -> int:
    rows = raw.rows("SELECT {p}, originator_id, topic FROM {events} ORDER BY {p}")
    renewals: dict[Any, list[int]] = {}
    for position, stream, topic in rows:
        if topic.endswith("LivenessRenewed"):
            renewals.setdefault(stream, []).append(position)
    first, second = next(p for p in renewals.values() if len(p) > 4)[2:4]
    a, b = raw.event(first), raw.event(second)
    raw.rows("UPDATE {events} SET originator_version = -1 WHERE {p} = ?", first)
    raw.rows(
        "UPDATE {events} SET originator_version = ?, state = ? WHERE {p} = ?", a[1], b[3], second
    )
    raw.rows(
        "UPDATE {events} SET originator_version = ?, state = ? WHERE {p} = ?", b[1], a[3], first
    )
    return first


EDITS: dict[str, Callable[[Raw], int]] = {
    "fencing token digit": _fenced_token,
    "refusal summary": _refusal("summary"),
    "refusal candidates": _refusal("candidates"),
    "refusal error": _refusal("error"),
    "decision time moved back": _placement("decided_at", None),
    "heartbeat timeout 1e9": _placement("heartbeat_timeout_seconds", 1e9),
    "release proof": _field("Sandbox.AssignmentReleased", "release_proof", {"exit": "clean"}),
    "failure class": _field("Sandbox.AssignmentFailed", "failure_class", "other"),
    "delete AssignmentRunning": _delete("Sandbox.AssignmentRunning", 3),
    "delete AssignmentFailed": _delete("Sandbox.AssignmentFailed"),
    "delete DrainStarted": _delete("Runner.DrainStarted"),
    "delete Refused": _delete("RefusalLog.Refused"),
    "delete mid-stream LivenessRenewed": _delete("RunnerLease.LivenessRenewed", 40),
    "delete the last event": _delete_last,
    "swap two renewals": _swap_renewals,
}


@pytest.mark.parametrize("edit", EDITS)
def test_each_edit_of_the_issue_fails_audit_verify_naming_its_position(
    edit: str, copy_of: Callable[[str], Copy]
) -> None:
    copy = copy_of("sqlite")
    try:
        position = EDITS[edit](copy.raw)
    except (IndexError, StopIteration):
        pytest.fail(f"the simulated history has no event for {edit!r}")
    url = copy.open().env["SQLITE_DBNAME"]
    result = CliRunner().invoke(cli, ["audit", "verify", "--database-url", f"sqlite:///{url}"])
    assert result.exit_code == 1, result.output
    assert f"#{position} " in result.output
    assert first_bad(copy) == position


def test_a_clean_history_verifies_and_a_truncated_one_fails_against_its_checkpoint(
    copy_of: Callable[[str], Copy],
) -> None:
    copy = copy_of("sqlite")
    url = f"sqlite:///{copy.open().env['SQLITE_DBNAME']}"
    runner = CliRunner()
    taken = runner.invoke(cli, ["audit", "checkpoint", "--database-url", url])
    assert taken.exit_code == 0, taken.output
    mark = taken.output.strip()
    clean = runner.invoke(cli, ["audit", "verify", "--database-url", url, "--checkpoint", mark])
    assert clean.exit_code == 0, clean.output
    assert "chain:" in clean.output
    cut = copy.raw.positions()[len(copy.raw.positions()) // 2]
    copy.raw.rows("DELETE FROM {events} WHERE {p} > ?", cut)
    copy.raw.rows("DELETE FROM {chain} WHERE position > ?", cut)
    copy.raw.rows("DELETE FROM {snapshots}")  # a careful truncation: no trace left
    failed = runner.invoke(cli, ["audit", "verify", "--database-url", url, "--checkpoint", mark])
    assert failed.exit_code == 1
    assert f"#{cut + 1} " in failed.output
    assert "truncated" in failed.output


def test_a_checkpoint_taken_with_the_key_fails_without_it(
    copy_of: Callable[[str], Copy], monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = copy_of("sqlite")
    monkeypatch.setenv("SECONDBOX_AUDIT_KEY", "not the key the history was written with")
    app = copy.open()
    report = verify(app, measure_raw=False)
    assert not report.ok  # every link fails: the history was chained without this key
    assert report.chain.keyed


# -- random tamper operations, on both stores -----------------------------------------


OPERATIONS = [
    "byte",
    "topic",
    "stream",
    "delete",
    "delete-with-link",
    "duplicate",
    "swap",
    "truncate",
    "snapshot",
]


def tamper(
    raw: Raw, operation: str, draw: st.DataObject, app: SchedulerApplication
) -> tuple[int, Checkpoint | None]:
    """Apply one tamper operation; the position ``audit verify`` must name (and the
    checkpoint to verify against, for a truncation)."""
    positions = raw.positions()
    pick = draw.draw(st.integers(0, len(positions) - 2), label="index")
    position = positions[pick]
    if operation == "byte":
        state = bytearray(raw.event(position)[3])
        offset = draw.draw(st.integers(0, len(state) - 1), label="offset")
        state[offset] ^= draw.draw(st.integers(1, 255), label="xor")
        raw.set_state(position, bytes(state))
    elif operation == "topic":
        raw.rows("UPDATE {events} SET topic = topic || 'x' WHERE {p} = ?", position)
    elif operation == "stream":  # the event moved to another stream, or to a new one
        stream, version = raw.event(position)[:2]
        streams = sorted(
            {row[0] for row in raw.rows("SELECT originator_id FROM {events}")}, key=str
        )
        target = draw.draw(st.sampled_from([None, *streams]), label="stream")
        taken = target is not None and raw.rows(
            "SELECT 1 FROM {events} WHERE originator_id = ? AND originator_version = ?",
            target,
            version,
        )
        if target is None or target == stream or taken:
            fresh = uuid.UUID(int=draw.draw(st.integers(1, 2**128 - 1), label="new stream"))
            target = fresh.hex if raw.kind == "sqlite" else fresh
        raw.rows("UPDATE {events} SET originator_id = ? WHERE {p} = ?", target, position)
        assert raw.event(position)[0] != stream
    elif operation in ("delete", "delete-with-link"):
        raw.delete(position, link=operation == "delete-with-link")
    elif operation == "duplicate":
        stream, version, topic, copied = raw.event(position)
        raw.rows(
            "INSERT INTO {events} (originator_id, originator_version, topic, state) "
            "VALUES (?, ?, ?, ?)",
            stream,
            version + 100_000,
            topic,
            copied,
        )
        return raw.positions()[-1], None
    elif operation == "swap":
        other = positions[draw.draw(st.integers(pick + 1, len(positions) - 1), label="other")]
        a, b = raw.event(position), raw.event(other)
        if (a[2], a[3]) == (b[2], b[3]):
            raw.set_state(position, a[3] + b" ")
        else:
            raw.rows("UPDATE {events} SET topic = ?, state = ? WHERE {p} = ?", b[2], b[3], position)
            raw.rows("UPDATE {events} SET topic = ?, state = ? WHERE {p} = ?", a[2], a[3], other)
    elif operation == "truncate":
        mark = checkpoint(app)
        raw.rows("DELETE FROM {events} WHERE {p} > ?", position)
        raw.rows("DELETE FROM {chain} WHERE position > ?", position)
        return position + 1, mark
    else:  # a forged snapshot: one byte of a stored snapshot's state
        snapshots = raw.rows(
            "SELECT s.originator_id, s.originator_version, e.{p} FROM {snapshots} s "
            "JOIN {events} e ON e.originator_id = s.originator_id "
            "AND e.originator_version = s.originator_version ORDER BY e.{p}"
        )
        stream, version, at = snapshots[draw.draw(st.integers(0, len(snapshots) - 1))]
        state = raw.rows(
            "SELECT state FROM {snapshots} WHERE originator_id = ? AND originator_version = ?",
            stream,
            version,
        )[0][0]
        forged = bytes(state).replace(b'"reserved"', b'"reserveD"', 1)
        if forged == bytes(state):
            forged = bytes(state) + b" "
        raw.rows(
            "UPDATE {snapshots} SET state = ? WHERE originator_id = ? AND originator_version = ?",
            forged,
            stream,
            version,
        )
        return at, None
    return position, None


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_tampering_is_detected_at_its_position(
    kind: str, operation: str, data: st.DataObject, copy_of: Callable[[str], Copy]
) -> None:
    """Every kind of edit on both stores (each kind a case of its own, so none goes
    undrawn), its position, stream, bytes and neighbours drawn at random."""
    copy = copy_of(kind)
    app = copy.open()
    try:
        assert verify(app, measure_raw=False).ok  # a clean history verifies
        expected, mark = tamper(copy.raw, operation, data, app)
    finally:
        app.close()
    found = first_bad(copy, mark)
    if operation == "truncate":  # a cut inside a transaction: its last event is named too
        assert found in (expected - 1, expected)
    else:
        assert found == expected


def raw_of(store: Store, request: pytest.FixtureRequest) -> Raw:
    if store.kind == "sqlite":
        return sqlite_raw(Path(store.env["SQLITE_DBNAME"]))
    return postgres_raw(request.getfixturevalue("postgres_schema"))


def test_a_forged_runner_snapshot_is_refused_and_the_runner_loaded_from_its_events(
    store: Store,
    clock: Clock,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Zeroing ``reserved`` (and dropping the reservations) in a runner's latest snapshot
    neither lets a shrink below what it really holds pass nor crashes a later release
    of a reservation the forged state lacks (it raised KeyError before the seals)."""
    app = store.open()
    roomy = capacity(vcpu_count=80, memory_bytes=160 * 2**30, disk_bytes=1000 * 2**30,
                     instances=40, operations=160)  # fmt: skip
    register(app, "r1", at=clock(), allocatable=roomy)
    placed = []
    for n in range(12):  # the runner passes its snapshot interval (10 events)
        create_sandbox(app, f"s{n}")
        placed.append(app.schedule(schedule_request(f"s{n}", clock()))[0])
    raw = raw_of(store, request)
    stream = runner_uuid("r1")
    key = stream.hex if store.kind == "sqlite" else stream
    (version, state), *_ = raw.rows(
        "SELECT originator_version, state FROM {snapshots} WHERE originator_id = ? "
        "ORDER BY originator_version DESC",
        key,
    )
    forged = json.loads(bytes(state))
    runner_state = forged["state"]
    assert runner_state["reserved"]["instances"] == version - 1  # one per reservation
    runner_state["reserved"] = dict.fromkeys(runner_state["reserved"], 0)
    runner_state["reservations"] = {}
    raw.rows(
        "UPDATE {snapshots} SET state = ? WHERE originator_id = ? AND originator_version = ?",
        json.dumps(forged).encode(),
        key,
        version,
    )

    fresh = store.open()  # no cached runner: it loads from the stored snapshot
    with (
        caplog.at_level("WARNING"),
        pytest.raises(CapacityExceededError, match="below reserved"),
    ):
        # the forged state (the 3 reservations after the snapshot) would let it pass
        fresh.change_allocatable("r1", capacity(instances=5))
    assert any("refused" in record.getMessage() for record in caplog.records)
    first = placed[0]
    assert fresh.release("s0", first.generation, first.fencing_token, {"exit": "0"})
    assert fresh.get_runner("r1").reserved.instances == 11

    create_sandbox(app, "s12")
    batched = store.open()  # a placement batch loads its runners together (load_many)
    batched.schedule(schedule_request("s12", clock()))
    with pytest.raises(CapacityExceededError, match="below reserved"):
        batched.change_allocatable("r1", capacity(instances=5))  # from its cached runner
