"""Read models: live == rebuilt from zero == fold of the aggregates; exactly once; safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain import (
    Capacity,
    HomeRunnerUnavailableError,
    NoCompatibleRunnerError,
    SchedulerError,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.projections.read_models import ReadModels, rebuild
from secondbox_scheduler.projections.sql_view import TIME_FORMAT, text_time, time_text
from secondbox_scheduler.testing import histories, run_history
from secondbox_scheduler.testing.strategies import HISTORY_SANDBOXES
from tests.conftest import Clock, Store
from tests.factories import (
    RUNTIME,
    capacity,
    create_sandbox,
    materialization,
    only_refusals_since,
    register,
    schedule_request,
)
from tests.postgres_server import PostgresServer

SANDBOXES = HISTORY_SANDBOXES


def read_models_of(app: SchedulerApplication) -> ReadModels:
    assert app.read_models is not None
    return app.read_models


def folded(app: SchedulerApplication) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The aggregates' own view: runner snapshots and every assignment, as records."""
    runners = [snapshot.to_record() for snapshot in app.fold_runner_snapshots()]
    assignments = []
    for sandbox_id in SANDBOXES:
        try:
            assignments += [a.model_dump() for a in app.fold_assignments(sandbox_id)]
        except SchedulerError:
            continue
    return runners, assignments


def projected(app: SchedulerApplication) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    read_models = read_models_of(app)
    runners = [snapshot.to_record() for snapshot in read_models.runners.snapshots()]
    assignments = []
    for sandbox_id in SANDBOXES:
        assignments += [a.model_dump() for a in read_models.assignments.by_sandbox(sandbox_id)]
    return runners, assignments


def raw_rows(app: SchedulerApplication) -> dict[str, list[dict[str, Any]]]:
    read_models = read_models_of(app)
    return {name: view.rows() for name, view in read_models.views.items()}  # type: ignore[attr-defined]


OPERATIONS = histories()


def check_live_rebuilt_folded(app: SchedulerApplication) -> None:
    live = projected(app)
    live_rows = raw_rows(app)
    assert live == folded(app), "live read models equal the fold of the aggregates"
    report = rebuild(read_models_of(app))
    assert report.events == app.event_count()
    assert raw_rows(app) == live_rows, "a rebuild from zero equals the live read models"
    assert projected(app) == live


@contextmanager
def fresh_store(kind: str, server: PostgresServer | None) -> Iterator[dict[str, str]]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as directory:
            yield {"PERSISTENCE_MODULE": "eventsourcing.sqlite",
                   "SQLITE_DBNAME": str(Path(directory) / "h.db")}  # fmt: skip
        return
    assert server is not None
    schema = f"h_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield {**server.env(), "POSTGRES_SCHEMA": schema}
    finally:
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations=OPERATIONS)
def test_random_histories_live_equals_rebuilt_equals_fold(
    kind: str, operations: list[Any], request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("postgres_server") if kind == "postgres" else None
    with fresh_store(kind, server) as env:
        clock = Clock()
        app = SchedulerApplication(env=env, now=clock)
        try:
            run_history(app, clock, operations)
            read_models_of(app).catch_up()
            check_live_rebuilt_folded(app)
        finally:
            app.close()


def test_a_failure_inside_processing_applies_nothing_twice(store: Store, clock: Clock) -> None:
    writer = store.open()
    history = [("create", 0, b) for b in range(4)] + [("schedule", 0, b) for b in range(4)] * 2
    run_history(writer, clock, history)
    reader = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"})
    store.opened.append(reader)
    read_models = read_models_of(reader)
    read_models.clear()
    projection = read_models.projections["runner_snapshots"]
    real = projection.changes
    seen = {"count": 0}

    def failing(event: Any) -> Any:
        seen["count"] += 1
        if seen["count"] == 7:
            raise RuntimeError("crash inside processing")
        return real(event)

    projection.changes = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="crash"):
        read_models.catch_up()
    position = read_models.position("runner_snapshots")
    assert position < writer.head_position(), "the failed page was not recorded"
    projection.changes = real  # type: ignore[method-assign]
    read_models.catch_up()
    assert projected(reader) == folded(writer)


