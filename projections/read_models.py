"""The scheduler's read models: construction, catch-up, rebuild and status.

Both projections keep their rows and their tracking position in the application's own
database. ``catch_up`` reads the notification log after each view's position in pages,
only the topics some projection handles (:func:`handled_topics`), and applies each page
in one transaction with the position the page reaches (exactly once: a replica that
loses the race for a page rolls back and reads the new position). A page's row changes
are folded into one net change per row before they are written
(:mod:`projections.row_changes`); a rebuild reads much bigger pages than the inline
catch-up, so it writes each row about once.
``projections run`` follows the log live with eventsourcing's ``ProjectionRunner``
instead (:func:`projection_runners`).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from eventsourcing.application import Application
from eventsourcing.persistence import IntegrityError, Tracking
from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.projection import Projection, ProjectionRunner
from eventsourcing.sqlite import SQLiteApplicationRecorder
from eventsourcing.utils import resolve_topic, strtobool

from secondbox_scheduler.domain.event_topics import topics_of
from secondbox_scheduler.projections.assignments import (
    AssignmentsProjection,
    AssignmentsView,
    PostgresAssignmentsView,
    SQLiteAssignmentsView,
)
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.event_log import count_events_after
from secondbox_scheduler.projections.notification_reader import gc_paused, read_pages
from secondbox_scheduler.projections.row_changes import NetChanges
from secondbox_scheduler.projections.runner_snapshots import (
    PostgresRunnerSnapshotsView,
    RunnerSnapshotsProjection,
    RunnerSnapshotsView,
    SQLiteRunnerSnapshotsView,
)
from secondbox_scheduler.projections.sql_view import SqlView

PAGE = 1000  # notifications of the handled topics per page (and per transaction)
READ_CHUNK = 5_000  # notifications per query; the next chunk is read ahead
REBUILD_PAGE = 20_000  # a rebuild's pages: fewer, bigger transactions, rows written ~once

PROJECTIONS: dict[str, type[Projection[Any]]] = {
    "runner_snapshots": RunnerSnapshotsProjection,
    "assignments": AssignmentsProjection,
}
VIEWS: dict[str, dict[str, type[SqlView]]] = {
    "eventsourcing.sqlite": {
        "runner_snapshots": SQLiteRunnerSnapshotsView,
        "assignments": SQLiteAssignmentsView,
    },
    "eventsourcing.postgres": {
        "runner_snapshots": PostgresRunnerSnapshotsView,
        "assignments": PostgresAssignmentsView,
    },
}


def handled_topics(projection_class: type[Projection[Any]]) -> tuple[str, ...]:
    """The topics of the events registered on the projection's ``changes``
    (a ``singledispatchmethod``), with their former topics: other events change no row
    and need not be read."""
    changes = inspect.getattr_static(projection_class, "changes")
    registry = changes.dispatcher.registry
    return tuple(sorted(topic for cls in registry if cls is not object for topic in topics_of(cls)))


def supports_read_models(app: Application[Any]) -> bool:
    """Read models live beside the events: SQLite and PostgreSQL, not the in-memory store."""
    return isinstance(app.recorder, (SQLiteApplicationRecorder, PostgresApplicationRecorder))


@dataclass(frozen=True)
class ProjectionStatus:
    name: str
    position: int
    head: int
    lag_events: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "position": self.position,
            "head": self.head,
            "lag_events": self.lag_events,
        }


class ReadModels:
    """The runner snapshots and assignments views of one application's store."""

    def __init__(self, app: Application[Any], *, writes: bool = True) -> None:
        """``writes=False``: this process only reads the read models (another keeps
        them: ``SECONDBOX_READ_MODELS=external``), so its role may hold SELECT alone
        (docs/operations.md); the position rows are made at its first catch-up, if any."""
        if not supports_read_models(app):
            raise TypeError("read models need the SQLite or PostgreSQL store")
        self.app = app
        module = (
            "eventsourcing.postgres"
            if isinstance(app.recorder, PostgresApplicationRecorder)
            else "eventsourcing.sqlite"
        )
        datastore = app.recorder.datastore  # type: ignore[attr-defined]
        self.views: dict[str, SqlView] = {}
        self.projections: dict[str, Projection[Any]] = {}
        for name, view_class in VIEWS[module].items():
            view = view_class(datastore)  # type: ignore[call-arg]
            if strtobool(app.env.get("CREATE_TABLE") or "y"):  # off: a role that may not
                view.create_table()  # type: ignore[attr-defined]  # from the concrete recorder
            if writes:
                view.ensure_position(app.name)
            self.views[name] = view
            self.projections[name] = PROJECTIONS[name](view)
        self._topics_of = {
            name: frozenset(handled_topics(type(projection)))
            for name, projection in self.projections.items()
        }
        self.topics = tuple(sorted(frozenset().union(*self._topics_of.values())))
        self._decode = EventDecoder(app.mapper)  # learns each topic once, for every catch-up
        self._lock = threading.Lock()
        self._positions_ensured = writes

    @property
    def runners(self) -> RunnerSnapshotsView:
        view = self.views["runner_snapshots"]
        assert isinstance(view, RunnerSnapshotsView)
        return view

    @property
    def assignments(self) -> AssignmentsView:
        view = self.views["assignments"]
        assert isinstance(view, AssignmentsView)
        return view

    def position(self, name: str) -> int:
        return self.views[name].max_tracking_id(self.app.name) or 0

    def _pages(
        self, after: int, end: int, page_size: int = PAGE
    ) -> Iterator[tuple[list[tuple[int, str, Any]], int]]:
        """Pages of the handled notifications in (``after``, ``end``], decoded as
        (position, topic, domain event), each with the position it reaches: its last
        notification's, or ``end`` for the last page (the notifications of other topics
        in between are covered too). The last page may be empty: it moves the positions
        to ``end``. Read in chunks of at most ``READ_CHUNK``, the next one read ahead
        while this one is decoded."""
        if after >= end:
            return
        decode = self._decode
        events: list[tuple[int, str, Any]] = []
        size = min(page_size, READ_CHUNK)
        for chunk in read_pages(
            self.app.recorder,
            after=after,
            until=end,
            topics=self.topics,
            page_size=size,
            first_page_size=min(size, PAGE),
            read_ahead=True,
        ):
            events += [(n.id, n.topic, decode(n)) for n in chunk]
            if len(events) >= page_size:
                yield events, events[-1][0]
                events = []
        yield events, end

    def catch_up(
        self,
        until: int | None = None,
        progress: Callable[[int], None] = lambda _: None,
        page_size: int = PAGE,
        *,
        asynchronous_commit: bool = False,
    ) -> int:
        """Apply every notification after each view's position, up to ``until`` (or the
        log's head when the catch-up starts), and move each position there.

        One pass over the log: each page of handled notifications is read and decoded
        once, then applied to each view that has not seen it, in one transaction per view
        with the position the page reaches. ``progress`` is called with how many
        positions each page covered. Returns how many notifications were read (those of
        the handled topics). ``asynchronous_commit``: see :meth:`SqlView.apply`.
        """
        with self._lock:
            if not self._positions_ensured:
                for view in self.views.values():
                    view.ensure_position(self.app.name)
                self._positions_ensured = True
            while True:
                try:
                    return self._catch_up(until, progress, page_size, asynchronous_commit)
                except IntegrityError:
                    continue  # another replica applied a page first: read the new positions

    def _catch_up(
        self,
        until: int | None,
        progress: Callable[[int], None],
        page_size: int,
        asynchronous_commit: bool,
    ) -> int:
        positions = {name: self.position(name) for name in self.views}
        head = self.app.recorder.max_notification_id() or 0
        end = head if until is None else min(until, head)
        after = min(positions.values())
        read = 0
        for events, reached in self._pages(after, end, page_size):
            behind = [name for name in self.views if positions[name] < reached]
            nets = {name: self.views[name].net() for name in behind}
            routes: dict[str, list[tuple[int, NetChanges, Callable[[Any], Any]]]] = {}
            for name in behind:
                handlers = self._handlers(self.projections[name], self._topics_of[name])
                for topic, handler in handlers.items():
                    routes.setdefault(topic, []).append((positions[name], nets[name], handler))
            for position, topic, event in events:  # one pass: each event to its views
                for start, net, handler in routes.get(topic, ()):
                    if position > start:
                        net.extend(handler(event))
            for name in behind:
                net = nets[name]
                self.views[name].apply(
                    net,
                    Tracking(self.app.name, reached),
                    expected=positions[name],
                    asynchronous_commit=asynchronous_commit,
                )
                positions[name] = reached
            read += len(events)
            progress(reached - after)
            after = reached
        return read

    @staticmethod
    def _handlers(
        projection: Projection[Any], topics: frozenset[str]
    ) -> dict[str, Callable[[Any], Any]]:
        """Each handled topic's ``changes`` handler, resolved once per page rather than
        by ``singledispatchmethod`` per event (unless ``changes`` is replaced on the
        instance, as a test does)."""
        if "changes" in vars(projection):
            changes = projection.changes  # type: ignore[attr-defined]
            return dict.fromkeys(topics, changes)
        dispatch = inspect.getattr_static(type(projection), "changes").dispatcher.dispatch
        return {topic: partial(dispatch(resolve_topic(topic)), projection) for topic in topics}

    def wait(self, position: int, timeout: float = 5.0) -> None:
        """Block until every view has applied ``position`` (read-your-writes)."""
        for view in self.views.values():
            view.wait(self.app.name, position, timeout=timeout)

    def status(self) -> list[ProjectionStatus]:

        head = self.app.recorder.max_notification_id() or 0
        statuses = []
        for name in self.views:
            position = self.position(name)
            statuses.append(
                ProjectionStatus(
                    name, position, head, count_events_after(self.app.recorder, position)
                )
            )
        return statuses

    def clear(self) -> None:
        """Forget every row and position (a rebuild then starts from zero)."""
        with self._lock:
            for view in self.views.values():
                view.clear(self.app.name)
                view.ensure_position(self.app.name)


