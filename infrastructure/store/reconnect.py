"""Reconnecting after the primary disappears: bounded retry with backoff, then
:class:`~.cell_unavailable.CellUnavailableError`.

A cell's store is one PostgreSQL cluster, a primary and its standbys, named by a
multi-host URL with ``target_session_attrs=read-write`` (docs/operations.md, "Failover"):
libpq tries the hosts in order and keeps the one that takes writes. When the primary
dies, every pooled connection is dead, and the connection pool's own reconnection backs
off for minutes. :class:`Reconnect` sits on the store's connections (the datastore's
``get_connection``, which every recorder, the read models and the snapshot store use):

- a connection lost (SQLSTATE class 08, an administrator's or a crash shutdown, a
  read-only session on a demoted primary, a pool that could not connect in time) marks
  the store down and is raised as before (the library's recorders retry it);
- while the store is down, the next connection first waits for a writable server: it
  connects once (the URL's hosts in order, within the connect timeout) and, failing,
  backs off (full jitter, 50 ms doubling to 1 s) and tries again, for at most
  ``SECONDBOX_RECONNECT_SECONDS`` (default: the connect timeout) after the loss;
- a server found: the pool is replaced by a fresh one (the old one's connections die
  with it), the application forgets what it cached of the old server (``on_recovered``:
  its aggregates, which after an asynchronous failover can be ahead of the promoted
  log: a command must decide on what the new primary holds), and the command goes on;
- none in time: :class:`CellUnavailableError` naming the cell (``SECONDBOX_CELL``; a
  store that is no cell: ``StoreUnavailableError``, reason ``unavailable``), at
  once for every later call too, each of which tries one connection first (callers that
  waited while another tried take its answer), so that the store is found again as soon
  as it is back.

An interrupted command is answered as a serial execution would answer it: its
transaction committed or not, and a client's retry sees which (``schedule`` replays the
assignment it fenced; ``release`` and ``mark_running`` repeat as no-ops). Only one
thread waits for the server at a time; the others wait for it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from eventsourcing.persistence import InterfaceError, OperationalError
from eventsourcing.postgres import PostgresDatastore
from psycopg_pool import PoolTimeout

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.startup import (
    StoreUnavailableError,
    connect_postgres,
    connect_timeout,
    postgres_target,
)

RECONNECT_SECONDS = "SECONDBOX_RECONNECT_SECONDS"
BACKOFF_BASE_SECONDS = 0.05
BACKOFF_CAP_SECONDS = 1.0
# SQLSTATEs of a session that is gone or may not write: connection exceptions (class
# 08), admin_shutdown, crash_shutdown, cannot_connect_now, read_only_sql_transaction
LOST_STATES = ("57P01", "57P02", "57P03", "25006")
log = logging.getLogger("secondbox_scheduler.store")


def connection_lost(error: BaseException) -> bool:
    """Whether ``error`` (the library's, or psycopg's under it) is a lost or read-only
    session rather than a statement's own failure (a lock timeout, a constraint)."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, psycopg.Error):
        cause = cause.__cause__
    if cause is None:
        return isinstance(error, InterfaceError)
    if isinstance(cause, PoolTimeout):
        return True
    state = cause.sqlstate
    if state is None:
        return isinstance(cause, (psycopg.OperationalError, psycopg.InterfaceError))
    return state.startswith("08") or state in LOST_STATES


def reconnect_budget(env: Mapping[str, Any]) -> float:
    """``SECONDBOX_RECONNECT_SECONDS`` (0 to 600), else the connect timeout."""
    value = env.get(RECONNECT_SECONDS) or ""
    settings = {"POSTGRES_CONNECT_TIMEOUT": env.get("POSTGRES_CONNECT_TIMEOUT") or ""}
    try:
        seconds = float(value) if value else float(connect_timeout(settings))
    except ValueError:
        seconds = float(connect_timeout(settings))
    return min(max(seconds, 0.0), 600.0)


