"""A gate around the read models' catch-up, shared by the replicas of one store
(PostgreSQL): a replica that finds another's catch-up under way waits for it, briefly,
instead of reading, decoding and folding the same page only to lose it.

Correctness never depends on it: a page is still applied with the position it starts
from locked and checked (``SqlView.apply``), so a catch-up that goes on without the
gate loses a race exactly as before and reads the new positions
(``ReadModels.catch_up``). The gate only spares the work of the page lost: replicas
whose batches all start with a catch-up of the same shared view (the runner snapshots,
before every home decision) lost a fifth to a quarter of their pages that way.

The gate is a session-level advisory lock, taken on a connection of its own (one per
``ReadModels``, whose catch-ups already take turns within the process): never one of
the store's pool, which the catch-up itself reads and writes through. It is taken only
when the catch-up has something to read, tried first without waiting; when another
session holds it, the catch-up waits up to :data:`GATE_WAIT_MS` for it and then reads
the positions again (the other replica's catch-up has usually covered them), whether
or not it was granted. Every failure (no connection, a wait that ran out, a broken
session) means going on without the gate; a connection whose unlock failed is closed,
so that its lock ends with its session, and after a reconnection of the store the
session is made anew (``SchedulerApplication.forget_cached``). The key is a 64-bit
digest of the events table's schema and name and the application's name, so two stores
in one database never share a gate. SQLite (one writer at a time) and the in-memory store: no gate.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from eventsourcing.postgres import PostgresAggregateRecorder
from psycopg import pq
from psycopg.sql import SQL, Literal

log = logging.getLogger(__name__)

GATE_WAIT_MS = 100  # longest wait for another replica's catch-up before going on without
LOCK_NOT_AVAILABLE = b"55P03"  # SQLSTATE of a lock not granted within lock_timeout


def pool_connection_kwargs(pool: Any) -> dict[str, Any]:
    """The connection arguments of a store's pool (its kwargs, called when a function,
    without its row factory; the password from its password function, when it has one)
    for a connection of one's own beside the pool (the gate's, the runner locks')."""
    stored = pool.kwargs
    stored = stored() if callable(stored) else stored or {}
    kwargs = {k: v for k, v in stored.items() if k != "row_factory"}
    password = getattr(pool, "get_password_func", None)
    if callable(password):
        kwargs["password"] = password()
    return kwargs


def gate_key(namespace: str, application_name: str) -> int:
    """The advisory lock key of a store's catch-up: a signed 64-bit digest."""
    text = f"{namespace}\x00read models catch-up\x00{application_name}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


class CatchUpGate:
    """The advisory lock a catch-up holds while it reads and applies its pages."""

    def __init__(self, recorder: object, application_name: str) -> None:
        self.recorder = recorder if isinstance(recorder, PostgresAggregateRecorder) else None
        self.key = 0
        if self.recorder is not None:
            datastore = self.recorder.datastore
            namespace = f"{datastore.schema}.{self.recorder.events_table_name}"
            self.key = gate_key(namespace, application_name)
        self._connection: psycopg.Connection[Any] | None = None

    @contextmanager
    def held(self, needed: bool = True) -> Iterator[bool]:
        """Hold the gate for the block when ``needed`` (and the store has one); yields
        whether another session held it (the positions read before may have moved)."""
        connection = self._connect() if needed and self.recorder is not None else None
        if connection is None:
            yield False
            return
        taken, waited = self._take(connection)
        try:
            yield waited
        finally:
            if taken:
                self._release(connection)

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def reset(self) -> None:
        """A new session on next use (the store reconnected to another server: the old
        session, and its lock, are gone); the old one closes in the background."""
        connection, self._connection = self._connection, None
        if connection is not None:
            threading.Thread(target=connection.close, daemon=True).start()

    def _take(self, connection: psycopg.Connection[Any]) -> tuple[bool, bool]:
        """(taken, waited): tried at once, then waited for up to GATE_WAIT_MS."""
        try:
            if self._exec(connection, f"SELECT pg_try_advisory_lock({self.key})") == b"t":
                return True, False
            taken = self._exec(connection, f"SELECT pg_advisory_lock({self.key})")
        except psycopg.Error as error:
            log.info("catch-up gate not taken (%s): catching up without", error)
            self.close()
            return False, True
        return taken is not None, True  # None: a long catch-up of another's, not waited out

    def _release(self, connection: psycopg.Connection[Any]) -> None:
        try:
            self._exec(connection, f"SELECT pg_advisory_unlock({self.key})")
        except psycopg.Error:
            self.close()  # its session's end releases the lock
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _exec(connection: psycopg.Connection[Any], statement: str) -> bytes | None:
        """One statement of a single value (the key is an integer of ours, written in
        the text) on the idle autocommit session, through libpq: a catch-up takes and
        releases the gate each time, and psycopg's cursor costs several times the round
        trip. The value, or None when the lock was not granted within the timeout; any
        other failure raises ``psycopg.OperationalError``."""
        result = connection.pgconn.exec_(statement.encode())
        if result.status == pq.ExecStatus.TUPLES_OK:
            value = result.get_value(0, 0)
            return bytes(value) if value is not None else None
        if result.error_field(pq.DiagnosticField.SQLSTATE) == LOCK_NOT_AVAILABLE:
            return None
        message = result.error_message.decode(errors="replace") or "no result"
        raise psycopg.OperationalError(message.strip())

    def _connect(self) -> psycopg.Connection[Any] | None:
        """The gate's connection (made on first use, autocommit, with the wait as its
        lock timeout), or None: go on without the gate."""
        if self._connection is not None and not self._connection.closed:
            return self._connection
        assert self.recorder is not None
        kwargs = pool_connection_kwargs(self.recorder.datastore.pool)
        try:
            connection: psycopg.Connection[Any] = psycopg.connect(
                **{**kwargs, "autocommit": True, "connect_timeout": 5}
            )
            connection.execute(SQL("SET lock_timeout = {}").format(Literal(f"{GATE_WAIT_MS}ms")))
        except psycopg.Error as error:
            log.info("no catch-up gate connection (%s): catching up without", error)
            return None
        self._connection = connection
        return connection
