"""A set of cells' applications: each built when a command first needs it, and again
after a failed attempt; each cell's calls on threads of its own, with a deadline.

A cell's application is built lazily (a router started before one of its cells answers,
or before its database exists, serves it once it does) and a cell whose last call failed
is probed (one connection, the connect timeout) before its next one. :meth:`CellSet.call`
runs an operation on the cell's own threads (with the caller's context: its actor);
past the deadline (the connect timeout) the cell is probed, and a failed probe answers
:class:`CellUnavailableError` at once while the operation ends on its own (an
interrupted command: retrying it gets the serial answer, as after any lost answer). So
a down cell's commands fail within about twice the connect timeout instead of riding
out the store's own retries (ten, each waiting up to the connect timeout for a
connection), and never hold another cell's threads. :meth:`CellSet.across` asks every
cell at once. :class:`~.router.CellRouter` adds the routing.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Self, TypeVar

import psycopg
from eventsourcing.persistence import InterfaceError, OperationalError

from secondbox_scheduler.infrastructure.application import SchedulerApplication, system_now
from secondbox_scheduler.infrastructure.cells.config import Cell, CellsConfig
from secondbox_scheduler.infrastructure.settings import CELL, DATABASE_URL
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.startup import (
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    StoreUnavailableError,
)

T = TypeVar("T")
CELL_THREADS = 64  # a cell's commands at once (the batcher batches what arrives together)
# What a cell's store failing looks like from under a command.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    StoreUnavailableError,
    OperationalError,
    InterfaceError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
)

ApplicationFactory = Callable[[Cell], SchedulerApplication]


@dataclass(frozen=True)
class CellRow(Generic[T]):
    """One row of a read over every cell, naming its cell."""

    cell: str
    value: T


@dataclass(frozen=True)
class AcrossCells(Generic[T]):
    """A read over every cell: the rows of the cells that answered, in the cells file's
    order, and the error of each cell that did not."""

    rows: tuple[CellRow[T], ...]
    unavailable: Mapping[str, CellUnavailableError]

    @property
    def values(self) -> list[T]:
        return [row.value for row in self.rows]


class CellSet:
    """The cells' applications, each built when first needed (module doc)."""

    def __init__(
        self,
        config: CellsConfig,
        *,
        env: Mapping[str, str] | None = None,
        now: Callable[[], datetime] | None = None,
        application_factory: ApplicationFactory | None = None,
    ) -> None:
        """``env``: settings every cell's application gets (its ``SECONDBOX_DATABASE_URL``
        is the cell's); ``application_factory``: how to build a cell's application
        (tests, embedders)."""
        self.config = config
        self._env = dict(env or {})
        self._now = now or system_now
        self._factory = application_factory or self._application_of
        self._apps: dict[str, SchedulerApplication] = {}
        self._locks = {name: threading.Lock() for name in config.names}
        self._suspect: set[str] = set()  # cells whose last call failed: probed first
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(config.cells)), thread_name_prefix="cells"
        )
        self._executors = {
            name: ThreadPoolExecutor(max_workers=CELL_THREADS, thread_name_prefix=f"cell-{name}")
            for name in config.names
        }
        self._deadline = float(
            self._env.get("POSTGRES_CONNECT_TIMEOUT") or DEFAULT_CONNECT_TIMEOUT_SECONDS
        )
        self._closed = False
        self._hooks: list[Callable[[str, SchedulerApplication], object]] = []

    # -- the cells' applications -------------------------------------------------------

    def setting(self, name: str) -> str | None:
        """A setting every cell's application gets (the router's ``env``, else the
        process environment), e.g. ``SECONDBOX_READY_MAX_LAG``."""
        return self._env.get(name) or os.environ.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return self.config.names

    def _application_of(self, cell: Cell) -> SchedulerApplication:
        return SchedulerApplication(
            env={**self._env, DATABASE_URL: cell.database_url, CELL: cell.name}, now=self._now
        )

    def application(self, cell: str) -> SchedulerApplication:
        """The application of ``cell``, built now if it is not yet (or if building it
        failed before); CellUnavailableError when its store cannot be reached."""
        app = self._apps.get(cell)
        if app is not None and cell not in self._suspect:
            return app
        spec = self.config.cell(cell)
        with self._locks[cell]:
            app = self._apps.get(cell)
            if app is None:
                if self._closed:
                    raise CellUnavailableError(cell, "the router is closed")
                try:
                    app = self._factory(spec)
                except UNAVAILABLE as error:
                    raise self._unavailable(cell, error) from None
                for hook in self._hooks:
                    hook(cell, app)
                self._apps[cell] = app
                self._suspect.discard(cell)
            elif cell in self._suspect:
                try:
                    app.probe_store()
                except UNAVAILABLE as error:
                    raise self._unavailable(cell, error) from None
                self._suspect.discard(cell)
        return app

    def when_opened(self, hook: Callable[[str, SchedulerApplication], object]) -> None:
        """Call ``hook(cell, application)`` for every application built so far and, from
        now on, for each one built (before any command uses it): the service exports
        each cell's metrics from its first command. Every cell's lock is held meanwhile,
        so no application is built between the two and none is hooked twice."""
        with ExitStack() as held:
            for cell in self.names:
                held.enter_context(self._locks[cell])
            self._hooks.append(hook)
            for cell, app in self._apps.items():
                hook(cell, app)

    def applications(self) -> dict[str, SchedulerApplication]:
        """The applications built so far, by cell."""
        return dict(self._apps)

    def _unavailable(self, cell: str, error: BaseException) -> CellUnavailableError:
        self._suspect.add(cell)
        detail = f"{type(error).__name__}: {error}".strip()
        return CellUnavailableError(cell, detail)

    def call(self, cell: str, operation: Callable[[SchedulerApplication], T]) -> T:
        """``operation`` on ``cell``'s application; its store failing is a
        CellUnavailableError naming the cell. The operation runs on a thread of the
        cell's own (with the caller's context: its actor); past the deadline (the
        connect timeout) the cell is probed, and a probe that fails answers
        CellUnavailableError at once, while the operation ends on its own (an
        interrupted command: retrying it gets the serial answer, as after any lost
        answer)."""
        app = self.application(cell)
        context = contextvars.copy_context()
        future = self._executors[cell].submit(context.run, operation, app)
        try:
            try:
                return future.result(timeout=self._deadline)
            except FutureTimeout:
                app.probe_store()  # the cell answers: the operation is only slow
                return future.result()
        except CellUnavailableError:
            self._suspect.add(cell)  # the store's reconnection gave up: probe it next
            raise
        except UNAVAILABLE as error:
            raise self._unavailable(cell, error) from None

    def across(
        self, operation: Callable[[SchedulerApplication], T], cells: Iterable[str] | None = None
    ) -> AcrossCells[T]:
        """``operation`` on every cell (or on ``cells``) at once: the answers, and the
        error of each cell that was unavailable (any other error is raised)."""
        names = list(self.names if cells is None else cells)
        futures = {name: self._pool.submit(self.call, name, operation) for name in names}
        rows: list[CellRow[T]] = []
        unavailable: dict[str, CellUnavailableError] = {}
        for name in names:
            try:
                rows.append(CellRow(name, futures[name].result()))
            except CellUnavailableError as error:
                unavailable[name] = error
        return AcrossCells(tuple(rows), unavailable)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        for name in list(self._apps):
            with self._locks[name]:
                app = self._apps.pop(name, None)
            if app is not None:
                app.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LazyApplication:
    """Stands for one cell's application, built when first used (its attributes are the
    application's, looked up at each use): what needs an application before its cell may
    answer (the access tokens of a service over cells) holds this."""

    def __init__(self, router: CellSet, cell: str) -> None:
        self._router = router
        self._cell = cell

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router.application(self._cell), name)