def test_a_stale_projection_never_causes_a_wrong_reservation(store: Store, clock: Clock) -> None:
    fresh = store.open()
    register(fresh, "r1", at=clock(), allocatable=capacity(instances=1))
    stale = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    store.opened.append(stale)
    read_models_of(stale).catch_up()  # the read model now says r1 has one free slot
    create_sandbox(fresh, "s1")
    assert create_sandbox(stale, "s2") == "r1"  # true then
    fresh.schedule(schedule_request("s1", clock()))  # takes the slot; stale does not see it
    assert read_models_of(stale).runners.snapshot("r1").reserved == Capacity()  # type: ignore[union-attr]
    before = fresh.head_position()
    # the stale read model still offers r1; its aggregates refuse it (docs/spec.md 8.1)
    with pytest.raises(NoCompatibleRunnerError, match="insufficient instances"):
        create_sandbox(stale, "s3")
    with pytest.raises(HomeRunnerUnavailableError, match="insufficient instances"):
        stale.schedule(schedule_request("s2", clock()))
    assert only_refusals_since(fresh, before)
    assert fresh.fold_runner("r1").reserved.instances == 1


def test_read_your_writes_waits_for_a_position(store: Store, clock: Clock) -> None:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    store.opened.append(app)
    register(app, "r1", at=clock())
    position = app.head_position()
    with pytest.raises(TimeoutError):
        app.wait_for(position, timeout=0.2)
    read_models_of(app).catch_up()
    app.wait_for(position, timeout=0.2)
    assert [r.id for r in app.runner_snapshots()] == ["r1"]


def test_status_reports_position_head_and_lag(store: Store, clock: Clock) -> None:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    store.opened.append(app)
    register(app, "r1", at=clock())
    lagging = {s.name: s for s in read_models_of(app).status()}
    assert lagging["runner_snapshots"].lag_events == app.event_count()
    read_models_of(app).catch_up()
    current = {s.name: s for s in read_models_of(app).status()}
    assert {s.lag_events for s in current.values()} == {0}
    assert {s.position for s in current.values()} == {app.head_position()}


def cli(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "secondbox_scheduler.infrastructure.cli", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_a_killed_projection_process_resumes_exactly_once(
    postgres_schema: Any, clock: Clock
) -> None:
    url = postgres_schema.url()
    writer = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": url, "SECONDBOX_READ_MODELS": "off"}, now=clock
    )
    try:
        for index in range(8):
            register(writer, f"r{index}", at=clock(), allocatable=capacity(instances=50))
        for index in range(300):
            writer.record_heartbeat(
                runner_id=f"r{index % 8}", at=clock.advance(seconds=11),
                artifact_digests=[RUNTIME, str(index)], materializations=[materialization()],
            )  # fmt: skip
        head = writer.head_position()
        env = {"SECONDBOX_DATABASE_URL": url, "SECONDBOX_READ_MODELS": "external"}
        process = cli("projections", "run", "--poll", "0.05", env=env)
        observer = SchedulerApplication(env=env)
        try:
            deadline = time.monotonic() + 60
            while read_models_of(observer).position("runner_snapshots") < 20:
                assert time.monotonic() < deadline, process.stderr
                time.sleep(0.01)
            process.send_signal(signal.SIGKILL)
            process.wait()
            killed_at = read_models_of(observer).position("runner_snapshots")
            resumed = cli("projections", "run", "--once", env=env)
            assert resumed.wait(timeout=120) == 0, resumed.stderr
            assert read_models_of(observer).position("runner_snapshots") == head
            assert killed_at <= head
            assert [s.to_record() for s in read_models_of(observer).runners.snapshots()] == [
                s.to_record() for s in writer.fold_runner_snapshots()
            ]
        finally:
            observer.close()
    finally:
        writer.close()