def projection_runners(
    application_class: type[Application[Any]], env: dict[str, str]
) -> list[ProjectionRunner[Any, Any]]:
    """eventsourcing ProjectionRunners that follow the log live, one per projection."""
    module = env.get("PERSISTENCE_MODULE", "")
    if module not in VIEWS:
        raise ValueError(f"projections need SQLite or PostgreSQL, not {module or 'memory'}")
    return [
        ProjectionRunner(
            application_class=application_class,
            projection_class=PROJECTIONS[name],
            view_class=view_class,
            env=env,
        )
        for name, view_class in VIEWS[module].items()
    ]


def timed(operation: Callable[[], int]) -> tuple[int, float]:
    started = time.perf_counter()
    count = operation()
    return count, time.perf_counter() - started


@dataclass
class RebuildReport:
    """A replay of the log (a rebuild from zero, or an audit), beside the raw rate of
    reading the same notifications with the recorder alone."""

    events: int
    seconds: float
    raw_read_seconds: float

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    @property
    def raw_events_per_second(self) -> float:
        return self.events / self.raw_read_seconds if self.raw_read_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "events_per_second": round(self.events_per_second, 1),
            "raw_read_seconds": round(self.raw_read_seconds, 3),
            "raw_read_events_per_second": round(self.raw_events_per_second, 1),
            "ratio_to_raw_read": (
                round(self.events_per_second / self.raw_events_per_second, 3)
                if self.raw_events_per_second
                else None
            ),
        }


