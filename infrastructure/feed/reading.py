"""The notification log in order, a page at a time and live: the event feed's reads.

A page starts after a position (``after``; 0: the log's start) and holds the events
of the positions that follow, in log order, those that match the filter
(:class:`FeedFilter`: event types, sandbox, runner, pool). Its ``next`` is the position
to ask after next time: the last event's when the page is full; when the log ran out
first, the end of what the page covered: the head of the log as read before the page,
or :data:`POSITION_WINDOW` positions after ``after`` if that is less (every position up
to it was read), so that a filtered follower moves on past what it does not want; when
the page's budget of :data:`SCAN_BUDGET` decoded events ran out first, the last position
decoded. Positions only grow and are never reused: on PostgreSQL every insert
takes the events table's lock, so that notification ids commit in order, and on SQLite
there is one writer; a reader that has read up to a position never later finds a new
event at or before it. A follower that keeps ``next`` and asks after it therefore
sees each event of the log once, in order, whatever restarts between its requests.

:func:`follow` is that loop in-process, for embedders: an iterator over the log from a
position, waiting for new events when it is caught up (it polls: SQLite has no
notifications, and one poll a fraction of a second costs one indexed query).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.persistence import Notification

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.event_catalogue import event_classes, event_name
from secondbox_scheduler.domain.event_topics import topics_of
from secondbox_scheduler.domain.values import require_text
from secondbox_scheduler.infrastructure.feed.subjects import NOBODY, Subject, Subjects
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import select_page

DEFAULT_LIMIT = 100  # events per page unless asked
MAX_LIMIT = 1000  # events per page at most: a larger limit is served as this
SCAN_BUDGET = 10_000  # events one page decodes at most (a narrow filter's page ends early)
POSITION_WINDOW = 100_000  # positions one page covers at most (a rare type's page too)
READ_PAGE = 1000  # notifications per query
MAX_POSITION = 2**63 - 1
POLL_SECONDS = 0.2  # how often a caught-up follower looks for new events


def event_types() -> dict[str, type[Any]]:
    """Every event type of the catalogue by its name (``Sandbox.AssignmentFenced``)."""
    return {event_name(cls): cls for cls in event_classes()}


@dataclass(frozen=True)
class FeedFilter:
    """Which events a page holds: of these types (none: every type), and concerning
    this sandbox, runner and pool (None: any). Checked when made."""

    types: tuple[str, ...] = ()
    sandbox_id: str | None = None
    runner_id: str | None = None
    pool_name: str | None = None

    def __post_init__(self) -> None:
        known = event_types()
        for name in self.types:
            if name not in known:
                raise InvalidRequestError(
                    "type", f"must be an event type of docs/events.md (got {name[:80]!r})"
                )
        for name in ("sandbox_id", "runner_id", "pool_name"):
            value = getattr(self, name)
            if value is not None:
                require_text(name, value)

    @property
    def topics(self) -> tuple[str, ...]:
        """The topics of the filter's types, with their former topics (none: every)."""
        known = event_types()
        return tuple(sorted({t for name in self.types for t in topics_of(known[name])}))

    def matches(self, subject: Subject) -> bool:
        return (
            (self.sandbox_id is None or subject.sandbox_id == self.sandbox_id)
            and (self.runner_id is None or subject.runner_id == self.runner_id)
            and (self.pool_name is None or subject.pool_name == self.pool_name)
        )

    @property
    def narrows(self) -> bool:
        return (self.sandbox_id, self.runner_id, self.pool_name) != (None, None, None)


EVERY_EVENT = FeedFilter()


@dataclass(frozen=True)
class FeedEvent:
    """One event of the log as the feed gives it: its position, its type's name, its
    stream and version, what it concerns, and the domain event itself (None for a
    topic this release does not know: ``state`` then holds its stored JSON)."""

    position: int
    type: str
    stream_id: UUID
    stream_version: int
    subject: Subject
    event: Any
    state: dict[str, Any] | None = None


@dataclass(frozen=True)
class FeedPage:
    events: list[FeedEvent]
    next: int  # the position to read after next time
    head: int  # the log's head as read before the page
    more: bool  # the page ended before the head (full, or out of scan budget)


@dataclass
class _Reader:
    decode: EventDecoder
    subjects: Subjects
    lock: threading.Lock = field(default_factory=threading.Lock)


