"""Where ``simulate`` may write: never into a store it did not create, and never a
deletion it did not say.

``simulate`` marks the stores it creates: a SQLite file by its header's
``application_id`` (:data:`SQLITE_APPLICATION_ID`), a PostgreSQL store by a comment on
its events table (:data:`MARK`). Before a run, :func:`inspect_store` reads the store
(read-only: a SQLite file is opened ``mode=ro``, PostgreSQL is only queried) and
:func:`plan_run` decides, by docs/operations.md ("simulate and the store it writes"):

- no store, or a store without events: simulate creates it (and marks it);
- a store simulate created: a SQLite file is replaced (deleted, then written again: the
  run is reproducible), a PostgreSQL store is appended to under a run prefix; with
  ``--append`` a SQLite file is appended to as well;
- any other store that holds events: refused (:class:`StoreRefusedError`, a usage error,
  exit 2), unless ``--fresh``: then what it deletes is said first (the SQLite file and
  its journal files; on PostgreSQL the schema the URL names, dropped and created again,
  never ``public``), and the new store is simulate's.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from psycopg import sql

from secondbox_scheduler.infrastructure.exit_codes import CommandError
from secondbox_scheduler.infrastructure.settings import (
    POSTGRES_MODULE,
    redact_url,
    settings_from_url,
    sqlite_path,
)
from secondbox_scheduler.infrastructure.store.startup import connect_postgres

MARK = "created by secondbox-scheduler simulate"
SQLITE_APPLICATION_ID = 0x53425349  # "SBSI": the SQLite header's application_id
SQLITE_EVENTS = "stored_events"
POSTGRES_EVENTS = "schedulerapplication_events"
JOURNALS = ("", "-wal", "-shm", "-journal")

REPLACE = "replace"  # delete the store simulate created, write it again
APPEND = "append"  # write beside what is there, ids under a run prefix
CREATE = "create"  # a new (or empty) store
FRESH = "fresh"  # --fresh: delete whatever is there, then create


class StoreRefusedError(CommandError):
    """A store that simulate may not write into (a usage error: name another store, or
    pass ``--fresh``)."""


@dataclass(frozen=True)
class StoreState:
    """What a store holds, read before a run."""

    where: str  # the store, for people (a path, or a URL without its password)
    kind: str  # "sqlite", "postgresql" or "memory"
    events: int  # its events (the log's head position on PostgreSQL); 0: empty or absent
    by_simulate: bool  # marked as created by simulate
    contents: tuple[str, ...]  # what --fresh deletes: files, or the tables of the schema
    readable: bool = True  # False: a file that is not a SQLite database
    schema: str = ""  # PostgreSQL: the schema the URL names ("public" when none)

    @property
    def held(self) -> str:
        if not self.readable:
            return "not a SQLite database"
        if self.kind == "postgresql":
            return f"events up to log position {self.events:,}"
        return f"{self.events:,} events"


@dataclass(frozen=True)
class RunPlan:
    """What a run does with the store, and the line it says about it first (or "")."""

    action: str
    note: str


def inspect_store(database_url: str) -> StoreState:
    """What the store of ``database_url`` holds, without writing to it."""
    path = sqlite_path(database_url)
    if path is not None:
        return _inspect_sqlite(path)
    settings = settings_from_url(database_url)
    if settings.get("PERSISTENCE_MODULE") == POSTGRES_MODULE:
        return _inspect_postgres(database_url, settings)
    return StoreState(redact_url(database_url), "memory", 0, False, ())  # always new


def plan_run(state: StoreState, *, fresh: bool, append: bool) -> RunPlan:
    """What a run may do with the store (see the module's docstring)."""
    if fresh and append:
        raise StoreRefusedError("--fresh deletes the store and --append keeps it: pass one")
    if fresh:
        if not state.contents:
            return RunPlan(CREATE, "")
        if state.kind == "postgresql" and state.schema == "public":
            raise StoreRefusedError(
                f"--fresh on PostgreSQL drops the schema the URL names, and {state.where} "
                "names none (public is never dropped): add ?schema=NAME, or use an empty "
                "database"
            )
        return RunPlan(FRESH, f"--fresh: deleting {_what(state)}")
    if state.events == 0 and state.readable:
        return RunPlan(CREATE, "")
    if not state.by_simulate:
        raise StoreRefusedError(
            f"{state.where} holds {state.held} that simulate did not write: simulate never "
            "deletes or writes into a store it did not create. Name a new store with "
            f"--database-url, or pass --fresh to delete {_what(state)} first"
        )
    if append or state.kind == "postgresql":
        return RunPlan(
            APPEND,
            f"appending to {state.where}, a store an earlier simulate created "
            f"({state.events:,} events; this run's ids get a run prefix)",
        )
    return RunPlan(
        REPLACE,
        f"replacing {state.where}, a store an earlier simulate created "
        f"({state.events:,} events; --append keeps them)",
    )


def delete_store(database_url: str) -> None:
    """Delete the store: the SQLite file and its journals, or the PostgreSQL schema the
    URL names (dropped with everything in it, then created again, empty)."""
    path = sqlite_path(database_url)
    if path is not None:
        for suffix in JOURNALS:
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    settings = settings_from_url(database_url)
    schema = settings.get("POSTGRES_SCHEMA") or "public"
    if schema == "public":  # plan_run refuses it first; never dropped, whatever the caller
        raise StoreRefusedError("the public schema is never dropped")
    with connect_postgres(settings) as conn:
        name = sql.Identifier(schema)
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(name))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(name))