def test_concurrent_batched_catch_ups_apply_each_event_once(store: Store, clock: Clock) -> None:
    """Found by `verify`: two replicas catching up pages that overlap but end at different
    positions must not both commit (the tracking row alone only forbids going backwards)."""
    writer = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "off"}, now=clock)
    store.opened.append(writer)
    run_history(
        writer, clock, [("create", 0, b) for b in range(4)] + [("schedule", 0, b) for b in range(4)]
    )
    head = writer.head_position()
    external = {**store.env, "SECONDBOX_READ_MODELS": "external"}
    first, second = SchedulerApplication(env=external), SchedulerApplication(env=external)
    store.opened += [first, second]
    ahead, behind = read_models_of(first), read_models_of(second)
    original = behind._pages

    def interleaved(
        after: int, end: int, page_size: int = 1000, names: Collection[str] | None = None
    ) -> Iterator[Any]:
        for page in original(after, end, page_size, names):
            ahead.catch_up(until=(after + head) // 2)  # overtakes part of this page
            yield page

    behind._pages = interleaved  # type: ignore[method-assign]
    behind.catch_up()
    behind._pages = original  # type: ignore[method-assign]
    assert {behind.position(name) for name in behind.views} == {head}
    assert projected(first) == folded(writer)


def test_a_catch_up_that_lost_a_race_stops_at_the_head_it_started_at(
    store: Store, clock: Clock
) -> None:
    """A replica that loses a page to another goes on to the head its catch-up started
    at: the events written meanwhile are the next catch-up's (chasing the moving head,
    replicas writing all the while raced again and again)."""
    writer = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "off"}, now=clock)
    store.opened.append(writer)
    run_history(writer, clock, [("create", 0, b) for b in range(4)])
    head = writer.head_position()
    external = {**store.env, "SECONDBOX_READ_MODELS": "external"}
    first, second = SchedulerApplication(env=external), SchedulerApplication(env=external)
    store.opened += [first, second]
    ahead, behind = read_models_of(first), read_models_of(second)
    original = behind._pages
    raced: list[int] = []

    def interleaved(
        after: int, end: int, page_size: int = 1000, names: Collection[str] | None = None
    ) -> Iterator[Any]:
        if not raced:  # once: a rival applies this page, then more events arrive
            raced.append(end)
            ahead.catch_up()
            run_history(writer, clock, [("schedule", 0, b) for b in range(4)])
        yield from original(after, end, page_size, names)

    behind._pages = interleaved  # type: ignore[method-assign]
    behind.catch_up()
    behind._pages = original  # type: ignore[method-assign]
    assert raced == [head]
    assert writer.head_position() > head
    assert {behind.position(name) for name in behind.views} == {head}
    behind.catch_up()
    assert {behind.position(name) for name in behind.views} == {writer.head_position()}
    assert projected(second) == folded(writer)


def test_a_catch_up_of_one_view_leaves_the_others_for_their_own(store: Store, clock: Clock) -> None:
    """A home decision catches up the runner snapshots alone; the assignments view
    applies the same events at its own next catch-up, each once."""
    writer = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "off"}, now=clock)
    store.opened.append(writer)
    run_history(
        writer, clock, [("create", 0, b) for b in range(3)] + [("schedule", 0, b) for b in range(3)]
    )
    head = writer.head_position()
    reader = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"})
    store.opened.append(reader)
    read_models = read_models_of(reader)
    read_models.catch_up(views=("runner_snapshots",))
    assert read_models.position("runner_snapshots") == head
    assert read_models.position("assignments") == 0
    assert read_models.assignments.by_sandbox(HISTORY_SANDBOXES[0]) == []
    read_models.catch_up()
    assert {read_models.position(name) for name in read_models.views} == {head}
    assert read_models.assignments.by_sandbox(HISTORY_SANDBOXES[0])
    assert projected(reader) == folded(writer)


