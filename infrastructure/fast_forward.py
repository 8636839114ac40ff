"""Bring two cached aggregates up to date with one query.

A placement reads its home runner and that runner's lease. With the aggregate cache on,
the repository fast-forwards each with its own query (events after the cached
version): two round trips. :func:`fast_forward_pair` asks for the new events of both
streams in one query and applies them to the cached aggregates under the repository's
own fast-forward locks, exactly as ``Repository.get`` does one at a time, then returns
deep copies (commands never touch the cached instances).

When either aggregate is not in the cache, or the store is neither SQLite nor
PostgreSQL, it returns None and the caller loads both the usual way.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any
from uuid import UUID

from eventsourcing.application import Application, Repository
from eventsourcing.persistence import StoredEvent
from eventsourcing.postgres import PostgresAggregateRecorder
from eventsourcing.sqlite import SQLiteAggregateRecorder
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Identifier


def fast_forward_pair(app: Application[UUID], first: UUID, second: UUID) -> tuple[Any, Any] | None:
    """Deep copies of the two cached aggregates, brought up to date with one query;
    None when either is not cached or the store has no such query here."""
    repository = app.repository
    cache = repository.cache
    if cache is None or not repository.fastforward:
        return None
    recorder = app.recorder
    if not isinstance(recorder, PostgresAggregateRecorder | SQLiteAggregateRecorder):
        return None
    with ExitStack() as stack:
        for aggregate_id in (first, second):
            stack.enter_context(_fast_forward_lock(repository, aggregate_id))
        try:
            cached = (cache.get(first), cache.get(second))
        except KeyError:
            return None
        stored = _select_after(recorder, ((first, cached[0].version), (second, cached[1].version)))
        by_id: dict[Any, Any] = {first: cached[0], second: cached[1]}
        for event in stored:
            aggregate = by_id[event.originator_id]
            domain_event: Any = app.mapper.to_domain_event(event)
            by_id[event.originator_id] = domain_event.mutate(aggregate)
        if by_id[first] is not cached[0] or by_id[second] is not cached[1]:
            return None  # a mutator returned another object: let the repository handle it
        return copy.deepcopy(by_id[first]), copy.deepcopy(by_id[second])


class _fast_forward_lock:
    """The repository's per-aggregate fast-forward lock (shared with Repository.get)."""

    def __init__(self, repository: Repository[UUID], aggregate_id: UUID) -> None:
        self.repository = repository
        self.aggregate_id = aggregate_id

    def __enter__(self) -> None:
        self.lock = self.repository._use_fastforward_lock(self.aggregate_id)
        self.lock.acquire()

    def __exit__(self, *_: object) -> None:
        self.lock.release()
        self.repository._disuse_fastforward_lock(self.aggregate_id)


def _select_after(
    recorder: PostgresAggregateRecorder | SQLiteAggregateRecorder,
    streams: Sequence[tuple[UUID, int]],
) -> list[StoredEvent]:
    """Stored events after the given version of each stream, each stream in order."""
    if isinstance(recorder, PostgresAggregateRecorder):
        statement = SQL(
            "SELECT originator_id, originator_version, topic, state FROM {}.{} WHERE "
            "(originator_id = %s AND originator_version > %s) OR "
            "(originator_id = %s AND originator_version > %s) "
            "ORDER BY originator_id, originator_version"
        ).format(Identifier(recorder.datastore.schema), Identifier(recorder.events_table_name))
        params: list[Any] = [value for stream in streams for value in stream]
        with (
            recorder.datastore.get_connection() as connection,
            connection.cursor(row_factory=tuple_row, binary=True) as cursor,
        ):
            cursor.execute(statement, params, prepare=True)
            rows = cursor.fetchall()
        return [StoredEvent(row[0], row[1], row[2], row[3]) for row in rows]
    statement_text = (
        "SELECT originator_id, originator_version, topic, state FROM "
        f"{recorder.events_table_name} WHERE "
        "(originator_id = ? AND originator_version > ?) OR "
        "(originator_id = ? AND originator_version > ?) "
        "ORDER BY originator_id, originator_version"
    )
    params = [value for uuid, version in streams for value in (uuid.hex, version)]
    with recorder.datastore.transaction(commit=False) as cursor:
        cursor.execute(statement_text, params)
        rows = cursor.fetchall()
    return [StoredEvent(UUID(row[0]), row[1], row[2], row[3]) for row in rows]


def load_uncached(app: Application[UUID], aggregate_id: UUID) -> Any | None:
    """A deep copy of an aggregate that is not in the cache, reconstructed from its
    latest snapshot and the events after it read with one query (the repository reads
    the snapshot, then the events: two), and put in the cache as the repository does.
    None when the aggregate is cached (the repository fast-forwards it with one query),
    does not exist, or the store has no such query here."""
    repository = app.repository
    cache = repository.cache
    snapshots = app.snapshots
    if cache is None or snapshots is None:
        return None
    recorder = app.recorder
    if not isinstance(recorder, PostgresAggregateRecorder) or not isinstance(
        snapshots.recorder, PostgresAggregateRecorder
    ):
        return None
    try:
        cache.get(aggregate_id)
    except KeyError:
        pass
    else:
        return None
    stored = _select_snapshot_and_events(recorder, snapshots.recorder, aggregate_id)
    aggregate: Any = None
    for event in stored:
        domain_event: Any = app.mapper.to_domain_event(event)
        aggregate = domain_event.mutate(aggregate)
    if aggregate is None:
        return None
    cache.put(aggregate_id, aggregate)
    return copy.deepcopy(aggregate)


def _select_snapshot_and_events(
    events: PostgresAggregateRecorder, snapshots: PostgresAggregateRecorder, aggregate_id: UUID
) -> list[StoredEvent]:
    statement = SQL(
        "WITH snapshot AS (SELECT originator_version, topic, state FROM {schema}.{snapshots} "
        "WHERE originator_id = %s ORDER BY originator_version DESC LIMIT 1) "
        "SELECT 0 AS part, originator_version, topic, state FROM snapshot "
        "UNION ALL SELECT 1, originator_version, topic, state FROM {schema}.{events} "
        "WHERE originator_id = %s AND originator_version > "
        "COALESCE((SELECT originator_version FROM snapshot), 0) "
        "ORDER BY part, originator_version"
    ).format(
        schema=Identifier(events.datastore.schema),
        snapshots=Identifier(snapshots.events_table_name),
        events=Identifier(events.events_table_name),
    )
    with (
        events.datastore.get_connection() as connection,
        connection.cursor(row_factory=tuple_row, binary=True) as cursor,
    ):
        cursor.execute(statement, (aggregate_id, aggregate_id), prepare=True)
        rows = cursor.fetchall()
    return [StoredEvent(aggregate_id, row[1], row[2], row[3]) for row in rows]
