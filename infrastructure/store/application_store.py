"""The eventsourcing ``Application`` wired to the scheduler's store.

The service (``infrastructure/application.py``) is built on this base: it opens the
store named by the settings (a typed error at once when it cannot be reached; on
PostgreSQL, tables created under a lock that replicas starting together take in turn),
encodes events with orjson, chains the stored events and seals the snapshots (the
``chained_*`` and ``sealed_*`` modules), and saves a batch's events in one transaction
in their order with the snapshots due. It knows no command and no aggregate rule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar
from uuid import UUID

from eventsourcing.application import (
    AggregateNotFoundError,
    Application,
    LRUCache,
    ProcessingEvent,
)
from eventsourcing.domain import Snapshot
from eventsourcing.persistence import (
    ApplicationRecorder,
    EventStore,
    InfrastructureFactory,
    IntegrityError,
    Mapper,
)
from eventsourcing.postgres import PostgresDatastore
from eventsourcing.sqlite import SQLiteDatastore
from eventsourcing.utils import EnvType, strtobool

from secondbox_scheduler.domain.audit.chain import Chain
from secondbox_scheduler.infrastructure.acting import (
    ACTOR_SETTING,
    actor_setting,
    current_actor,
    stamp,
)
from secondbox_scheduler.infrastructure.settings import (
    APPLICATION_RECORDER_TOPIC,
    AUDIT_KEY,
    CELL,
    CHAIN,
    CHAINED_RECORDERS,
    DATABASE_URL,
    DEFAULT_CELL,
    POSTGRES_MODULE,
    POSTGRES_SETTINGS,
    SQLITE_MODULE,
    TARGET_SESSION_ATTRS,
    settings_from_url,
)
from secondbox_scheduler.infrastructure.store.chain_tables import ChainedRecorder
from secondbox_scheduler.infrastructure.store.chained_postgres import ChainedPostgresRecorder
from secondbox_scheduler.infrastructure.store.encoding import EventMapper
from secondbox_scheduler.infrastructure.store.fast_forward import load_many
from secondbox_scheduler.infrastructure.store.probe import probe_store
from secondbox_scheduler.infrastructure.store.reconnect import Reconnect, install_reconnect
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots
from secondbox_scheduler.infrastructure.store.sealed_sqlite import SealedSQLiteSnapshots
from secondbox_scheduler.infrastructure.store.startup import (
    STARTUP_LOCK_TIMEOUT_MS,
    check_sqlite,
    connect_postgres,
    postgres_schema_lock,
)
from secondbox_scheduler.infrastructure.store.write_timeouts import (
    DEFAULT_WRITE_LOCK_TIMEOUT_MS,
    DEFAULT_WRITE_STATEMENT_TIMEOUT_MS,
    WRITE_LOCK_TIMEOUT_MS,
    WRITE_STATEMENT_TIMEOUT_MS,
    milliseconds,
)
from secondbox_scheduler.projections.event_log import count_events, last_versions

A = TypeVar("A")
log = logging.getLogger("secondbox_scheduler.store")


class StoredApplication(Application[UUID]):
    """An eventsourcing application on the scheduler's store (no commands)."""

    _may_create = True
    reconnect: Reconnect | None = None

    def __init__(self, env: EnvType | None = None) -> None:
        super().__init__(env)
        # who the events of a command record when its context names nobody (acting.py)
        self.default_actor = actor_setting(self.env.get(ACTOR_SETTING))

    def probe_store(self) -> None:
        """StoreUnavailableError unless the store answers now (one connection, no retries)."""
        probe_store(self.env)

    @contextmanager
    def _opening(self, planned: Any) -> Iterator[None]:
        """Open the store named by the settings: a typed error at once when it cannot be
        reached (:mod:`.store_startup`); on PostgreSQL, tables created under a lock that
        replicas starting together take in turn."""
        module = planned.get("PERSISTENCE_MODULE", "")
        if module == POSTGRES_MODULE:
            settings = {
                key: planned.get(key) or "" for key in (*POSTGRES_SETTINGS, STARTUP_LOCK_TIMEOUT_MS)
            }
            if strtobool(planned.get("CREATE_TABLE") or "y"):
                with postgres_schema_lock(settings) as may_create:
                    # a role without CREATE on the schema (the append-only application
                    # role, docs/operations.md) opens the tables its owner created
                    self._may_create = may_create
                    yield
                return
            connect_postgres(settings).close()
        elif module == SQLITE_MODULE:
            check_sqlite(planned.get("SQLITE_DBNAME") or "")
        yield

    @property
    def cell(self) -> str:
        """The name of the cell this store is (``SECONDBOX_CELL``; ``default``)."""
        return str(self.env.get(CELL) or DEFAULT_CELL)

    def construct_factory(self, env: Any) -> InfrastructureFactory:
        """The library's factory; on PostgreSQL its connections reconnect after the
        primary disappears (:mod:`.reconnect`)."""
        factory = super().construct_factory(env)
        datastore = getattr(factory, "datastore", None)
        self.reconnect = install_reconnect(datastore, env, env.get(CELL) or None)
        if self.reconnect is not None:
            self.reconnect.on_recovered.append(self.forget_cached)
        return factory

    def forget_cached(self) -> None:
        """Drop what this process holds of the store in memory (after a reconnection:
        the new primary may hold less than the lost one acknowledged)."""
        cache = getattr(getattr(self, "repository", None), "cache", None)
        if cache is None:
            return
        # the library's LRUCache.clear() only resets its queue: empty its dict too
        lock = getattr(cache, "lock", None)
        with lock if lock is not None else nullcontext():
            cache.cache.clear()
            if isinstance(cache, LRUCache):
                cache.clear()
                cache.full = False

    def construct_env(self, name: str, env: EnvType | None = None) -> Any:
        environment = super().construct_env(name, env)
        url = environment.get(DATABASE_URL)
        if url:
            environment.update(settings_from_url(url))
        module = environment.get("PERSISTENCE_MODULE") or ""
        chained = (environment.get(CHAIN) or "on").lower() != "off"
        if (
            chained
            and module in CHAINED_RECORDERS
            and not environment.get(APPLICATION_RECORDER_TOPIC)
        ):
            environment[APPLICATION_RECORDER_TOPIC] = CHAINED_RECORDERS[module]
        if not getattr(self, "_may_create", True):
            environment["CREATE_TABLE"] = "n"
        return environment

    @property
    def chain(self) -> Chain:
        """The chain of the stored events (keyed with ``SECONDBOX_AUDIT_KEY`` if set)."""
        key = self.env.get(AUDIT_KEY) or ""
        return Chain(key.encode() or None)

    def construct_mapper(self) -> Mapper[UUID]:
        """The domain's events encoded with orjson (:mod:`.event_encoding`), unless the
        environment names another mapper (``MAPPER_TOPIC``)."""
        mapper_class = None if self.env.get(self.factory.MAPPER_TOPIC) else EventMapper
        return self.factory.mapper(
            transcoder=self.construct_transcoder(), mapper_class=mapper_class
        )

    def construct_recorder(self) -> ApplicationRecorder:
        recorder = super().construct_recorder()
        datastore = getattr(self.factory, "datastore", None)
        attrs = self.env.get(TARGET_SESSION_ATTRS)
        kwargs = getattr(getattr(datastore, "pool", None), "kwargs", None)
        if attrs and isinstance(kwargs, dict):  # a multi-host URL's choice of host
            kwargs["target_session_attrs"] = attrs
        if isinstance(recorder, ChainedRecorder):
            recorder.configure(self.chain)
        if isinstance(recorder, ChainedPostgresRecorder):  # docs/operations.md, "Timeouts"
            recorder.set_write_timeouts(
                milliseconds(self.env, WRITE_LOCK_TIMEOUT_MS, DEFAULT_WRITE_LOCK_TIMEOUT_MS),
                milliseconds(
                    self.env, WRITE_STATEMENT_TIMEOUT_MS, DEFAULT_WRITE_STATEMENT_TIMEOUT_MS
                ),
            )
        return recorder

    def construct_snapshot_store(self) -> EventStore[UUID]:
        """Snapshots sealed by the chain (``sealed_*`` modules) when the events are chained."""
        store = super().construct_snapshot_store()
        recorder = self.recorder
        if not isinstance(recorder, ChainedRecorder):
            return store
        name = store.recorder.events_table_name  # type: ignore[attr-defined]
        create = strtobool(self.env.get("CREATE_TABLE") or "y")
        datastore = getattr(self.factory, "datastore", None)
        sealed: SealedSnapshots
        if isinstance(datastore, SQLiteDatastore):
            sealed = SealedSQLiteSnapshots(datastore, events_table_name=name)
        elif isinstance(datastore, PostgresDatastore):
            sealed = SealedPostgresSnapshots(datastore, events_table_name=name)
            if isinstance(recorder, ChainedPostgresRecorder):
                sealed.write_lock_timeout = recorder.write_lock_timeout
        else:  # pragma: no cover - chained recorders exist for these two stores only
            return store
        sealed.configure(self.chain, recorder.events_table_name)  # before its tables
        if create:
            sealed.create_table()
        return EventStore(mapper=self.mapper, recorder=sealed)

    # -- loading ---------------------------------------------------------------

    def _cache_current(self) -> None:
        """Before the cache is read: a store known to be down is reconnected first (and
        the cache forgotten), so that no cached aggregate of a lost primary answers."""
        if self.reconnect is not None:
            self.reconnect.ready()

    def load(self, aggregate_id: UUID, kind: type[A], *, copy: bool = True) -> A | None:
        """The aggregate, or None. ``copy=False`` returns the cached instance itself:
        only for reading a few scalar fields, never for commands."""
        self._cache_current()
        try:
            aggregate: object = self.repository.get(aggregate_id, deepcopy_from_cache=copy)
        except AggregateNotFoundError:
            return None
        assert isinstance(aggregate, kind)
        return aggregate

    def load_stored(self, aggregate_id: UUID) -> Any | None:
        """The aggregate as stored now (the cached instance: read, never command)."""
        self._cache_current()
        try:
            return self.repository.get(aggregate_id, deepcopy_from_cache=False)
        except AggregateNotFoundError:
            return None

    def load_many(
        self, aggregate_ids: Sequence[UUID], *, cache_new: bool = True
    ) -> dict[UUID, Any]:
        """Up-to-date copies of many aggregates in two queries (:mod:`.fast_forward`)."""
        self._cache_current()
        return load_many(self, aggregate_ids, cache_new=cache_new)

    def cache_committed(self, aggregates: Sequence[Any]) -> None:
        """Committed aggregates replace their cached copies (the library caches nothing
        on a save when it fast-forwards)."""
        cache = self.repository.cache
        if cache is None:
            return
        for aggregate in aggregates:
            cache.put(aggregate.id, aggregate)

    # -- saving ----------------------------------------------------------------

    def save_in_order(self, events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None:
        """Save ``events`` in one transaction in exactly this order (a batch keeps each
        placement's events together, as a single placement writes them); snapshots of
        ``aggregates`` as a save of them would take."""
        processing_event: ProcessingEvent[UUID] = ProcessingEvent()
        processing_event.events = list(events)
        processing_event.aggregates = {aggregate.id: aggregate for aggregate in aggregates}
        recordings = self._record(processing_event)
        self._take_snapshots(processing_event)
        self._notify(recordings)

    def _record(self, processing_event: ProcessingEvent[UUID]) -> Any:
        """The library's, with each new event's actor set (:mod:`..acting`) and the
        snapshots due written in the same transaction (and,
        on PostgreSQL, through the same function of the schema owner) on a chained
        PostgreSQL store: one commit for the events and the snapshots taken at them.
        The request-serving role may not insert a snapshot otherwise
        (docs/operations.md)."""
        stamp(processing_event.events, current_actor() or self.default_actor)
        if self.reconnect is not None and self.reconnect.reconnects:
            self._refuse_gaps(processing_event.events)
        events_recorder, snapshots = self.recorder, self.snapshots
        if (
            snapshots is not None
            and isinstance(events_recorder, ChainedPostgresRecorder)
            and isinstance(snapshots.recorder, SealedPostgresSnapshots)
            and snapshots.recorder.datastore is events_recorder.datastore
            and "snapshots" not in processing_event.saved_kwargs
        ):
            taken = self._snapshots_due(processing_event)
            if taken:
                stored = [snapshots.mapper.to_stored_event(snapshot) for snapshot in taken]
                processing_event.saved_kwargs["snapshots"] = snapshots.recorder.within(stored)
        return super()._record(processing_event)

    def _refuse_gaps(self, events: Sequence[Any]) -> None:
        """After a reconnection, before each save: every aggregate's previous version is
        in the store. After an asynchronous failover the new primary can hold less than
        the lost one acknowledged, and an aggregate this process read from the lost one
        (cached, or loaded by a command that was running across the reconnection) is
        ahead of the store: its next event would leave a gap in its stream (versions
        that are nowhere), which the unique (id, version) key does not refuse. Such a
        save is a lost race: the cache is forgotten and the command runs again on what
        the store holds (``IntegrityError``, retried by :mod:`..retrying`)."""
        first: dict[UUID, int] = {}
        for event in events:
            version = int(event.originator_version)
            first[event.originator_id] = min(first.get(event.originator_id, version), version)
        following = [stream for stream, version in first.items() if version > 1]
        stored = last_versions(self.recorder, following)
        behind = [s for s in following if stored.get(s, 0) < first[s] - 1]
        if behind:
            self.forget_cached()
            raise IntegrityError(
                f"{len(behind)} aggregate(s) ahead of the store (read before the failover), "
                f"e.g. {behind[0]} at version {first[behind[0]] - 1}, the store at "
                f"{stored.get(behind[0], 0)}"
            )

    def _take_snapshots(self, processing_event: ProcessingEvent[UUID]) -> None:
        """Snapshot each saved aggregate whose new events passed a multiple of its
        interval, from the aggregate in memory (the library reads it back from the store
        for every such event; a batch passes several on a busy runner); none when the
        save wrote them (:meth:`_record`)."""
        if "snapshots" in processing_event.saved_kwargs:
            return
        taken = self._snapshots_due(processing_event)
        if taken:  # one transaction for all of them
            self._put_snapshots(taken)

    def _put_snapshots(self, taken: list[Any]) -> None:
        """Store snapshots of events already committed. One that cannot be stored (a
        lock held elsewhere past the write lock timeout) is skipped, with a warning:
        the events are saved, and a later save passes the interval again."""
        if self.snapshots is None:
            return
        try:
            self.snapshots.put(taken)
        except IntegrityError as error:
            log.warning("snapshots skipped (the events are saved): %s", error)

    def snapshotting_interval(self, aggregate: Any) -> int | None:
        """How many events apart ``aggregate`` is snapshotted as it is now: its class's
        ``snapshotting_intervals`` entry (None: never); an application may vary it
        with the aggregate's state."""
        return self.snapshotting_intervals.get(type(aggregate))

    def _snapshots_due(self, processing_event: ProcessingEvent[UUID]) -> list[Any]:
        """The snapshots of the aggregates of ``processing_event`` whose new events pass
        a multiple of their snapshotting interval, taken from the aggregates in memory."""
        if self.snapshots is None:
            return []
        versions: dict[UUID, list[int]] = {}
        for event in processing_event.events:
            versions.setdefault(event.originator_id, []).append(event.originator_version)
        taken = []
        for aggregate_id, aggregate in processing_event.aggregates.items():
            interval = self.snapshotting_interval(aggregate)
            written = versions.get(aggregate_id, ())
            if interval and any(version % interval == 0 for version in written):
                assert aggregate.version == max(written)
                snapshot_class = getattr(type(aggregate), "Snapshot", Snapshot)
                taken.append(snapshot_class.take(aggregate))
        return taken

    def stream_versions(self, stream_ids: Sequence[UUID]) -> dict[UUID, int]:
        """The last stored version of each stream (absent: no such stream)."""
        return last_versions(self.recorder, stream_ids)

    def event_count(self) -> int:
        """How many events the store holds (all aggregates of this application)."""
        return count_events(self.recorder)

    def head_position(self) -> int:
        """The notification log's head position (may exceed the count on PostgreSQL)."""
        return self.recorder.max_notification_id() or 0