# -- row changes folded per batch, pages of handled topics ------------------------------

FOLD_DDL = "CREATE TABLE t (id TEXT PRIMARY KEY, alias TEXT UNIQUE, a BIGINT, b BIGINT, c TEXT)"
ROW_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), st.integers(-5, 5), st.booleans()),
        st.tuples(
            st.sampled_from(["set_a", "add_a", "add_b", "alias_c", "alias_add_b"]),
            st.integers(0, 3),
            st.integers(-5, 5),
            st.booleans(),
        ),
    ),
    max_size=30,
)


def row_change(operation: tuple[str, int, int, bool]) -> Any:
    from secondbox_scheduler.projections.row_changes import Insert, Update

    name, row, value, null = operation
    if name == "insert":
        return Insert({"id": f"r{row}", "alias": f"x{row}", "a": value, "b": None if null else 0,
                       "c": None})  # fmt: skip
    # Through either unique key; the columns set through one key are not changed through
    # the other (the fold's precondition), deltas through both commute.
    if name.startswith("alias"):
        key, match = ("alias",), (f"x{row}",)
        if name == "alias_c":
            return Update(key, match, {"c": None if null else f"c{value}"})
        return Update(key, match, add={"b": value})
    key, match = ("id",), (f"r{row}",)
    if name == "set_a":
        return Update(key, match, {"a": None if null else value})
    return Update(key, match, add={name[-1]: value})


@settings(max_examples=300, deadline=None)
@given(before=ROW_OPERATIONS, batch=ROW_OPERATIONS)
def test_a_folded_batch_writes_the_rows_of_its_changes_one_by_one(
    before: list[Any], batch: list[Any]
) -> None:
    """Net changes (inserts absorbing later updates, updates merged per row and key,
    deltas summed, NULL + delta = NULL) equal the SQL statements applied in order."""
    import sqlite3

    from secondbox_scheduler.projections.row_changes import Insert, NetChanges

    def one_by_one(db: sqlite3.Connection, changes: list[Any]) -> None:
        for change in changes:
            if isinstance(change, Insert):
                columns = ", ".join(change.values)
                marks = ", ".join("?" for _ in change.values)
                db.execute(f"INSERT INTO t ({columns}) VALUES ({marks})",
                           tuple(change.values.values()))  # fmt: skip
            else:
                assignments = [f"{c} = ?" for c in change.set] + [
                    f"{c} = {c} + ?" for c in change.add
                ]
                db.execute(
                    f"UPDATE t SET {', '.join(assignments)} WHERE {change.key[0]} = ?",
                    (*change.set.values(), *change.add.values(), *change.match),
                )

    def folded(db: sqlite3.Connection, changes: list[Any]) -> None:
        net = NetChanges((("id",), ("alias",))).extend(changes)
        for columns, rows in net.insert_groups({}).items():
            marks = ", ".join("?" for _ in columns)
            db.executemany(f"INSERT INTO t ({', '.join(columns)}) VALUES ({marks})", rows)
        for (key, set_columns, add_columns), params in net.update_groups({}).items():
            assignments = [f"{c} = ?" for c in set_columns] + [
                f"{c} = {c} + ?" for c in add_columns
            ]
            where = " AND ".join(f"{c} = ?" for c in key)
            db.executemany(f"UPDATE t SET {', '.join(assignments)} WHERE {where}", params)

    results: list[Any] = []
    for write in (one_by_one, folded):
        db = sqlite3.connect(":memory:")
        db.execute(FOLD_DDL)
        try:
            one_by_one(db, [row_change(op) for op in before])
            valid = True
        except sqlite3.IntegrityError:
            valid = False
        # a history that inserts a row twice is not a history: not an example (a
        # `return` here counted it as a pass, and Hypothesis could not tell how many
        # examples tested nothing; assume() makes it draw another, and fail if it must
        # discard too many)
        assume(valid)
        try:
            write(db, [row_change(op) for op in batch])
            results.append(db.execute("SELECT * FROM t ORDER BY id").fetchall())
        except sqlite3.IntegrityError:
            results.append("integrity error")
    assert results[0] == results[1]