_readers: weakref.WeakKeyDictionary[StoredApplication, _Reader] = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


def _reader(app: StoredApplication) -> _Reader:
    with _readers_lock:
        found = _readers.get(app)
        if found is None:
            found = _readers[app] = _Reader(EventDecoder(app.mapper), Subjects(app))
        return found


def check_after(after: int) -> int:
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= MAX_POSITION:
        raise InvalidRequestError("after", f"must be a position from 0 to {MAX_POSITION}")
    return after


def page_limit(limit: int | None) -> int:
    """``limit`` as served: at least 1 (else refused), at most :data:`MAX_LIMIT`."""
    if limit is None:
        return min(DEFAULT_LIMIT, MAX_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidRequestError("limit", "must be a whole number of at least 1")
    return min(limit, MAX_LIMIT)


def read_feed(
    app: StoredApplication,
    after: int = 0,
    limit: int | None = None,
    feed_filter: FeedFilter = EVERY_EVENT,
    *,
    scan_budget: int = SCAN_BUDGET,
) -> FeedPage:
    """The events after position ``after`` that ``feed_filter`` lets through, at most
    ``limit`` (default 100, at most 1,000), in log order; see the module's docstring.
    One page covers at most :data:`POSITION_WINDOW` positions and decodes at most
    ``scan_budget`` events, so that no filter makes a request long."""
    after = check_after(after)
    wanted = page_limit(limit)
    reader = _reader(app)
    head = app.recorder.max_notification_id() or 0  # before the reads: all up to it are in
    end = max(after, min(after + POSITION_WINDOW, head))  # this page covers (after, end]
    topics = feed_filter.topics
    found: list[FeedEvent] = []
    position = after
    scanned = 0
    while position < end:
        size = min(READ_PAGE, scan_budget - scanned)
        if not feed_filter.narrows:
            size = min(size, wanted - len(found))
        notifications = select_page(app.recorder, position, end, topics, size)
        for notification in notifications:
            scanned += 1
            position = notification.id
            item = _feed_event(reader, notification)
            if feed_filter.matches(item.subject):
                found.append(item)
                if len(found) == wanted:
                    return FeedPage(found, position, head, True)
        if len(notifications) < size:  # every position up to ``end`` is read
            break
        if scanned >= scan_budget:
            return FeedPage(found, position, head, True)
    return FeedPage(found, end, head, end < head)


def _feed_event(reader: _Reader, notification: Notification) -> FeedEvent:
    stream = UUID(str(notification.originator_id))
    try:
        event = reader.decode(notification)
    except Exception:  # a topic of another release, or a state that does not decode
        return FeedEvent(
            notification.id,
            notification.topic.rpartition(":")[2] or notification.topic,
            stream,
            notification.originator_version,
            NOBODY,
            None,
            _stored_state(notification.state),
        )
    reader.subjects.learn(event)
    return FeedEvent(
        notification.id,
        event_name(type(event)),
        stream,
        notification.originator_version,
        reader.subjects.of(event),
        event,
    )


def _stored_state(state: bytes) -> dict[str, Any] | None:
    try:
        found = json.loads(state)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def follow(
    app: StoredApplication,
    after: int = 0,
    *,
    types: Collection[str] = (),
    sandbox_id: str | None = None,
    runner_id: str | None = None,
    pool_name: str | None = None,
    wait: bool = True,
    stop: threading.Event | None = None,
    poll_seconds: float = POLL_SECONDS,
    page_size: int = MAX_LIMIT,
) -> Iterator[FeedEvent]:
    """The events of ``app``'s log after position ``after``, in order, each once (of
    ``types``, concerning ``sandbox_id``, ``runner_id`` and ``pool_name``, as given).
    When it has given every event written so far it waits for new ones, polling every
    ``poll_seconds``, until ``stop`` is set; with ``wait=False`` it ends instead. Keep
    the ``position`` of the last event you applied, with what you applied it to, and
    pass it as ``after`` to resume exactly there."""
    feed_filter = FeedFilter(tuple(types), sandbox_id, runner_id, pool_name)
    position = check_after(after)
    while stop is None or not stop.is_set():
        page = read_feed(app, position, page_size, feed_filter)
        yield from page.events
        position = page.next
        if page.more:
            continue
        if not wait:
            return
        if stop is not None:
            stop.wait(poll_seconds)
        else:
            time.sleep(poll_seconds)
