"""``simulate`` never deletes or writes into a store it did not create
(infrastructure/tools/simulation/store_guard.py).

It refuses a store that holds events it did not write (exit 2, the store untouched),
unless ``--fresh``, which says what it deletes first; the stores it creates are marked
(the SQLite header's application_id, a comment on PostgreSQL's events table), so that a
rerun may replace (SQLite) or append to (PostgreSQL) them. Through the real command line.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner, Result

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.tools.simulation.store_guard import (
    MARK,
    POSTGRES_EVENTS,
    SQLITE_APPLICATION_ID,
    StoreRefusedError,
    StoreState,
    plan_run,
)
from tests.factories import register

TINY = ["--runners", "3", "--sandboxes", "3", "--cycles", "1"]


def simulate(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["simulate", "--database-url", url, *TINY, "--json", *args])


def someone_elses_store(env: dict[str, str]) -> int:
    """A store with a runner registered by another program: its event count."""
    app = SchedulerApplication(env=env)
    try:
        register(app, "precious-runner", at=app.now())
        return app.event_count()
    finally:
        app.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def application_id(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        (found,) = conn.execute("PRAGMA application_id").fetchone()
    conn.close()
    return int(found)


def test_a_store_it_did_not_create_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "precious.db"
    url = f"sqlite:///{path}"
    events = someone_elses_store({"SECONDBOX_DATABASE_URL": url})
    before = digest(path)
    for extra in ([], ["--append"]):
        refused = simulate(url, *extra)
        assert refused.exit_code == 2, refused.output
        assert refused.stdout == ""
        (line,) = refused.stderr.strip().splitlines()
        assert f"{path} holds {events} events that simulate did not write" in line
        assert "--fresh" in line
    assert digest(path) == before
    assert application_id(path) == 0


def test_fresh_says_what_it_deletes_then_makes_the_store_simulates(tmp_path: Path) -> None:
    path = tmp_path / "precious.db"
    url = f"sqlite:///{path}"
    events = someone_elses_store({"SECONDBOX_DATABASE_URL": url})
    done = simulate(url, "--fresh")
    assert done.exit_code == 0, done.output
    assert f"--fresh: deleting {path}" in done.stderr
    assert f"({events} events)" in done.stderr
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        assert "precious-runner" not in {r.id for r in app.fold_runner_snapshots()}
    finally:
        app.close()
    assert application_id(path) == SQLITE_APPLICATION_ID
    again = simulate(url)  # now simulate's: a rerun replaces it, and says so
    assert again.exit_code == 0, again.output
    assert f"replacing {path}, a store an earlier simulate created" in again.stderr


def test_a_file_that_is_no_database_is_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not a database\n" * 50)
    refused = simulate(f"sqlite:///{notes}")
    assert refused.exit_code == 2, refused.output
    assert "not a SQLite database" in refused.stderr
    assert notes.read_text().startswith("my notes")


def test_fresh_and_append_together_are_a_usage_error(tmp_path: Path) -> None:
    refused = simulate(f"sqlite:///{tmp_path}/x.db", "--fresh", "--append")
    assert refused.exit_code == 2
    assert "pass one" in refused.stderr
    assert not (tmp_path / "x.db").exists()


def test_fresh_never_drops_the_public_schema() -> None:
    state = StoreState(
        "postgresql://u@h:5432/db", "postgresql", 10, False, ("schema public with 1 tables",),
        schema="public",
    )  # fmt: skip
    with pytest.raises(StoreRefusedError, match="public is never dropped"):
        plan_run(state, fresh=True, append=False)


def comment_on_events(schema: Any) -> str | None:
    with psycopg.connect(schema.server.conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT obj_description(c.oid, 'pg_class') FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
            (schema.name, POSTGRES_EVENTS),
        ).fetchone()
    return None if row is None else row[0]


@pytest.mark.postgres
def test_on_postgresql_the_schema_is_refused_then_dropped_only_with_fresh(
    postgres_schema: Any,
) -> None:
    url = postgres_schema.url()
    events = someone_elses_store(postgres_schema.env())
    refused = simulate(url)
    assert refused.exit_code == 2, refused.output
    assert "that simulate did not write" in refused.stderr
    app = SchedulerApplication(env=postgres_schema.env())
    try:  # untouched: their events only, their runner
        assert app.event_count() == events
        assert [r.id for r in app.fold_runner_snapshots()] == ["precious-runner"]
    finally:
        app.close()
    assert comment_on_events(postgres_schema) is None

    done = simulate(url, "--fresh")
    assert done.exit_code == 0, done.output
    assert f"--fresh: deleting schema {postgres_schema.name} with its" in done.stderr
    assert f"{postgres_schema.name}.{POSTGRES_EVENTS}" in done.stderr
    assert comment_on_events(postgres_schema) == MARK

    again = simulate(url)  # simulate's own: appended to, under a run prefix
    assert again.exit_code == 0, again.output
    assert "appending to" in again.stderr