def mark_store(database_url: str, create_tables: Callable[[], None]) -> None:
    """Mark the store as created by simulate; ``create_tables`` first makes the tables
    of a PostgreSQL store (the mark is a comment on its events table)."""
    path = sqlite_path(database_url)
    if path is not None:
        with sqlite3.connect(path) as conn:
            conn.execute(f"PRAGMA application_id = {SQLITE_APPLICATION_ID}")
        return
    settings = settings_from_url(database_url)
    if settings.get("PERSISTENCE_MODULE") != POSTGRES_MODULE:
        return
    create_tables()
    table = sql.Identifier(settings.get("POSTGRES_SCHEMA") or "public", POSTGRES_EVENTS)
    with connect_postgres(settings) as conn:
        conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(table, sql.Literal(MARK)))


def _what(state: StoreState) -> str:
    listed = ", ".join(state.contents[:12])
    more = len(state.contents) - 12
    if more > 0:
        listed += f" and {more} more"
    return f"{listed} ({state.held})"


def _inspect_sqlite(path: Path) -> StoreState:
    where = str(path)
    contents = tuple(f"{path}{suffix}" for suffix in JOURNALS if Path(f"{path}{suffix}").exists())
    if not path.exists():
        return StoreState(where, "sqlite", 0, False, contents)
    try:
        conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
        try:
            (application_id,) = conn.execute("PRAGMA application_id").fetchone()
            found = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (SQLITE_EVENTS,)
            ).fetchone()
            events = 0
            if found:
                (events,) = conn.execute(f"SELECT count(*) FROM {SQLITE_EVENTS}").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError:  # not a database (or a journal left without it)
        return StoreState(where, "sqlite", 0, False, contents, readable=False)
    marked = application_id == SQLITE_APPLICATION_ID
    return StoreState(where, "sqlite", int(events), marked, contents)


def _inspect_postgres(database_url: str, settings: Mapping[str, str]) -> StoreState:
    schema = settings.get("POSTGRES_SCHEMA") or "public"
    where = redact_url(database_url)
    with connect_postgres(settings) as conn:
        tables = tuple(
            f"{schema}.{name}"
            for (name,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY tablename",
                (schema,),
            ).fetchall()
        )
        if f"{schema}.{POSTGRES_EVENTS}" not in tables:
            contents = _schema_contents(schema, tables)
            return StoreState(where, "postgresql", 0, False, contents, schema=schema)
        table = sql.Identifier(schema, POSTGRES_EVENTS)
        head = conn.execute(
            sql.SQL("SELECT coalesce(max(notification_id), 0) FROM {}").format(table)
        ).fetchone()
        comment = conn.execute(
            "SELECT obj_description(c.oid, 'pg_class') FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, POSTGRES_EVENTS),
        ).fetchone()
    events = head[0] if head and isinstance(head[0], int) else 0
    marked = comment is not None and comment[0] == MARK
    contents = _schema_contents(schema, tables)
    return StoreState(where, "postgresql", events, marked, contents, schema=schema)


def _schema_contents(schema: str, tables: tuple[str, ...]) -> tuple[str, ...]:
    if not tables:
        return ()
    return (f"schema {schema} with its {len(tables)} tables", *tables)