class Reconnect:
    """The reconnection policy of one store (see the module's docstring)."""

    def __init__(
        self,
        datastore: PostgresDatastore,
        settings: Mapping[str, str],
        cell: str | None,
        budget: float,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.datastore = datastore
        self.settings = dict(settings)
        self.cell = cell
        self.budget = budget
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._last_probe = -1e9
        self._last_error = ""
        self.reconnects = 0  # fresh pools after a loss (for tests and metrics)
        # called after a fresh pool, before the command goes on: what the application
        # holds in memory of the lost server (its aggregate cache) is forgotten
        self.on_recovered: list[Callable[[], None]] = []
        self._original: Callable[[], AbstractContextManager[Any]] = datastore.get_connection
        datastore.get_connection = self.get_connection  # type: ignore[method-assign]

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @contextmanager
    def get_connection(self) -> Iterator[Any]:
        if self._down_since is not None:
            self._await_primary()
        try:
            with self._original() as connection:
                yield connection
        except (OperationalError, InterfaceError) as error:
            if connection_lost(error):
                self.lost(error)
            raise

    def ready(self) -> None:
        """Wait for a writable server if the store is known to be down (as the next
        connection would): CellUnavailableError if none comes in time."""
        if self._down_since is not None:
            self._await_primary()

    def lost(self, error: BaseException) -> None:
        if self._down_since is None:
            self._down_since = self._clock()
            self._last_error = " ".join(str(error).split())[:300]
            log.warning("%s: store connection lost (%s)", self._name, self._last_error)

    def _probe(self) -> bool:
        self._last_probe = self._clock()
        try:
            connect_postgres(self.settings).close()
        except StoreUnavailableError as error:
            self._last_error = str(error)
            return False
        return True

    def _await_primary(self) -> None:
        arrived = self._clock()
        with self._lock:
            down_since = self._down_since
            if down_since is None:  # another thread found it while this one waited
                return
            deadline = down_since + self.budget
            attempt = 0
            while True:
                now = self._clock()
                if now >= deadline and self._last_probe >= arrived:
                    raise self._unavailable()  # another thread tried since this one came
                if self._probe():
                    self._recovered()
                    return
                now = self._clock()
                if now >= deadline:
                    raise self._unavailable()
                ceiling = min(BACKOFF_BASE_SECONDS * 2.0 ** min(attempt, 10), BACKOFF_CAP_SECONDS)
                self._sleep(min(self._rng.uniform(0.0, ceiling), deadline - now))
                attempt += 1

    @property
    def _name(self) -> str:
        return "store" if self.cell is None else f"cell {self.cell!r}"

    def _unavailable(self) -> SchedulerError:
        """CellUnavailableError naming the cell; a store that is no cell (no
        ``SECONDBOX_CELL``): StoreUnavailableError, as before any reconnection."""
        detail = f"no writable server for {self.budget:g} s: {self._last_error}"
        target = postgres_target(self.settings)
        if self.cell is None:
            return StoreUnavailableError("unavailable", target, detail)
        return CellUnavailableError(self.cell, detail, target=target)

    def _recovered(self) -> None:
        """A writable server answers: a fresh pool (the old one's connections are of
        the lost server, and its own reconnection may be backing off for minutes)."""
        old = self.datastore.pool
        self.datastore.pool = fresh_pool(old)
        for forget in self.on_recovered:
            forget()
        self._down_since = None
        self.reconnects += 1
        log.warning("%s: store reconnected", self._name)
        threading.Thread(target=old.close, kwargs={"timeout": 1.0}, daemon=True).start()


def fresh_pool(old: Any) -> Any:
    """A new, unopened pool configured as ``old`` (the datastore opens it on first use)."""
    return type(old)(
        old.conninfo, connection_class=old.connection_class, kwargs=old.kwargs,
        min_size=old.min_size, max_size=old.max_size, open=False, configure=old._configure,
        check=old._check, reset=old._reset, timeout=old.timeout, max_waiting=old.max_waiting,
        max_lifetime=old.max_lifetime, max_idle=old.max_idle,
        reconnect_timeout=old.reconnect_timeout, num_workers=old.num_workers,
        get_password_func=old.get_password_func,
    )  # fmt: skip


def install_reconnect(datastore: Any, env: Mapping[str, Any], cell: str | None) -> Reconnect | None:
    """Put the reconnection policy on a PostgreSQL datastore (None for other stores), and
    the URL's ``target_session_attrs`` and the connect timeout on its connections."""
    if not isinstance(datastore, PostgresDatastore):
        return None
    settings = {
        key: env.get(key) or ""
        for key in (
            "POSTGRES_HOST", "POSTGRES_PORT", "POSTGRES_USER", "POSTGRES_PASSWORD",
            "POSTGRES_DBNAME", "POSTGRES_CONNECT_TIMEOUT", "POSTGRES_TARGET_SESSION_ATTRS",
        )
    }  # fmt: skip
    kwargs = datastore.pool.kwargs
    if isinstance(kwargs, dict):
        kwargs.setdefault("connect_timeout", max(2, connect_timeout(settings)))
        if settings["POSTGRES_TARGET_SESSION_ATTRS"]:
            kwargs["target_session_attrs"] = settings["POSTGRES_TARGET_SESSION_ATTRS"]
    return Reconnect(datastore, settings, cell, reconnect_budget(env))
