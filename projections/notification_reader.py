"""Reading the notification log in pages for a replay (rebuild, catch-up, audit).

The recorder's ``select_notifications`` selects every column as a dictionary row in
text format. A replay reads the whole log, so it uses a narrower query instead: the
five columns a :class:`~eventsourcing.persistence.Notification` needs, as tuple rows,
in PostgreSQL's binary format (UUIDs and bytes arrive without parsing text), and
optionally only some topics, or all but some (those the reader ignores: an event of a
topic it does not know is then read, and can be reported). :func:`read_pages` returns the
same ``Notification`` objects as the recorder, so the application's mapper decodes them
unchanged; :func:`read_rows` returns the rows themselves, as tuples of the same five
fields in the same order (:data:`Row`), for the audit's loops, which read every row of
the log and need no object per row (building a ``Notification``, a frozen dataclass,
costs about as much as reading its row: docs/performance-log.md).

On PostgreSQL this reads the log about three times faster than the recorder (measured
in docs/performance.md); on SQLite it skips the row objects. Any other recorder falls
back to ``select_notifications``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar
from uuid import UUID

from eventsourcing.persistence import ApplicationRecorder, Notification
from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.sqlite import SQLiteApplicationRecorder
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composed, Identifier

PAGE = 1000

# A notification as its row: position, originator id, originator version, topic, state
# (the fields of ``Notification``, in the order of ``ChainedEvent``'s).
Row = tuple[int, UUID | str, int, str, bytes]
_Item = TypeVar("_Item", Row, Notification)


def read_pages(
    recorder: ApplicationRecorder,
    *,
    after: int = 0,
    until: int | None = None,
    topics: Sequence[str] = (),
    excluding: Sequence[str] = (),
    page_size: int = PAGE,
    first_page_size: int | None = None,
    read_ahead: bool = False,
) -> Generator[list[Notification], None, None]:
    """Pages of notifications after position ``after`` (up to ``until``, inclusive), in
    log order; with ``topics``, only notifications of those topics; with ``excluding``,
    none of those topics. Stops after the first page shorter than its size
    (``first_page_size`` for the first, so that a replay starts working early, then
    ``page_size``).

    ``read_ahead`` (PostgreSQL only): once a page is full, the next one is read in a
    thread while the caller works on this one. The query runs in the server and its
    rows arrive meanwhile; the GIL is released while psycopg waits. Closing the
    iterator early waits for at most the one page being read."""

    def read(start: int, limit: int) -> list[Notification]:
        return select_page(recorder, start, until, topics, limit, excluding)

    yield from _pages(recorder, read, after, page_size, first_page_size, read_ahead)


def read_rows(
    recorder: ApplicationRecorder,
    *,
    after: int = 0,
    until: int | None = None,
    page_size: int = PAGE,
    first_page_size: int | None = None,
    read_ahead: bool = False,
) -> Generator[list[Row], None, None]:
    """:func:`read_pages` of every topic, each notification as its :data:`Row`."""

    def read(start: int, limit: int) -> list[Row]:
        return select_rows(recorder, start, until, limit)

    yield from _pages(recorder, read, after, page_size, first_page_size, read_ahead)


def _pages(
    recorder: ApplicationRecorder,
    read: Callable[[int, int], list[_Item]],
    after: int,
    page_size: int,
    first_page_size: int | None,
    read_ahead: bool,
) -> Generator[list[_Item], None, None]:
    """The pages ``read(after, limit)`` gives, each after the last one's last position
    (its first field, or its ``id``), until one is shorter than its limit."""

    def last(page: list[_Item]) -> int:
        item: Any = page[-1]
        return int(item[0] if type(item) is tuple else item.id)

    limit = first_page_size or page_size
    page = read(after, limit)
    full = len(page) == limit
    if not (read_ahead and full and isinstance(recorder, PostgresApplicationRecorder)):
        while full:
            yield page
            page = read(last(page), page_size)
            full = len(page) == page_size
        if page:
            yield page
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead") as pool:
        while full:
            ahead = pool.submit(read, last(page), page_size)
            yield page
            page = ahead.result()
            full = len(page) == page_size
        if page:
            yield page


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside. A replay allocates hundreds of thousands of
    long-lived objects (decoded events, folded state, rows), on which the collector's
    passes cost a quarter to 40% of the time and free nothing: nothing in a replay
    makes reference cycles, and reference counting frees the rest.

    At the end the objects allocated inside are moved to the oldest generation (frozen,
    then unfrozen: two list splices), as the passes they skipped would have moved them.
    Left in the youngest, the first allocation after the pause would run a collection
    over every one of them: 6% of an audit fold's time (docs/performance-log.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


def select_page(
    recorder: ApplicationRecorder,
    after: int,
    until: int | None,
    topics: Sequence[str],
    limit: int,
    excluding: Sequence[str] = (),
) -> list[Notification]:
    """Up to ``limit`` notifications after ``after`` (up to ``until``), of ``topics``
    (all when empty) and of none of ``excluding``."""
    if isinstance(recorder, PostgresApplicationRecorder):
        rows = _postgres_rows(recorder, after, until, topics, limit, excluding)
        return [_notification(row) for row in rows]
    if isinstance(recorder, SQLiteApplicationRecorder):
        rows = _sqlite_rows(recorder, after, until, topics, limit, excluding)
        return [_notification(row) for row in rows]
    if not excluding:
        return list(
            recorder.select_notifications(
                start=after, limit=limit, stop=until, topics=topics, inclusive_of_start=False
            )
        )
    excluded = frozenset(excluding)  # the recorder cannot exclude: filter its pages here
    found: list[Notification] = []
    while len(found) < limit:
        page = recorder.select_notifications(
            start=after, limit=limit, stop=until, topics=topics, inclusive_of_start=False
        )
        found += [notification for notification in page if notification.topic not in excluded]
        if len(page) < limit:
            break
        after = page[-1].id
    return found[:limit]


def select_rows(
    recorder: ApplicationRecorder, after: int, until: int | None, limit: int
) -> list[Row]:
    """:func:`select_page` of every topic, as rows."""
    if isinstance(recorder, PostgresApplicationRecorder):
        return _postgres_rows(recorder, after, until, (), limit, ())
    if isinstance(recorder, SQLiteApplicationRecorder):
        return _sqlite_rows(recorder, after, until, (), limit, ())
    return [
        (n.id, n.originator_id, n.originator_version, n.topic, n.state)
        for n in select_page(recorder, after, until, (), limit)
    ]


def _notification(row: Row) -> Notification:
    return Notification(
        id=row[0], originator_id=row[1], originator_version=row[2], topic=row[3], state=row[4]
    )


def _postgres_rows(
    recorder: PostgresApplicationRecorder,
    after: int,
    until: int | None,
    topics: Sequence[str],
    limit: int,
    excluding: Sequence[str],
) -> list[Row]:
    statement: Composed = SQL(
        "SELECT notification_id, originator_id, originator_version, topic, state "
        "FROM {}.{} WHERE notification_id > %s"
    ).format(Identifier(recorder.datastore.schema), Identifier(recorder.events_table_name))
    params: list[object] = [after]
    if until is not None:
        statement += SQL(" AND notification_id <= %s")
        params.append(until)
    if topics:
        statement += SQL(" AND topic = ANY(%s)")
        params.append(list(topics))
    if excluding:
        statement += SQL(" AND topic <> ALL(%s)")
        params.append(list(excluding))
    statement += SQL(" ORDER BY notification_id LIMIT %s")
    params.append(limit)
    with (
        recorder.datastore.get_connection() as connection,
        connection.cursor(row_factory=tuple_row, binary=True) as cursor,
    ):
        cursor.execute(statement, params, prepare=True)
        rows: list[Row] = cursor.fetchall()
        return rows


def _sqlite_rows(
    recorder: SQLiteApplicationRecorder,
    after: int,
    until: int | None,
    topics: Sequence[str],
    limit: int,
    excluding: Sequence[str],
) -> list[Row]:
    statement = (
        "SELECT rowid, originator_id, originator_version, topic, state "
        f"FROM {recorder.events_table_name} WHERE rowid > ?"
    )
    params: list[object] = [after]
    if until is not None:
        statement += " AND rowid <= ?"
        params.append(until)
    if topics:
        statement += f" AND topic IN ({','.join('?' * len(topics))})"
        params.extend(topics)
    if excluding:
        statement += f" AND topic NOT IN ({','.join('?' * len(excluding))})"
        params.extend(excluding)
    statement += " ORDER BY rowid LIMIT ?"
    params.append(limit)
    with recorder.datastore.transaction(commit=False) as cursor:
        cursor.execute(statement, params)
        rows = cursor.fetchall()
    return [(row[0], UUID(row[1]), row[2], row[3], row[4]) for row in rows]
