"""Opening a store: fast, specific connection errors, and schema creation one at a time.

Before the eventsourcing recorders open their connection pool (whose failures all look
alike and surface only after the pool's timeout), the application connects once, with
the connect timeout, and turns what went wrong into a :class:`StoreUnavailableError`
with a ``reason``: unknown host, refused connection, missing database, refused role,
no answer in time; for SQLite, a file that is not a database or cannot be opened.

On PostgreSQL the same connection then holds an advisory lock while the tables, types
and indexes are created (the event and snapshot stores' and the read models'), so that
replicas that start together never run the same ``CREATE`` statements at the same
moment ("tuple concurrently updated", duplicate ``pg_type`` rows): the first creates
them, the others find them there. The lock is waited for at most
``SECONDBOX_STARTUP_LOCK_TIMEOUT_MS`` (default 30,000): any role that may connect can
take an advisory lock (a red team's read-only audit role held this one and ``serve``
waited the whole hold), so past the timeout the start fails with a
:class:`StoreUnavailableError` (``schema-locked``) naming the holder's pid, role and
``application_name``.
"""

from __future__ import annotations

import sqlite3
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.sql import SQL, Literal

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.store.write_timeouts import milliseconds

DEFAULT_CONNECT_TIMEOUT_SECONDS = 5
STARTUP_LOCK_TIMEOUT_MS = "SECONDBOX_STARTUP_LOCK_TIMEOUT_MS"
DEFAULT_STARTUP_LOCK_TIMEOUT_MS = 30000
REASONS = {
    "unknown-host": "unknown host (the name does not resolve)",
    "connection-refused": "connection refused (is the server running and listening there?)",
    "database-missing": "the database does not exist",
    "authentication-failed": "authentication failed (unknown role, wrong password, or no login)",
    "timeout": "no answer within the connect timeout",
    "not-a-database": "the file is not a SQLite database",
    "cannot-open": "cannot open the database file (missing directory or no permission)",
    "schema-locked": "another session holds the schema's start-up lock past the timeout",
    "unavailable": "the store is unavailable",
}
_POSTGRES_SIGNS = (  # (reason, a fragment of libpq's or the server's message), in order
    ("timeout", "timeout expired"),
    ("unknown-host", "failed to resolve host"),
    ("unknown-host", "could not translate host name"),
    ("unknown-host", "Name or service not known"),
    ("connection-refused", "Connection refused"),
    ("database-missing", 'database "'),
    ("authentication-failed", 'role "'),
    ("authentication-failed", "authentication failed"),
    ("authentication-failed", "not permitted to log in"),
    ("authentication-failed", "no pg_hba.conf entry"),
)


class StoreUnavailableError(SchedulerError):
    """The store cannot be reached or opened; ``reason`` says why (see ``REASONS``)."""

    def __init__(self, reason: str, target: str, detail: str = "") -> None:
        self.reason = reason
        self.target = target
        self.retryable = reason in ("timeout", "connection-refused", "unavailable", "schema-locked")
        message = f"SecondBox scheduler store unavailable: {target}: {REASONS[reason]}"
        super().__init__(f"{message} ({detail})" if detail else message)


def postgres_target(settings: Mapping[str, str]) -> str:
    """Where a PostgreSQL store is, for messages (never its password)."""
    user = settings.get("POSTGRES_USER", "")
    hosts = (settings.get("POSTGRES_HOST") or "").split(",")
    ports = (settings.get("POSTGRES_PORT") or "5432").split(",")
    ports += ports[-1:] * (len(hosts) - len(ports))  # libpq: one port for every host
    places = ",".join(
        f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        for host, port in zip(hosts, ports, strict=False)
    )
    attrs = settings.get("POSTGRES_TARGET_SESSION_ATTRS")
    query = f"?target_session_attrs={attrs}" if attrs else ""
    return f"postgresql://{user}@{places}/{settings.get('POSTGRES_DBNAME', '')}{query}"


def connect_timeout(settings: Mapping[str, str]) -> int:
    value = settings.get("POSTGRES_CONNECT_TIMEOUT", "")
    try:
        return max(1, int(float(value))) if value else DEFAULT_CONNECT_TIMEOUT_SECONDS
    except ValueError:
        return DEFAULT_CONNECT_TIMEOUT_SECONDS


