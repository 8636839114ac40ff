"""Load many aggregates up to date with at most two queries.

A placement batch needs its sandboxes, then their home runners and leases. With the
aggregate cache on, the repository brings each cached aggregate up to date with a query
of its own (the events after the cached version), and reads an uncached one with two
(its latest snapshot, then the events after it): round trips that would grow with the
batch. :func:`load_many` asks for the new events of every cached aggregate in one query
(under the repository's own fast-forward locks, taken in one order, applying them as
``Repository.get`` does), and for the snapshots and later events of every uncached one
in another, puts those in the cache as the repository does, and returns deep copies
(commands never touch the cached instances). On the in-memory store it falls back to
``repository.get`` for each. The stored events and snapshots read are decoded by an
:class:`~secondbox_scheduler.projections.event_decoder.EventDecoder` of the application's
mapper: the mapper's very events (or its errors), with orjson.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from typing import Any
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, Application, Repository
from eventsourcing.persistence import StoredEvent
from eventsourcing.postgres import PostgresAggregateRecorder
from eventsourcing.sqlite import SQLiteAggregateRecorder
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composed, Identifier

from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots
from secondbox_scheduler.infrastructure.store.typed_arrays import BigintArray, UUIDArray
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.event_log import rendered

# each application's loads decode through one EventDecoder of its mapper (the mapper's
# very events, with orjson and each topic's learned paths: a batch's sandboxes are read
# afresh every time, their creation's state about 1 KB each), kept on the mapper
_DECODE = "_secondbox_load_decode"


def _decoder(app: Application[UUID]) -> Callable[[StoredEvent], Any]:
    """``app.mapper.to_domain_event``, through an :class:`EventDecoder` when it is lean
    (the library's mapper and transcoder): the same events, or the mapper's errors."""
    mapper = app.mapper
    decode: Callable[[StoredEvent], Any] | None = getattr(mapper, _DECODE, None)
    if decode is None:
        decoder = EventDecoder(mapper)
        decode = decoder if decoder.lean else mapper.to_domain_event
        setattr(mapper, _DECODE, decode)
    return decode


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


def select_after_statement(schema: str, events_table: str) -> Composed:
    """The events after a given version of each stream (two arrays: ids, versions), each
    stream read through the primary key. The subquery's ``OFFSET 0`` keeps the planner
    from flattening it into a join it may run as a scan of the whole table: with no
    statistics yet (a young table, the first minute after a large insert), it estimates
    hundreds of events per stream and hashes the table, 14 ms at 35,000 events instead
    of 0.3 ms."""
    return SQL(
        "SELECT e.originator_id, e.originator_version, e.topic, e.state "
        "FROM unnest(%b::uuid[], %b::bigint[]) AS v(id, version) CROSS JOIN LATERAL "
        "(SELECT originator_id, originator_version, topic, state FROM {}.{} "
        "WHERE originator_id = v.id AND originator_version > v.version OFFSET 0) AS e "
        "ORDER BY e.originator_id, e.originator_version"
    ).format(Identifier(schema), Identifier(events_table))


_select_after = rendered(select_after_statement)


def _select_events_after(
    recorder: PostgresAggregateRecorder | SQLiteAggregateRecorder,
    streams: Sequence[tuple[UUID, int]],
) -> list[StoredEvent]:
    """Stored events after the given version of each stream, each stream in order."""
    if isinstance(recorder, PostgresAggregateRecorder):
        statement = _select_after(recorder.datastore.schema, recorder.events_table_name)
        arrays = [
            UUIDArray([stream[0] for stream in streams]),
            BigintArray([stream[1] for stream in streams]),
        ]
        with (
            recorder.datastore.get_connection() as connection,
            connection.cursor(row_factory=tuple_row, binary=True) as cursor,
        ):
            cursor.execute(statement, arrays, prepare=True)
            rows = cursor.fetchall()
        return [StoredEvent(row[0], row[1], row[2], row[3]) for row in rows]
    values_text = ", ".join("(?, ?)" for _ in streams)
    statement_text = (
        "WITH v(id, version) AS (VALUES " + values_text + ") "
        "SELECT e.originator_id, e.originator_version, e.topic, e.state FROM "
        f"{recorder.events_table_name} e JOIN v ON e.originator_id = v.id "
        "AND e.originator_version > v.version ORDER BY e.originator_id, e.originator_version"
    )
    params = [value for uuid, version in streams for value in (uuid.hex, version)]
    with recorder.datastore.transaction(commit=False) as cursor:
        cursor.execute(statement_text, params)
        rows = cursor.fetchall()
    return [StoredEvent(UUID(row[0]), row[1], row[2], row[3]) for row in rows]


def load_many(
    app: Application[UUID], aggregate_ids: Sequence[UUID], *, cache_new: bool = True
) -> dict[UUID, Any]:
    """Deep copies of many aggregates, each up to date, with at most two queries for all:
    the cached ones fast-forwarded (the events after each cached version) and the others
    read from their latest snapshot and the events after it, then cached as the
    repository caches them. An aggregate that does not exist is absent. A placement
    batch reads its sandboxes, then their runners and leases, this way: two round trips
    however many requests it holds. Without such queries (the in-memory store), one
    ``repository.get`` each.

    ``cache_new=False``: the aggregates not in the cache yet are returned as read and
    not cached (no copy needed). A batch reads its sandboxes so: each is placed once and
    its cached copy would be stale at the next commit, while 10,000 cached sandboxes
    would be most of the objects the garbage collector walks (docs/performance.md,
    "Tail latency")."""
    repository, recorder = app.repository, app.recorder
    ids = sorted(set(aggregate_ids), key=lambda u: u.bytes)
    cache = repository.cache
    snapshots = app.snapshots
    if (
        cache is None
        or not repository.fastforward
        or not isinstance(recorder, PostgresAggregateRecorder | SQLiteAggregateRecorder)
        or snapshots is None
        or isinstance(recorder, PostgresAggregateRecorder)
        != isinstance(snapshots.recorder, PostgresAggregateRecorder)
        or not isinstance(snapshots.recorder, PostgresAggregateRecorder | SQLiteAggregateRecorder)
    ):
        return _load_each(app, ids)
    try:
        return _load_together(app, ids, cache_new)
    except _Unsupported:
        return _load_each(app, ids)


class _Unsupported(Exception):
    """The aggregates cannot be brought up to date in place: load them one by one."""


def _load_together(app: Application[UUID], ids: list[UUID], cache_new: bool) -> dict[UUID, Any]:
    repository, recorder, snapshots = app.repository, app.recorder, app.snapshots
    decode = _decoder(app)
    cache = repository.cache
    assert cache is not None
    assert snapshots is not None
    assert isinstance(recorder, PostgresAggregateRecorder | SQLiteAggregateRecorder)
    assert isinstance(snapshots.recorder, PostgresAggregateRecorder | SQLiteAggregateRecorder)
    found: dict[UUID, Any] = {}  # cached instances: returned as copies
    fresh: dict[UUID, Any] = {}  # read now and not cached: returned as they are
    keep = found if cache_new else fresh
    # the locks guard the cached instances, which are fast-forwarded in place, and the
    # cache's entries: without caching what is read (``cache_new=False``), only the ids
    # in the cache now are locked (a sandbox a batch reads is seldom there, and one that
    # is cached meanwhile is read from the store like the others, its cached copy left
    # alone); an id evicted before its lock is taken is read from the store the same way
    locking = ids if cache_new else [i for i in ids if i in cache.cache]
    with ExitStack() as stack:
        for aggregate_id in locking:  # in one order, as every batch takes them: no deadlock
            stack.enter_context(_fast_forward_lock(repository, aggregate_id))
        cached: dict[UUID, Any] = {}
        for aggregate_id in locking:
            with suppress(KeyError):
                cached[aggregate_id] = cache.get(aggregate_id)
        if cached:
            after = [
                (aggregate_id, aggregate.version) for aggregate_id, aggregate in cached.items()
            ]
            for event in _select_events_after(recorder, after):
                domain_event: Any = decode(event)
                aggregate = cached[domain_event.originator_id]
                if domain_event.mutate(aggregate) is not aggregate:
                    # a mutator that returns another object (never ours): drop the cached
                    # instance, which the repository will read afresh
                    cache.get(domain_event.originator_id, evict=True)
                    raise _Unsupported
            found.update(cached)
        missing = [aggregate_id for aggregate_id in ids if aggregate_id not in cached]
        if missing and isinstance(snapshots.recorder, SealedSnapshots):
            # sealed snapshots: the latest of each stream whose seal checks (a forged one
            # is refused and the aggregate replayed from its events), and the events
            # after it: one query on PostgreSQL, two on SQLite, for all of them
            sealed = snapshots.recorder
            together = sealed.select_latest_and_after(missing)
            if together is None:
                trusted = sealed.select_latest(missing)
                after = [(i, trusted[i].originator_version if i in trusted else 0) for i in missing]
                events = _select_events_after(recorder, after)
            else:
                trusted, events, refused = together
                if refused:  # rare: a forged snapshot; its stream is read from the start
                    replayed = _select_events_after(
                        recorder, [(i, 0) for i in sorted(refused, key=str)]
                    )
                    events = [e for e in events if e.originator_id not in refused] + replayed
            rebuilt: dict[UUID, Any] = {}
            for aggregate_id, snapshot in trusted.items():
                snapshot_event: Any = decode(snapshot)
                rebuilt[aggregate_id] = snapshot_event.mutate(None)
            for event in events:
                domain_event = decode(event)
                stream = domain_event.originator_id
                rebuilt[stream] = domain_event.mutate(rebuilt.get(stream))
            for aggregate_id, aggregate in rebuilt.items():
                if aggregate is not None:
                    keep[aggregate_id] = aggregate
            missing = []
        if missing:
            loaded: dict[UUID, Any] = {}
            for event in _select_snapshots_and_events(recorder, snapshots.recorder, missing):
                domain_event = decode(event)
                stream = domain_event.originator_id
                loaded[stream] = domain_event.mutate(loaded.get(stream))
            for aggregate_id, aggregate in loaded.items():
                if aggregate is not None:
                    keep[aggregate_id] = aggregate
        for aggregate_id, aggregate in found.items():
            if aggregate_id not in cached:
                cache.put(aggregate_id, aggregate)
        copies = {aggregate_id: copy.deepcopy(found[aggregate_id]) for aggregate_id in found}
        return {**fresh, **copies}


def _load_each(app: Application[UUID], ids: Sequence[UUID]) -> dict[UUID, Any]:
    found: dict[UUID, Any] = {}
    for aggregate_id in ids:
        try:
            found[aggregate_id] = app.repository.get(aggregate_id)
        except AggregateNotFoundError:
            continue
    return found


def _select_snapshots_and_events(
    events: PostgresAggregateRecorder | SQLiteAggregateRecorder,
    snapshots: PostgresAggregateRecorder | SQLiteAggregateRecorder,
    aggregate_ids: Sequence[UUID],
) -> list[StoredEvent]:
    """For each stream: its latest snapshot (if any), then its events after it; streams
    one after another, each in order."""
    if isinstance(events, PostgresAggregateRecorder):
        assert isinstance(snapshots, PostgresAggregateRecorder)
        statement = SQL(
            "WITH snap AS (SELECT DISTINCT ON (originator_id) originator_id, "
            "originator_version, topic, state FROM {schema}.{snapshots} "
            "WHERE originator_id = ANY(%s) ORDER BY originator_id, originator_version DESC) "
            "SELECT originator_id, 0 AS part, originator_version, topic, state FROM snap "
            "UNION ALL SELECT e.originator_id, 1, e.originator_version, e.topic, e.state "
            "FROM {schema}.{events} e LEFT JOIN snap s ON s.originator_id = e.originator_id "
            "WHERE e.originator_id = ANY(%s) "
            "AND e.originator_version > COALESCE(s.originator_version, 0) "
            "ORDER BY originator_id, part, originator_version"
        ).format(
            schema=Identifier(events.datastore.schema),
            snapshots=Identifier(snapshots.events_table_name),
            events=Identifier(events.events_table_name),
        )
        with (
            events.datastore.get_connection() as connection,
            connection.cursor(row_factory=tuple_row, binary=True) as cursor,
        ):
            cursor.execute(statement, (list(aggregate_ids), list(aggregate_ids)))
            rows = cursor.fetchall()
        return [StoredEvent(row[0], row[2], row[3], row[4]) for row in rows]
    marks = ",".join("?" for _ in aggregate_ids)
    hexes = [aggregate_id.hex for aggregate_id in aggregate_ids]
    statement_text = (
        "WITH snap AS (SELECT originator_id, MAX(originator_version) AS v FROM "
        f"{snapshots.events_table_name} WHERE originator_id IN ({marks}) "
        "GROUP BY originator_id) "
        "SELECT s.originator_id, 0 AS part, s.originator_version, s.topic, s.state FROM "
        f"{snapshots.events_table_name} s JOIN snap ON snap.originator_id = s.originator_id "
        "AND snap.v = s.originator_version "
        "UNION ALL SELECT e.originator_id, 1, e.originator_version, e.topic, e.state FROM "
        f"{events.events_table_name} e LEFT JOIN snap ON snap.originator_id = e.originator_id "
        f"WHERE e.originator_id IN ({marks}) AND e.originator_version > COALESCE(snap.v, 0) "
        "ORDER BY 1, 2, 3"
    )
    with events.datastore.transaction(commit=False) as cursor:
        cursor.execute(statement_text, [*hexes, *hexes])
        rows = cursor.fetchall()
    return [StoredEvent(UUID(row[0]), row[2], row[3], row[4]) for row in rows]
