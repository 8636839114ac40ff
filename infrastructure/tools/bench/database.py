"""The fresh database of one ``secondbox-scheduler bench`` run: made and removed by
:func:`bench_database`, the applications' settings for it, and what it runs on
(:func:`machine_info`)."""

from __future__ import annotations

import os
import platform
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from secondbox_scheduler.infrastructure.settings import DATABASE_URL, settings_from_url
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.workers import raw_env

LOCAL_SERVER = {"host": "127.0.0.1", "port": "5432", "user": "postgres", "password": ""}


@dataclass
class FreshDatabase:
    """Where the run writes: ``url`` for the applications, ``shown`` for people."""

    url: str
    shown: str
    backend: str
    drop: Callable[[], None] = field(repr=False)


def _server_settings() -> dict[str, str]:
    """The local server: POSTGRES_HOST/PORT/USER/PASSWORD if set, else 127.0.0.1:5432."""
    keys = {"host": "POSTGRES_HOST", "port": "POSTGRES_PORT", "user": "POSTGRES_USER"}
    found = {name: os.environ.get(var) or LOCAL_SERVER[name] for name, var in keys.items()}
    found["password"] = os.environ.get("POSTGRES_PASSWORD", "")
    return found


def _conninfo(server: dict[str, str], dbname: str) -> str:
    return make_conninfo(
        dbname=dbname,
        host=server["host"],
        port=server["port"],
        user=server["user"],
        password=server["password"] or None,
        connect_timeout=10,
    )


def _url(server: dict[str, str], dbname: str, schema: str | None = None) -> str:
    password = f":{server['password']}" if server["password"] else ""
    url = f"postgresql://{server['user']}{password}@{server['host']}:{server['port']}/{dbname}"
    return url + (f"?schema={schema}" if schema else "")


@contextmanager
def bench_database(database_url: str | None, stamp: str, *, keep: bool) -> Iterator[FreshDatabase]:
    """A database nobody else writes to, removed at the end unless ``keep``.

    - no URL: a new database ``bench_<stamp>`` on the local PostgreSQL server;
    - a ``postgresql://`` URL: a new schema ``bench_<stamp>`` in that database;
    - a ``sqlite:///`` URL: a file that must not exist yet (and its ``-raw`` sibling).
    """
    name = f"bench_{stamp}"
    if database_url is None:
        server = _server_settings()
        admin = _conninfo(server, "postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

        def drop_database() -> None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )

        url = _url(server, name)
        fresh = FreshDatabase(
            url, _url({**server, "password": ""}, name), "postgresql", drop_database
        )
    else:
        settings = settings_from_url(database_url)
        if settings["PERSISTENCE_MODULE"] == "eventsourcing.sqlite":
            fresh = _fresh_sqlite(database_url, settings["SQLITE_DBNAME"])
        else:
            server = {
                "host": settings["POSTGRES_HOST"],
                "port": settings["POSTGRES_PORT"],
                "user": settings["POSTGRES_USER"],
                "password": settings["POSTGRES_PASSWORD"],
            }
            dbname = settings["POSTGRES_DBNAME"]
            conninfo = _conninfo(server, dbname)
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))

            def drop_schema() -> None:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(
                        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                    )

            fresh = FreshDatabase(
                _url(server, dbname, name),
                _url({**server, "password": ""}, dbname, name),
                "postgresql",
                drop_schema,
            )
    try:
        yield fresh
    finally:
        if not keep:
            fresh.drop()


def _fresh_sqlite(database_url: str, dbname: str) -> FreshDatabase:
    if dbname.startswith("file:") or dbname == ":memory:":
        raise BenchError("bench needs a SQLite file that worker processes can open, not memory")
    path = Path(dbname)
    raw = Path(raw_env({DATABASE_URL: database_url})["SQLITE_DBNAME"])
    for candidate in (path, raw):
        if candidate.exists():
            raise BenchError(f"{candidate} exists: bench writes a fresh database, give a new path")
    path.parent.mkdir(parents=True, exist_ok=True)

    def remove() -> None:
        for base in (path, raw):
            for suffix in ("", "-wal", "-shm", "-journal"):
                with suppress(FileNotFoundError):
                    Path(str(base) + suffix).unlink()

    return FreshDatabase(database_url, database_url, "sqlite", remove)


def machine_info(fresh: FreshDatabase) -> dict[str, Any]:
    """nproc, memory, CPU model, versions: what the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    database = f"SQLite {sqlite3.sqlite_version}"
    if fresh.backend == "postgresql":
        settings = settings_from_url(fresh.url)
        server = {
            "host": settings["POSTGRES_HOST"],
            "port": settings["POSTGRES_PORT"],
            "user": settings["POSTGRES_USER"],
            "password": settings["POSTGRES_PASSWORD"],
        }
        with psycopg.connect(_conninfo(server, settings["POSTGRES_DBNAME"])) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        database = f"PostgreSQL {row[0] if row else '?'}"
    return {
        "nproc": os.cpu_count(),
        "memory_gib": memory_gib,
        "cpu": cpu,
        "python": platform.python_version(),
        "eventsourcing": metadata.version("eventsourcing"),
        "database": database,
    }


def settle(env: dict[str, str]) -> str:
    """What pgbench does before each run: ``VACUUM (ANALYZE)`` the run's tables, then a
    ``CHECKPOINT``, so that a timed run does not pay for the maintenance the previous
    section left behind (autovacuum and autoanalyze of the tables it filled, the
    full-page writes after a checkpoint it set off). PostgreSQL only (SQLite: nothing);
    a checkpoint the role may not ask for is left out. Returns what was done."""
    found = settings_from_url(env[DATABASE_URL])
    if found.get("PERSISTENCE_MODULE") != "eventsourcing.postgres":
        return "nothing (not PostgreSQL)"
    conninfo = make_conninfo(
        host=found["POSTGRES_HOST"], port=found["POSTGRES_PORT"], user=found["POSTGRES_USER"],
        password=found.get("POSTGRES_PASSWORD") or None, dbname=found["POSTGRES_DBNAME"],
        connect_timeout=10,
    )  # fmt: skip
    schema = found.get("POSTGRES_SCHEMA") or "public"
    with psycopg.connect(conninfo, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY tablename",
                (schema,),
            )
        ]
        if tables:
            names = sql.SQL(", ").join(sql.Identifier(schema, table) for table in tables)
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(names))
        try:
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            return f"VACUUM (ANALYZE) of {len(tables)} tables (no CHECKPOINT: not permitted)"
    return f"VACUUM (ANALYZE) of {len(tables)} tables, CHECKPOINT"