def connect_postgres(settings: Mapping[str, str]) -> psycopg.Connection[tuple[object, ...]]:
    """One connection with the connect timeout, or a StoreUnavailableError saying why."""
    conninfo = make_conninfo(
        host=settings.get("POSTGRES_HOST") or None,
        port=settings.get("POSTGRES_PORT") or None,
        user=settings.get("POSTGRES_USER") or None,
        password=settings.get("POSTGRES_PASSWORD") or None,
        dbname=settings.get("POSTGRES_DBNAME") or None,
        target_session_attrs=settings.get("POSTGRES_TARGET_SESSION_ATTRS") or None,
        connect_timeout=max(2, connect_timeout(settings)),  # libpq's least useful value
    )
    try:
        return psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as error:
        text = str(error)
        password = settings.get("POSTGRES_PASSWORD")
        if password:
            text = text.replace(password, "***")
        reason = next((r for r, sign in _POSTGRES_SIGNS if sign in text), "unavailable")
        detail = " ".join(text.split())
        raise StoreUnavailableError(reason, postgres_target(settings), detail) from None


@contextmanager
def postgres_schema_lock(settings: Mapping[str, str]) -> Iterator[bool]:
    """Check that the server answers, then hold an advisory lock (one per schema) while
    the body creates what is missing. Yields whether this role may create in the schema
    (an application role that may not opens the tables as its owner made them)."""
    schema = settings.get("POSTGRES_SCHEMA") or "public"
    key = zlib.crc32(f"secondbox-scheduler schema {schema}".encode())
    with connect_postgres(settings) as connection:
        row = connection.execute(
            "SELECT has_schema_privilege(n.oid, 'CREATE') FROM pg_namespace n WHERE n.nspname = %s",
            (schema,),
        ).fetchone()
        may_create = row is None or bool(row[0])
        timeout = milliseconds(settings, STARTUP_LOCK_TIMEOUT_MS, DEFAULT_STARTUP_LOCK_TIMEOUT_MS)
        connection.execute(SQL("SET lock_timeout = {}").format(Literal(f"{timeout}ms")))
        try:
            connection.execute("SELECT pg_advisory_lock(%s)", (key,))
        except psycopg.errors.LockNotAvailable:
            holders = advisory_lock_holders(connection, key)
            raise StoreUnavailableError(
                "schema-locked",
                postgres_target(settings),
                f"schema {schema}: held by {holders or 'a session that has ended'}; "
                f"waited {timeout} ms ({STARTUP_LOCK_TIMEOUT_MS})",
            ) from None
        connection.execute("RESET lock_timeout")
        try:
            yield may_create
        finally:
            connection.execute("SELECT pg_advisory_unlock(%s)", (key,))


def advisory_lock_holders(connection: psycopg.Connection[tuple[object, ...]], key: int) -> str:
    """Who holds the advisory lock ``key`` (a bigint key below 2**32) in this database:
    each holder's pid, role and application_name (pg_locks joined with
    pg_stat_activity, which shows them for every role's sessions)."""
    rows = connection.execute(
        "SELECT l.pid, coalesce(a.usename, '?'), coalesce(a.application_name, '') "
        "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 "
        "AND l.objid::bigint = %s AND l.objsubid = 1 "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "ORDER BY l.pid",
        (key,),
    ).fetchall()
    return ", ".join(
        f"pid {pid} (role {role}, application_name {name!r})" for pid, role, name in rows
    )


def check_sqlite(name: str) -> None:
    """Refuse a file that is not a SQLite database (or cannot be opened) before the
    recorders create their tables in it; a missing file is created as usual."""
    if name.startswith("file:") or name == ":memory:":
        return
    try:
        connection = sqlite3.connect(name)
    except sqlite3.Error as error:
        raise StoreUnavailableError("cannot-open", name, str(error)) from None
    try:
        connection.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as error:
        reason = "not-a-database" if "not a database" in str(error) else "cannot-open"
        raise StoreUnavailableError(reason, name, str(error)) from None
    finally:
        connection.close()