def read_raw(
    app: Application[Any],
    progress: Callable[[int], None] = lambda _: None,
    until: int | None = None,
) -> int:
    """Read the notifications (up to ``until``) with the recorder alone, in the pages a
    rebuild or an audit uses: the baseline their rates are compared with."""
    read = 0
    after = 0
    while True:
        page = app.recorder.select_notifications(
            start=after, limit=PAGE, stop=until, inclusive_of_start=False
        )
        if not page:
            return read
        read += len(page)
        progress(len(page))
        after = page[-1].id
        if len(page) < PAGE:
            return read


def rebuild(
    read_models: ReadModels,
    progress: Callable[[int], None] = lambda _: None,
    raw_progress: Callable[[int], None] = lambda _: None,
) -> RebuildReport:
    """Forget the read models and apply the whole log again (up to the head at the
    start), in pages of ``REBUILD_PAGE``; time the raw read of the same notifications
    too. ``events`` counts every notification of that range."""
    head = read_models.app.recorder.max_notification_id() or 0
    events, raw_seconds = timed(lambda: read_raw(read_models.app, raw_progress, until=head))
    read_models.clear()
    with gc_paused():
        _, seconds = timed(
            lambda: read_models.catch_up(
                until=head,
                progress=progress,
                page_size=REBUILD_PAGE,
                asynchronous_commit=True,
            )
        )
    return RebuildReport(events=events, seconds=seconds, raw_read_seconds=raw_seconds)
