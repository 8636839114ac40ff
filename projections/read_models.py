"""The scheduler's read models: construction, catch-up, rebuild and status.

Both projections keep their rows and their tracking position in the application's own
database. ``catch_up`` reads the notification log after each view's position in pages,
all but the topics every projection ignores (:func:`ignored_topics`), decodes those some
projection handles (:func:`handled_topics`), and applies each page in one transaction
with the position the page reaches (exactly once: a replica that loses the race for a
page rolls back and reads the new position). A notification of a topic a projection
neither handles nor ignores (an event class it does not know) is not decoded; it is
counted for that projection, once its page is applied, and :meth:`ReadModels.status`
shows the counts (:mod:`projections.unknown_events`). A tracking position beyond the
log's head (tampered with) is an error, :class:`ReadModelAheadError`, raised by the
catch-up and reported by :meth:`ReadModels.status`. A page's row changes
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
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from eventsourcing.application import Application
from eventsourcing.persistence import IntegrityError, Tracking
from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.projection import ProjectionRunner
from eventsourcing.sqlite import SQLiteApplicationRecorder
from eventsourcing.utils import resolve_topic, strtobool

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.projections.assignments import (
    AssignmentsProjection,
    AssignmentsView,
    PostgresAssignmentsView,
    SQLiteAssignmentsView,
)
from secondbox_scheduler.projections.catch_up_gate import CatchUpGate
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
from secondbox_scheduler.projections.sql_view import SqlProjection, SqlView
from secondbox_scheduler.projections.unknown_events import topics_of_classes

PAGE = 1000  # notifications not ignored per page (and per transaction)
READ_CHUNK = 5_000  # notifications per query; the next chunk is read ahead
REBUILD_PAGE = 20_000  # a rebuild's pages: fewer, bigger transactions, rows written ~once

PROJECTIONS: dict[str, type[SqlProjection[Any]]] = {
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


def handled_topics(projection_class: type[SqlProjection[Any]]) -> tuple[str, ...]:
    """The topics of the events registered on the projection's ``changes``
    (a ``singledispatchmethod``), with their former topics: they are decoded."""
    return tuple(sorted(topics_of_classes(projection_class.handled_events())))


def ignored_topics(projection_class: type[SqlProjection[Any]]) -> tuple[str, ...]:
    """The topics of the events the projection ignores, with their former topics: those
    that every projection ignores need not be read."""
    return tuple(sorted(topics_of_classes(projection_class.IGNORED)))


def supports_read_models(app: Application[Any]) -> bool:
    """Read models live beside the events: SQLite and PostgreSQL, not the in-memory store."""
    return isinstance(app.recorder, (SQLiteApplicationRecorder, PostgresApplicationRecorder))


class ReadModelAheadError(SchedulerError):
    """A read model's tracking position lies beyond the log's head: it claims to have
    applied events that were never written. Only a tampered tracking table (or the
    tables of another log) gets there; catching up past it would apply nothing, so the
    read model would stop silently. Rebuild it (``projections rebuild``)."""

    retryable = False

    def __init__(self, name: str, position: int, head: int) -> None:
        self.name, self.position, self.head = name, position, head
        super().__init__(f"SecondBox scheduler read model {name!r}: {ahead_text(position, head)}")


def ahead_text(position: int, head: int) -> str:
    return (
        f"tracking position {position:,} is beyond the log's head {head:,} (tampered "
        "with, or the tables of another log): rebuild it (secondbox-scheduler projections "
        "rebuild)"
    )


@dataclass(frozen=True)
class ProjectionStatus:
    name: str
    position: int
    head: int
    lag_events: int
    # events of classes the projection does not know, met by this process, by topic
    unknown_events: Mapping[str, int] = field(default_factory=dict)
    # why the read model cannot be trusted (its position beyond the head), or None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "position": self.position,
            "head": self.head,
            "lag_events": self.lag_events,
            "unknown_events": dict(self.unknown_events),
            "error": self.error,
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
        self.projections: dict[str, SqlProjection[Any]] = {}
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
        self._ignored_of = {
            name: frozenset(ignored_topics(type(projection)))
            for name, projection in self.projections.items()
        }
        decoded: frozenset[str] = frozenset().union(*self._topics_of.values())
        self._decoded = decoded
        self.topics = tuple(sorted(decoded))  # handled by some projection: decoded
        # ignored by every projection: not read
        self.skipped = tuple(sorted(frozenset.intersection(*self._ignored_of.values())))
        self._decode = EventDecoder(app.mapper)  # learns each topic once, for every catch-up
        self._lock = threading.Lock()
        self._positions_ensured = writes
        self._end = 0  # the end of the catch-up under way (held by ``self._lock``)
        self._gate = CatchUpGate(app.recorder, app.name)  # other replicas' catch-ups

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
        self,
        after: int,
        end: int,
        page_size: int = PAGE,
        names: Collection[str] | None = None,
    ) -> Iterator[tuple[list[tuple[int, str, Any]], int]]:
        """Pages of the notifications in (``after``, ``end``] that some projection does
        not ignore, as (position, topic, domain event), each with the position it reaches:
        its last notification's, or ``end`` for the last page (the notifications of other
        topics in between are covered too). The event is decoded when some projection
        handles its topic, else it is None (an unknown topic, which may not resolve). The
        last page may be empty: it moves the positions to ``end``. Read in chunks of at
        most ``READ_CHUNK``, the next one read ahead while this one is decoded.
        ``names``: of these projections only (the topics all of them ignore not read,
        those one of them handles decoded)."""
        if after >= end:
            return
        decode, decoded, skipped = self._decode, self._decoded, self.skipped
        if names is not None and set(names) != set(self.views):
            decoded = frozenset().union(*(self._topics_of[name] for name in names))
            skipped = tuple(
                sorted(frozenset.intersection(*(self._ignored_of[name] for name in names)))
            )
        events: list[tuple[int, str, Any]] = []
        size = min(page_size, READ_CHUNK)
        for chunk in read_pages(
            self.app.recorder,
            after=after,
            until=end,
            excluding=skipped,
            page_size=size,
            first_page_size=min(size, PAGE),
            read_ahead=True,
        ):
            events += [(n.id, n.topic, decode(n) if n.topic in decoded else None) for n in chunk]
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
        views: Collection[str] | None = None,
    ) -> int:
        """Apply every notification after each view's position, up to ``until`` (or the
        log's head when the catch-up starts), and move each position there. ``views``:
        only these (by name), as a home decision needs the runner snapshots alone; the
        others catch up at the next catch-up of theirs.

        One pass over the log: each page of handled notifications is read and decoded
        once, then applied to each view that has not seen it, in one transaction per view
        with the position the page reaches. ``progress`` is called with how many
        positions each page covered. Returns how many notifications were read (those of
        the topics not every projection ignores). ``asynchronous_commit``: see
        :meth:`SqlView.apply`. A view whose position lies beyond the log's head raises
        :class:`ReadModelAheadError` (nothing is applied): a catch-up never skips silently.
        """
        with self._lock:
            if not self._positions_ensured:
                for view in self.views.values():
                    view.ensure_position(self.app.name)
                self._positions_ensured = True
            while True:
                try:
                    return self._catch_up(until, progress, page_size, asynchronous_commit, views)
                except IntegrityError:  # another replica applied a page first: read the new
                    until = self._end  # positions, and go on to the same end (the head
                    continue  # when this catch-up started), not to a head that moved since

    def _catch_up(
        self,
        until: int | None,
        progress: Callable[[int], None],
        page_size: int,
        asynchronous_commit: bool,
        views: Collection[str] | None = None,
    ) -> int:
        names = list(self.views) if views is None else [n for n in self.views if n in views]
        positions = {name: self.position(name) for name in names}
        head = self.app.recorder.max_notification_id() or 0  # read after the positions
        for name, position in positions.items():
            if position > head:  # never skipped silently: it would stop the read model
                raise ReadModelAheadError(name, position, head)
        end = head if until is None else min(until, head)
        self._end = end  # a lost race goes on to it (:meth:`catch_up`)
        with self._gate.held(min(positions.values()) < end) as waited:
            if waited:  # another replica's catch-up went first: what it left
                positions = {name: self.position(name) for name in names}
            return self._apply_pages(positions, end, progress, page_size, asynchronous_commit)

    def _apply_pages(
        self,
        positions: dict[str, int],
        end: int,
        progress: Callable[[int], None],
        page_size: int,
        asynchronous_commit: bool,
    ) -> int:
        """Read, fold and apply the pages after ``positions`` up to ``end``."""
        names = list(positions)
        after = min(positions.values())
        read = 0
        for events, reached in self._pages(after, end, page_size, names):
            behind = [name for name in names if positions[name] < reached]
            nets = {name: self.views[name].net() for name in behind}
            unknown = {name: Counter[str]() for name in behind}
            route = partial(
                self._route,
                {name: (positions[name], nets[name], unknown[name]) for name in behind},
                {name: self._handlers(self.projections[name], self._topics_of[name])
                 for name in behind},
            )  # fmt: skip
            routes = {topic: route(topic) for topic in self.topics}
            for position, topic, event in events:  # one pass: each event to its views
                entries = routes.get(topic)
                if entries is None:  # a topic no projection handles
                    entries = routes[topic] = route(topic)
                for start, net, handler in entries:
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
                self.projections[name].unknown_events.add(unknown[name])
            read += len(events)
            progress(reached - after)
            after = reached
        return read

    def _route(
        self,
        behind: Mapping[str, tuple[int, NetChanges, Counter[str]]],
        handlers: Mapping[str, Mapping[str, Callable[[Any], Any]]],
        topic: str,
    ) -> list[tuple[int, NetChanges, Callable[[Any], Any]]]:
        """For each view behind (its position, net changes and unknown events), the
        handler of ``topic``: its projection's; none when it ignores the topic; else one
        that counts an event of a class it does not know."""
        found = []
        for name, (position, net, unknown) in behind.items():
            handler = handlers[name].get(topic)
            if handler is None:
                if topic in self._ignored_of[name]:
                    continue
                handler = partial(_count, unknown, topic)
            found.append((position, net, handler))
        return found

    @staticmethod
    def _handlers(
        projection: SqlProjection[Any], topics: frozenset[str]
    ) -> dict[str, Callable[[Any], Any]]:
        """Each handled topic's ``changes`` handler, resolved once per page rather than
        by ``singledispatchmethod`` per event (unless ``changes`` is replaced on the
        instance, as a test does)."""
        if "changes" in vars(projection):
            changes = projection.changes
            return dict.fromkeys(topics, changes)
        dispatch = inspect.getattr_static(type(projection), "changes").dispatcher.dispatch
        return {topic: partial(dispatch(resolve_topic(topic)), projection) for topic in topics}

    def close(self) -> None:
        """Close the catch-up gate's connection (the views use the store's)."""
        self._gate.close()

    def reset_gate(self) -> None:
        """After a reconnection: the catch-up gate's session is of the lost server."""
        self._gate.reset()

    def wait(self, position: int, timeout: float = 5.0) -> None:
        """Block until every view has applied ``position`` (read-your-writes)."""
        for view in self.views.values():
            view.wait(self.app.name, position, timeout=timeout)

    def status(self) -> list[ProjectionStatus]:
        """Each view's position, the log's head, its lag, the events of unknown classes
        its projection met in this process (since it started or was cleared), and an
        error when its position lies beyond the head (:class:`ReadModelAheadError`).
        The positions are read before the head, so a concurrent catch-up never makes
        a position look ahead."""
        positions = {name: self.position(name) for name in self.views}
        head = self.app.recorder.max_notification_id() or 0
        statuses = []
        for name, position in positions.items():
            statuses.append(
                ProjectionStatus(
                    name,
                    position,
                    head,
                    count_events_after(self.app.recorder, position),
                    self.projections[name].unknown_events.counts(),
                    ahead_text(position, head) if position > head else None,
                )
            )
        return statuses

    def clear(self) -> None:
        """Forget every row and position (a rebuild then starts from zero), and the
        unknown events met (a rebuild meets them again)."""
        with self._lock:
            for name, view in self.views.items():
                view.clear(self.app.name)
                view.ensure_position(self.app.name)
                self.projections[name].unknown_events.clear()


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


def _count(counts: Counter[str], topic: str, event: Any) -> tuple[()]:
    """The handler of an event of a topic the projection does not know: no row changes;
    the event is counted."""
    counts[topic] += 1
    return ()


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
    after: int = 0,
) -> int:
    """Read the notifications (after ``after``, up to ``until``) with the recorder alone,
    in the pages a rebuild or an audit uses: the baseline their rates are compared with."""
    read = 0
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