def test_handled_topics_come_from_the_registered_events() -> None:
    from secondbox_scheduler.projections.read_models import handled_topics
    from secondbox_scheduler.projections.runner_snapshots import RunnerSnapshotsProjection

    topics = handled_topics(RunnerSnapshotsProjection)
    package = "secondbox_scheduler."
    for former in ("", package):  # release 0.1 stored the topics without the package
        assert f"{former}domain.runner:Runner.Registered" in topics
        assert f"{former}domain.lease:RunnerLease.EvidenceRecorded" in topics
        assert f"{former}domain.lease:RunnerLease.Opened" not in topics
    assert not any(topic.split(":")[0].endswith("domain.sandbox") for topic in topics)


def test_positions_reach_the_end_of_the_range_past_unhandled_events(
    store: Store, clock: Clock
) -> None:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    store.opened.append(app)
    register(app, "r1", at=clock())
    read_models = read_models_of(app)
    read_models.catch_up()
    middle = app.head_position()
    create_sandbox(app, "s1")  # Sandbox.Created: no projection reads it
    head = app.head_position()
    assert head > middle
    read_models.catch_up(until=head + 100)  # beyond the head: stops at the head
    assert {read_models.position(name) for name in read_models.views} == {head}
    assert {s.lag_events for s in read_models.status()} == {0}
    assert read_models.catch_up() == 0, "nothing left to read"


def test_rebuild_in_small_pages_and_chunks_equals_the_live_read_models(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows inserted in one page and updated in later ones, chunks read ahead."""
    import secondbox_scheduler.projections.read_models as read_models_module

    app = store.open()
    history = [("create", 0, b) for b in range(4)] + [
        (name, a, b)
        for name in ("schedule", "heartbeat", "running", "claim", "release", "schedule")
        for a in range(3)
        for b in range(4)
    ]
    run_history(app, clock, history)
    read_models_of(app).catch_up()
    live = raw_rows(app)
    assert live["assignments"]
    assert live["runner_snapshots"]
    monkeypatch.setattr(read_models_module, "REBUILD_PAGE", 4)
    monkeypatch.setattr(read_models_module, "READ_CHUNK", 2)
    report = rebuild(read_models_of(app))
    assert report.events == app.event_count()
    assert raw_rows(app) == live
    assert projected(app) == folded(app)


@given(
    st.datetimes(timezones=st.just(UTC)),
    st.integers(min_value=0, max_value=27),
    st.sampled_from("0123456789-:.TZ+ ,x\u0661"),
)
# a space-padded day: strptime reads it, fromisoformat refuses it (an edited row)
@example(datetime(2026, 1, 15, 9, 5, tzinfo=UTC), 8, " ")
def test_stored_times_read_back_as_strptime_reads_them(
    moment: datetime, at: int, character: str
) -> None:
    """``text_time`` reads the texts ``time_text`` writes with ``fromisoformat`` (fast):
    the same value and zone as ``strptime`` of ``TIME_FORMAT`` gives; a text of another
    shape (one character changed, or one more) is read as ``strptime`` reads it (the
    same value, or both refuse it)."""
    text = time_text(moment)
    assert text is not None
    expected = datetime.strptime(text, TIME_FORMAT).replace(tzinfo=UTC)
    read = text_time(text)
    assert read == expected == moment
    assert read is not None
    assert read.tzinfo is expected.tzinfo
    changed = text[:at] + character + text[at + 1 :]
    try:
        strict: datetime | None = datetime.strptime(changed, TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        strict = None
    try:
        fast: datetime | None = text_time(changed)
    except ValueError:
        fast = None
    assert fast == strict
