"""Recorders that chain every stored event and seal every snapshot (domain/audit/chain.py).

:class:`ChainedSQLiteRecorder` and :class:`ChainedPostgresRecorder` are the library's
application recorders plus a chain table (``<events table>_chain``: position, previous
position, digest), written in the same transaction as the events. Inserts are already
serialised (SQLite: the database's write lock; PostgreSQL: the events table's
``EXCLUSIVE`` lock), so the head of the chain read inside the transaction is the link
before the new events, whichever replica commits next.

On PostgreSQL the lock is taken by a ``SECURITY DEFINER`` function owned by the schema
owner (``<events table>_lock()``) instead of ``LOCK TABLE`` in the application's own
session: ``LOCK TABLE ... IN EXCLUSIVE MODE`` needs UPDATE, DELETE or TRUNCATE privilege
on the table, which an append-only application role does not have (docs/operations.md).

:class:`SealedSQLiteSnapshots` and :class:`SealedPostgresSnapshots` store each snapshot
with a seal (``<snapshots table>_seal``) over the chain digest of the event at the
snapshot's version, and return from ``select_events`` only snapshots whose seal checks:
a forged, edited or mismatched snapshot is dropped with a warning, and the repository
then loads the aggregate from its events.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any
from uuid import UUID

from eventsourcing.persistence import (
    InterfaceError,
    OperationalError,
    PersistenceError,
    ProgrammingError,
    StoredEvent,
)
from eventsourcing.postgres import (
    PostgresAggregateRecorder,
    PostgresApplicationRecorder,
    PostgresDatastore,
)
from eventsourcing.sqlite import (
    SQLiteAggregateRecorder,
    SQLiteApplicationRecorder,
    SQLiteCursor,
    SQLiteDatastore,
)
from eventsourcing.utils import retry
from psycopg import Rollback
from psycopg.errors import InsufficientPrivilege, UndefinedFunction
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composable, Composed, Identifier, Literal

from secondbox_scheduler.domain.audit.chain import Chain, ChainedEvent, Link
from secondbox_scheduler.infrastructure.store.server_append import (
    APPEND_ARGUMENTS,
    APPEND_WITH_SNAPSHOTS_ARGUMENTS,
    append_function,
    append_function_statement,
    append_with_snapshots_function,
    append_with_snapshots_statement,
    usable_in_server,
)

log = logging.getLogger("secondbox_scheduler.chain")

UNCHAINED = "no chain link at its version (written before the chain)"
MAX_IDENTIFIER_LENGTH = 63  # PostgreSQL's NAMEDATALEN - 1


def _quoted(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def chain_table(events_table: str) -> str:
    return f"{events_table}_chain"


def seal_table(snapshots_table: str) -> str:
    return f"{snapshots_table}_seal"


def lock_function(events_table: str) -> str:
    return f"{events_table}_lock"


def _as_link(row: Sequence[Any] | None) -> Link | None:
    return None if row is None else Link(int(row[0]), int(row[1]), bytes(row[2]))


def unnested_insert(recorder: PostgresAggregateRecorder, returning: bool) -> Composed:
    """The recorder's INSERT of stored events from four arrays (ids, versions, topics,
    states) instead of one array of its composite type: psycopg dumps plain arrays
    in binary (``%b``), where the composite array was dumped as text with
    regular-expression escaping of every field (0.7 ms of a batched placement's 2.4 ms
    of Python in a profile)."""
    id_type = SQL(recorder.datastore.originator_id_type)
    statement = SQL(
        "INSERT INTO {schema}.{table} (originator_id, originator_version, topic, state) "
        "SELECT * FROM unnest(%b::{id_type}[], %b::bigint[], %b::text[], %b::bytea[])"
    ).format(
        schema=Identifier(recorder.datastore.schema),
        table=Identifier(recorder.events_table_name),
        id_type=id_type,
    )
    return statement + SQL(" RETURNING notification_id") if returning else statement


def chain_digests_statement(names: dict[str, Identifier]) -> Composed:
    """The chain digest of each (originator id, version) of two arrays, each event found
    through the primary key and its link through the position (``OFFSET 0`` keeps the
    planner from hashing the whole events table when it has no statistics yet)."""
    return SQL(
        "SELECT e.originator_id, e.originator_version, c.digest "
        "FROM unnest(%b::uuid[], %b::bigint[]) AS v(id, version) CROSS JOIN LATERAL "
        "(SELECT originator_id, originator_version, notification_id FROM {schema}.{events} "
        "WHERE originator_id = v.id AND originator_version = v.version OFFSET 0) AS e "
        "CROSS JOIN LATERAL (SELECT digest FROM {schema}.{chain} "
        "WHERE position = e.notification_id OFFSET 0) AS c"
    ).format(**names)


def seal_and_digest(names: dict[str, Identifier], alias: str) -> Composed:
    """A snapshot's seal and the chain digest of the event it was taken at, each read
    through a primary key (correlated subqueries: no plan joins whole tables first)."""
    return SQL(
        "(SELECT g.seal FROM {schema}.{seals} g WHERE g.originator_id = {alias}.originator_id "
        "AND g.originator_version = {alias}.originator_version) AS seal, "
        "(SELECT c.digest FROM {schema}.{events} e JOIN {schema}.{chain} c "
        "ON c.position = e.notification_id WHERE e.originator_id = {alias}.originator_id "
        "AND e.originator_version = {alias}.originator_version) AS digest"
    ).format(alias=Identifier(alias), **names)


LZ4_LOCK_TIMEOUT = "50ms"  # the longest a start waits to change a table's compression


def compress_states_with_lz4(datastore: PostgresDatastore, table: str) -> bool:
    """The ``state`` column of the events or snapshots table compressed with LZ4
    instead of PostgreSQL's default pglz (a state over about 2 KB is compressed): a
    snapshot of a runner holding 700 reservations is 145 KB of JSON, which pglz
    compressed in about 2 ms of the server's time in each save that took it, and every
    placement's ``AssignmentFenced`` is 3 KB (docs/performance.md). Run after the
    tables are created, by the role that creates them, in a transaction of its own:
    only when the column is not LZ4 yet, the server has LZ4 (PostgreSQL 14 and later,
    built with it) and no other session holds a lock on the table, and then waiting at
    most ``LZ4_LOCK_TIMEOUT`` for the ACCESS EXCLUSIVE lock the ``ALTER`` takes (every
    other session's access to the table queues behind a waiting ``ALTER``: found by
    review, a reader holding the table stalled saves for the whole wait). Otherwise
    the table keeps pglz, and a later start tries again. Rows already stored keep
    their compression; both are read alike. Whether the column is LZ4 now."""
    try:
        with datastore.transaction(commit=True) as curs:
            curs.execute(
                "SELECT a.attcompression = 'l' AS lz4, 'lz4' = ANY(s.enumvals) AS available, "
                "EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.relation = c.oid "
                "AND l.pid <> pg_backend_pid()) AS busy "
                "FROM pg_catalog.pg_class c "
                "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                "JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attname = 'state' "
                "CROSS JOIN pg_catalog.pg_settings s "
                "WHERE n.nspname = %s AND c.relname = %s "
                "AND s.name = 'default_toast_compression'",
                (datastore.schema, table),
            )
            row = curs.fetchone()
            if row is None or row["lz4"] or not row["available"] or row["busy"]:
                return bool(row and row["lz4"])
            curs.execute(SQL("SET LOCAL lock_timeout = {}").format(Literal(LZ4_LOCK_TIMEOUT)))
            curs.execute(
                SQL("ALTER TABLE {}.{} ALTER COLUMN state SET COMPRESSION lz4").format(
                    Identifier(datastore.schema), Identifier(table)
                )
            )
        return True
    except PersistenceError as error:  # LockNotAvailable, a server without LZ4, ...
        log.info("%s.%s keeps its compression (%s)", datastore.schema, table, error)
        return False


def compiled(statement: Composed) -> bytes:
    """A statement rendered once, to execute many times."""
    return statement.as_bytes(None)


def unnested(stored_events: Sequence[StoredEvent]) -> tuple[list[Any], ...]:
    """The four arrays (ids, versions, topics, states) of ``stored_events``."""
    return (
        [s.originator_id for s in stored_events],
        [s.originator_version for s in stored_events],
        [s.topic for s in stored_events],
        [s.state for s in stored_events],
    )


def insert_unnested(curs: Any, statement: bytes, stored_events: Sequence[StoredEvent]) -> None:
    curs.execute(statement, unnested(stored_events), prepare=True)


class ChainedRecorder:
    """What the chained recorders share: the chain (keyed or not) they write."""

    chain: Chain = Chain()
    events_table_name: str

    def configure(self, chain: Chain) -> None:
        self.chain = chain

    @property
    def chain_table_name(self) -> str:
        return chain_table(self.events_table_name)


class ChainedSQLiteRecorder(ChainedRecorder, SQLiteApplicationRecorder):
    """SQLite: the position of an event is its rowid."""

    def __init__(self, datastore: SQLiteDatastore, events_table_name: str = "stored_events"):
        super().__init__(datastore, events_table_name)
        chain = chain_table(events_table_name)
        self.select_head_statement = (
            f"SELECT position, previous, digest FROM {chain} ORDER BY position DESC LIMIT 1"
        )
        self.insert_links_statement = f"INSERT INTO {chain} VALUES (?, ?, ?)"

    def construct_create_table_statements(self) -> list[str]:
        statements = super().construct_create_table_statements()
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {chain_table(self.events_table_name)} ("
            "position INTEGER PRIMARY KEY, previous INTEGER NOT NULL, digest BLOB NOT NULL)"
        )
        return statements

    def _insert_events(
        self, c: SQLiteCursor, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        positions = super()._insert_events(c, stored_events, **kwargs)
        assert positions is not None
        c.execute(self.select_head_statement)
        head = _as_link(c.fetchone())
        links = self.chain.links(
            head,
            [
                ChainedEvent(p, s.originator_id, s.originator_version, s.topic, s.state)
                for p, s in zip(positions, stored_events, strict=True)
            ],
        )
        c.executemany(
            self.insert_links_statement, [(k.position, k.previous, k.digest) for k in links]
        )
        return positions


class SavesInServer:
    """What the two recorders that save through a function of :mod:`.server_append`
    share: whether they may (looked up once) and what a failed call of it means."""

    chain: Chain
    datastore: PostgresDatastore
    append_signature: str
    _appends_in_server: bool | None

    def appends_in_server(self) -> bool:
        """Whether a save goes through the function of ``append_signature``: an
        unkeyed chain over UUID ids (a key never goes to the server), a UTF8 database
        and the function present and this role's to run (:func:`usable_in_server`).
        Looked up once; a save that finds it gone or forbidden saves without it from
        then on."""
        if self._appends_in_server is None:
            self._appends_in_server = (
                not self.chain.keyed
                and self.datastore.originator_id_type == "uuid"
                and usable_in_server(self.datastore, self.append_signature)
            )
        return self._appends_in_server

    def gone_from_server(self, error: ProgrammingError) -> bool:
        """After a call of the function failed (nothing was stored): whether the
        function is gone or no longer this role's (then the client links or seals, for
        this save and the next), rather than an error of the save itself. Found by
        review: a table the role may not write fails with the same
        ``InsufficientPrivilege``, and the server's saves stayed off after the grant was
        mended; so the function is looked up again."""
        if not isinstance(error.__cause__, UndefinedFunction | InsufficientPrivilege):
            return False
        self._appends_in_server = None
        return not self.appends_in_server()


class ChainedPostgresRecorder(SavesInServer, ChainedRecorder, PostgresApplicationRecorder):
    """PostgreSQL: the position of an event is its notification id."""

    def __init__(
        self, datastore: PostgresDatastore, *, events_table_name: str = "stored_events"
    ) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        schema = Identifier(datastore.schema)
        events = Identifier(events_table_name)
        chain = Identifier(chain_table(events_table_name))
        function = Identifier(lock_function(events_table_name))
        self.check_identifier_length(chain_table(events_table_name))
        self.sql_create_statements.append(
            SQL(
                "CREATE TABLE IF NOT EXISTS {}.{} (position bigint PRIMARY KEY, "
                "previous bigint NOT NULL, digest bytea NOT NULL)"
            ).format(schema, chain)
        )
        self.sql_create_statements.append(
            SQL(
                "CREATE OR REPLACE FUNCTION {schema}.{function}() RETURNS void "
                "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS "
                "$BODY$BEGIN LOCK TABLE {schema}.{events} IN EXCLUSIVE MODE; END;$BODY$"
            ).format(schema=schema, function=function, events=events)
        )
        append = Identifier(append_function(events_table_name))
        self.check_identifier_length(append_function(events_table_name))
        self.sql_create_statements.append(
            append_function_statement(schema, events, chain, function, append, self.channel_name)
        )
        self.append_statement = compiled(
            SQL(
                "SELECT * FROM {}.{}(%b::uuid[], %b::bigint[], %b::text[], %b::bytea[], %s)"
            ).format(schema, append)
        )
        self.append_signature = (
            f"{_quoted(datastore.schema)}.{_quoted(append_function(events_table_name))}"
            f"({APPEND_ARGUMENTS})"
        )
        self._appends_in_server: bool | None = None  # known at the first save
        # statements rendered once: psycopg renders a Composed again at every execute
        self.lock_table_statements = [
            compiled(SQL("SET LOCAL lock_timeout = '{0}s'").format(datastore.lock_timeout)),
            compiled(SQL("SELECT {}.{}()").format(schema, function)),
        ]
        self.notify_statement = compiled(SQL("NOTIFY {}").format(Identifier(self.channel_name)))
        self.insert_unnested_statement = compiled(unnested_insert(self, returning=True))
        self.select_head_statement = compiled(
            SQL(
                "SELECT position, previous, digest FROM {}.{} ORDER BY position DESC LIMIT 1"
            ).format(schema, chain)
        )
        # every link of a save in one statement (arrays unnested), not one per event
        self.insert_links_statement = compiled(
            SQL(
                "INSERT INTO {}.{} SELECT * FROM unnest(%b::bigint[], %b::bigint[], %b::bytea[])"
            ).format(schema, chain)
        )

    def create_table(self) -> None:
        super().create_table()
        compress_states_with_lz4(self.datastore, self.events_table_name)

    def _notify_channel(self, curs: Any) -> None:
        curs.execute(self.notify_statement)

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def insert_events(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        snapshots: SnapshotsWithin | None = None,
        **kwargs: Any,
    ) -> Sequence[int] | None:
        """As the library's (one pipelined transaction), with the head of the chain read
        after the lock and the new links inserted before the commit; and ``snapshots``
        (:meth:`SealedPostgresSnapshots.within`), snapshots taken at some of these
        events, sealed with their links' digests and written in the same transaction:
        one commit for both."""
        if self.datastore.enable_db_functions:
            raise ProgrammingError("the chained recorder does not use database functions")
        if stored_events and self.appends_in_server():
            try:
                return self._append_in_server(stored_events, snapshots)
            except ProgrammingError as error:
                if not self.gone_from_server(error):
                    raise
                log.warning("%s: linking the chain in the client", error)
        exc: Exception | None = None
        notification_ids: Sequence[int] | None = None
        with self.datastore.get_connection() as conn:
            with conn.pipeline() as pipeline, conn.transaction():
                with conn.cursor() as curs:
                    self._lock_table(curs)
                    self._notify_channel(curs)
                if stored_events:
                    with (
                        conn.cursor(row_factory=tuple_row) as head_cursor,
                        conn.cursor() as curs,
                    ):
                        try:
                            head_cursor.execute(self.select_head_statement, prepare=True)
                            insert_unnested(curs, self.insert_unnested_statement, stored_events)
                            pipeline.sync()
                            notification_ids = self._fetch_ids_after_insert_events(
                                curs, stored_events
                            )
                            assert notification_ids is not None
                            head = _as_link(head_cursor.fetchone())
                            links = self.chain.links(
                                head,
                                [
                                    ChainedEvent(
                                        p, s.originator_id, s.originator_version, s.topic, s.state
                                    )
                                    for p, s in zip(notification_ids, stored_events, strict=True)
                                ],
                            )
                            curs.execute(
                                self.insert_links_statement,
                                (
                                    [k.position for k in links],
                                    [k.previous for k in links],
                                    [k.digest for k in links],
                                ),
                                prepare=True,
                            )
                            if snapshots is not None:
                                snapshots.write(curs, stored_events, [k.digest for k in links])
                        except Exception as e:
                            exc = e  # raised after the pipeline is closed, as the library does
                if exc is not None:
                    # whatever failed (the server, psycopg before sending, our own code):
                    # nothing sent so far may be committed (events without their links)
                    raise Rollback
            if exc:
                raise exc
        return notification_ids

    def _append_in_server(
        self, stored_events: Sequence[StoredEvent], snapshots: SnapshotsWithin | None
    ) -> Sequence[int]:
        """The save as one statement (``<events>_append``: lock, events, links, the
        notification), its own transaction on the pool's autocommit connection: one
        round trip, the commit included. With snapshots, which are sealed with the new
        links' digests: ``<events>_append_with_snapshots`` seals and writes them in the
        same statement; where it is absent or forbidden, the append then the snapshots,
        in one transaction (two round trips)."""
        params = (*unnested(stored_events), f"{self.datastore.lock_timeout}s")
        if snapshots is not None and snapshots.recorder.appends_in_server():
            try:
                return self._appended(
                    stored_events,
                    snapshots.recorder.append_statement,
                    (*params, *unnested(snapshots.stored)),
                )
            except ProgrammingError as error:
                if not snapshots.recorder.gone_from_server(error):
                    raise
                log.warning("%s: sealing the snapshots in the client", error)
        if snapshots is None:
            return self._appended(stored_events, self.append_statement, params)
        exc: Exception | None = None
        with (
            self.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as appended,
        ):
            with conn.pipeline() as pipeline, conn.transaction(), conn.cursor() as curs:
                try:
                    appended.execute(self.append_statement, params, prepare=True)
                    pipeline.sync()
                    rows = appended.fetchall()
                    snapshots.write(curs, stored_events, [bytes(row[1]) for row in rows])
                except Exception as e:
                    exc = e  # raised after the pipeline is closed, as the library does
                if exc is not None:
                    raise Rollback
            if exc:
                raise exc
        return self._positions(rows, stored_events)

    def _appended(
        self, stored_events: Sequence[StoredEvent], statement: bytes, params: tuple[Any, ...]
    ) -> Sequence[int]:
        """The positions of ``stored_events`` saved by one statement (a function of
        :mod:`.server_append`) on the pool's autocommit connection."""
        with (
            self.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as appended,
        ):
            appended.execute(statement, params, prepare=True)
            rows = appended.fetchall()
        return self._positions(rows, stored_events)

    @staticmethod
    def _positions(rows: Sequence[Any], stored_events: Sequence[StoredEvent]) -> list[int]:
        if len(rows) != len(stored_events):
            raise ProgrammingError(
                f"Couldn't get all notification IDs (got {len(rows)}, "
                f"expected {len(stored_events)})"
            )
        return [int(row[0]) for row in rows]


class SnapshotsWithin:
    """Snapshots that a save writes in its own transaction (one commit for the events
    and the snapshots taken at them), sealed with the digests of the links the same
    transaction writes."""

    def __init__(self, recorder: SealedPostgresSnapshots, stored: list[StoredEvent]) -> None:
        self.recorder = recorder
        self.stored = stored

    def write(self, curs: Any, saved: Sequence[StoredEvent], digests: Sequence[bytes]) -> None:
        """Write them on ``curs``, sealed with the chain digests of ``saved`` (the
        events of the save, each with its digest, in order)."""
        self.recorder.write_sealed(
            curs,
            self.stored,
            {
                (e.originator_id, e.originator_version): digest
                for e, digest in zip(saved, digests, strict=True)
            },
        )


# -- snapshots ----------------------------------------------------------------------


class SealedSnapshots:
    """What the sealing snapshot recorders share."""

    chain: Chain = Chain()
    events_table_name: str
    chained_events_table: str = "stored_events"

    def configure(self, chain: Chain, events_table: str) -> None:
        self.chain = chain
        self.chained_events_table = events_table

    def seal_for(self, event: StoredEvent, chain_digest: bytes) -> bytes:
        return self.chain.seal(
            chain_digest, event.originator_id, event.originator_version, event.topic, event.state
        )

    def refusal(self, event: StoredEvent, seal: bytes | None, chain_digest: bytes | None) -> str:
        """Why this stored snapshot cannot be trusted ("" if its seal checks)."""
        if chain_digest is None:
            return UNCHAINED
        if seal is None:
            return "no seal"
        if not hmac.compare_digest(self.seal_for(event, chain_digest), seal):
            return "its seal does not match its state and the chain at its version"
        return ""

    def select_latest(self, originator_ids: Sequence[UUID]) -> dict[UUID, StoredEvent]:
        """The latest snapshot of each stream whose seal checks, with one query for all
        (a stream whose latest snapshot does not check is absent: load it from its
        events). A placement batch reads its cold aggregates this way."""
        raise NotImplementedError

    def select_latest_and_after(
        self, originator_ids: Sequence[UUID]
    ) -> tuple[dict[UUID, StoredEvent], list[StoredEvent], set[UUID]] | None:
        """With one query: the latest snapshot of each stream whose seal checks, the
        events after each stream's latest snapshot (all its events if it has none), and
        the streams whose latest snapshot was refused (their events up to it are still
        to read). None: this store reads them with :meth:`select_latest` and a second
        query."""
        return None

    def verified(self, rows: Sequence[tuple[StoredEvent, Any, Any]]) -> list[StoredEvent]:
        """The snapshots whose seal checks; each other one logged and dropped."""
        kept = []
        for event, seal, chain_digest in rows:
            reason = self.refusal(
                event,
                None if seal is None else bytes(seal),
                None if chain_digest is None else bytes(chain_digest),
            )
            if not reason:
                kept.append(event)
                continue
            (log.debug if reason == UNCHAINED else log.warning)(
                "snapshot of %s at version %s refused (%s): loading it from its events",
                event.originator_id,
                event.originator_version,
                reason,
            )
        return kept


class SealedSQLiteSnapshots(SealedSnapshots, SQLiteAggregateRecorder):
    def construct_create_table_statements(self) -> list[str]:
        statements = super().construct_create_table_statements()
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {seal_table(self.events_table_name)} ("
            "originator_id TEXT, originator_version INTEGER, seal BLOB NOT NULL, "
            "PRIMARY KEY (originator_id, originator_version))"
        )
        return statements

    def _insert_events(
        self, c: SQLiteCursor, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        super()._insert_events(c, stored_events, **kwargs)
        events, chain = self.chained_events_table, chain_table(self.chained_events_table)
        seals = []
        for s in stored_events:
            identity = s.originator_id.hex if isinstance(s.originator_id, UUID) else s.originator_id
            c.execute(
                f"SELECT c.digest FROM {events} e JOIN {chain} c ON c.position = e.rowid "
                "WHERE e.originator_id = ? AND e.originator_version = ?",
                (identity, s.originator_version),
            )
            row = c.fetchone()
            if row is not None:
                seals.append((identity, s.originator_version, self.seal_for(s, bytes(row[0]))))
        if seals:
            c.executemany(
                f"INSERT INTO {seal_table(self.events_table_name)} VALUES (?, ?, ?)", seals
            )
        return None

    def select_events(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        snapshots, seals = self.events_table_name, seal_table(self.events_table_name)
        events, chain = self.chained_events_table, chain_table(self.chained_events_table)
        statement = (
            f"SELECT s.originator_id, s.originator_version, s.topic, s.state, g.seal, c.digest "
            f"FROM {snapshots} s LEFT JOIN {seals} g ON g.originator_id = s.originator_id "
            "AND g.originator_version = s.originator_version "
            f"LEFT JOIN {events} e ON e.originator_id = s.originator_id "
            "AND e.originator_version = s.originator_version "
            f"LEFT JOIN {chain} c ON c.position = e.rowid WHERE s.originator_id = ? "
        )
        params: list[Any] = [
            originator_id.hex if isinstance(originator_id, UUID) else originator_id
        ]
        if gt is not None:
            statement += "AND s.originator_version > ? "
            params.append(gt)
        if lte is not None:
            statement += "AND s.originator_version <= ? "
            params.append(lte)
        statement += "ORDER BY s.originator_version " + ("DESC " if desc else "ASC ")
        if limit is not None:
            statement += "LIMIT ?"
            params.append(limit)
        with self.datastore.transaction(commit=False) as c:
            c.execute(statement, params)
            rows = c.fetchall()
        return self.verified([
            (
                StoredEvent(self.convert_originator_id(r[0]), r[1], r[2], bytes(r[3])),
                r[4],
                r[5],
            )
            for r in rows
        ])  # fmt: skip

    def select_latest(self, originator_ids: Sequence[UUID]) -> dict[UUID, StoredEvent]:
        if not originator_ids:
            return {}
        snapshots, seals = self.events_table_name, seal_table(self.events_table_name)
        events, chain = self.chained_events_table, chain_table(self.chained_events_table)
        marks = ",".join("?" for _ in originator_ids)
        statement = (
            f"WITH latest AS (SELECT originator_id, MAX(originator_version) AS v FROM {snapshots} "
            f"WHERE originator_id IN ({marks}) GROUP BY originator_id) "
            "SELECT s.originator_id, s.originator_version, s.topic, s.state, g.seal, c.digest "
            f"FROM {snapshots} s JOIN latest l ON l.originator_id = s.originator_id "
            "AND l.v = s.originator_version "
            f"LEFT JOIN {seals} g ON g.originator_id = s.originator_id "
            "AND g.originator_version = s.originator_version "
            f"LEFT JOIN {events} e ON e.originator_id = s.originator_id "
            "AND e.originator_version = s.originator_version "
            f"LEFT JOIN {chain} c ON c.position = e.rowid"
        )
        with self.datastore.transaction(commit=False) as c:
            c.execute(statement, [i.hex for i in originator_ids])
            rows = c.fetchall()
        kept = self.verified([
            (StoredEvent(UUID(r[0]), r[1], r[2], bytes(r[3])), r[4], r[5]) for r in rows
        ])  # fmt: skip
        return {event.originator_id: event for event in kept}  # type: ignore[misc]


class SealedPostgresSnapshots(SavesInServer, SealedSnapshots, PostgresAggregateRecorder):
    def __init__(
        self, datastore: PostgresDatastore, *, events_table_name: str = "stored_snapshots"
    ) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        self.check_identifier_length(seal_table(events_table_name))
        self.sql_create_statements.append(
            SQL(
                "CREATE TABLE IF NOT EXISTS {}.{} (originator_id uuid NOT NULL, "
                "originator_version bigint NOT NULL, seal bytea NOT NULL, "
                "PRIMARY KEY (originator_id, originator_version))"
            ).format(Identifier(datastore.schema), Identifier(seal_table(events_table_name)))
        )
        self.append_statement = b""
        self.append_signature = ""
        self._appends_in_server: bool | None = False  # until configured

    def configure(self, chain: Chain, events_table: str) -> None:
        """As :meth:`SealedSnapshots.configure`, and the save of events with snapshots
        in one statement (``<events>_append_with_snapshots``, created with the tables
        when its name fits PostgreSQL's identifiers: else the snapshots are sealed in
        the client)."""
        super().configure(chain, events_table)
        name = append_with_snapshots_function(events_table)
        if len(name) > MAX_IDENTIFIER_LENGTH:
            return
        schema = Identifier(self.datastore.schema)
        self.sql_create_statements.append(
            append_with_snapshots_statement(
                schema,
                Identifier(append_function(events_table)),
                Identifier(name),
                Identifier(self.events_table_name),
                Identifier(seal_table(self.events_table_name)),
            )
        )
        self.append_statement = compiled(
            SQL(
                "SELECT * FROM {}.{}(%b::uuid[], %b::bigint[], %b::text[], %b::bytea[], %s, "
                "%b::uuid[], %b::bigint[], %b::text[], %b::bytea[])"
            ).format(schema, Identifier(name))
        )
        self.append_signature = (
            f"{_quoted(self.datastore.schema)}.{_quoted(name)}({APPEND_WITH_SNAPSHOTS_ARGUMENTS})"
        )
        self._appends_in_server = None  # known at the first save with snapshots

    def create_table(self) -> None:
        super().create_table()
        compress_states_with_lz4(self.datastore, self.events_table_name)

    @cached_property
    def _statements(self) -> dict[str, bytes]:
        """This store's statements, rendered once (after :meth:`configure`)."""
        names = self._names()
        latest_and_after = SQL(
            "WITH snap AS (SELECT l.originator_id, l.originator_version, l.topic, l.state, "
            "{seal_and_digest} FROM unnest(%b::uuid[]) AS v(id) CROSS JOIN LATERAL "
            "(SELECT originator_id, originator_version, topic, state FROM {schema}.{snapshots} "
            "WHERE originator_id = v.id ORDER BY originator_version DESC LIMIT 1) AS l) "
            "SELECT originator_id, 0 AS part, originator_version, topic, state, seal, digest "
            "FROM snap UNION ALL SELECT e.originator_id, 1, e.originator_version, e.topic, "
            "e.state, NULL, NULL FROM {schema}.{events} e LEFT JOIN snap s "
            "ON s.originator_id = e.originator_id WHERE e.originator_id = ANY(%b) "
            "AND e.originator_version > COALESCE(s.originator_version, 0) "
            "ORDER BY originator_id, part, originator_version"
        ).format(seal_and_digest=seal_and_digest(names, "l"), **names)
        return {
            "insert": compiled(unnested_insert(self, returning=False)),
            "digests": compiled(chain_digests_statement(names)),
            "seals": compiled(
                SQL(
                    "INSERT INTO {schema}.{seals} "
                    "SELECT * FROM unnest(%b::uuid[], %b::bigint[], %b::bytea[])"
                ).format(**names)
            ),
            "latest_and_after": compiled(latest_and_after),
        }

    def _names(self) -> dict[str, Identifier]:
        return {
            "schema": Identifier(self.datastore.schema),
            "snapshots": Identifier(self.events_table_name),
            "seals": Identifier(seal_table(self.events_table_name)),
            "events": Identifier(self.chained_events_table),
            "chain": Identifier(chain_table(self.chained_events_table)),
        }

    def within(self, stored_snapshots: Sequence[StoredEvent]) -> SnapshotsWithin:
        """Snapshots to write inside the transaction that saves the events they were
        taken at (:meth:`ChainedPostgresRecorder.insert_events`)."""
        return SnapshotsWithin(self, list(stored_snapshots))

    def write_sealed(
        self,
        curs: Any,
        stored_snapshots: Sequence[StoredEvent],
        digests: dict[tuple[UUID | str, int], bytes],
    ) -> None:
        """Insert the snapshots and the seals of those whose event's chain digest is
        in ``digests``, on ``curs`` (its transaction)."""
        statements = self._statements
        insert_unnested(curs, statements["insert"], stored_snapshots)
        sealed = [
            (s, digests[(s.originator_id, s.originator_version)])
            for s in stored_snapshots
            if (s.originator_id, s.originator_version) in digests
        ]
        if sealed:
            curs.execute(
                statements["seals"],
                (
                    [s.originator_id for s, _ in sealed],
                    [s.originator_version for s, _ in sealed],
                    [self.seal_for(s, digest) for s, digest in sealed],
                ),
            )

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        if not stored_events:
            return None
        with (
            self.datastore.get_connection() as conn,
            conn.transaction(),
            conn.cursor(row_factory=tuple_row) as curs,
        ):
            curs.execute(
                self._statements["digests"],
                [
                    [s.originator_id for s in stored_events],
                    [s.originator_version for s in stored_events],
                ],
                prepare=True,
            )
            digests = {(row[0], row[1]): bytes(row[2]) for row in curs.fetchall()}
            self.write_sealed(curs, stored_events, digests)
        return None

    def select_statement(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> tuple[Composed, list[Any]]:
        """The statement of :meth:`select_events` and its parameters."""
        # the snapshots first (the latest one through the primary key when limited),
        # then each one's seal and chain digest through primary keys: a join before
        # the limit let the planner, with statistics, pair all 10,000 snapshots of a
        # long-lived runner with their events before keeping one (42 ms, not 0.8)
        where: Composable = SQL("WHERE originator_id = %s")
        params: list[Any] = [originator_id]
        if gt is not None:
            where += SQL(" AND originator_version > %s")
            params.append(gt)
        if lte is not None:
            where += SQL(" AND originator_version <= %s")
            params.append(lte)
        order = SQL(" ORDER BY originator_version DESC" if desc else " ORDER BY originator_version")
        limited = SQL("")
        if limit is not None:
            limited = SQL(" LIMIT %s")
            params.append(limit)
        names = self._names()
        statement = (
            SQL("SELECT s.originator_id, s.originator_version, s.topic, s.state, {} ").format(
                seal_and_digest(names, "s")
            )
            + SQL(
                "FROM (SELECT originator_id, originator_version, topic, state "
                "FROM {schema}.{snapshots} "
            ).format(**names)
            + where
            + order
            + limited
            + SQL(") AS s")
            + order
        )
        return statement, params

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def select_events(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        statement, params = self.select_statement(
            originator_id, gt=gt, lte=lte, desc=desc, limit=limit
        )
        with (
            self.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as curs,
        ):
            curs.execute(statement, params, prepare=True)
            rows = curs.fetchall()
        return self.verified(
            [(StoredEvent(r[0], r[1], r[2], bytes(r[3])), r[4], r[5]) for r in rows]
        )

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def select_latest_and_after(
        self, originator_ids: Sequence[UUID]
    ) -> tuple[dict[UUID, StoredEvent], list[StoredEvent], set[UUID]] | None:
        if not originator_ids:
            return {}, [], set()
        statement = self._statements["latest_and_after"]
        ids = list(originator_ids)
        with (
            self.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row, binary=True) as curs,
        ):
            curs.execute(statement, (ids, ids), prepare=True)
            rows = curs.fetchall()
        snapshots = [
            (StoredEvent(r[0], r[2], r[3], bytes(r[4])), r[5], r[6]) for r in rows if r[1] == 0
        ]
        trusted = {event.originator_id: event for event in self.verified(snapshots)}
        refused = {stored.originator_id for stored, _, _ in snapshots} - set(trusted)
        after = [StoredEvent(r[0], r[2], r[3], bytes(r[4])) for r in rows if r[1] == 1]
        return trusted, after, refused  # type: ignore[return-value]


# -- reading the chain (audit) --------------------------------------------------------


def chain_head(recorder: object) -> Link | None:
    """The last link of the chain (None: no link, or the recorder does not chain)."""
    if isinstance(recorder, ChainedSQLiteRecorder):
        with recorder.datastore.transaction(commit=False) as c:
            c.execute(recorder.select_head_statement)
            return _as_link(c.fetchone())
    if isinstance(recorder, ChainedPostgresRecorder):
        with (
            recorder.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as curs,
        ):
            curs.execute(recorder.select_head_statement)
            return _as_link(curs.fetchone())
    return None


def select_links(recorder: object, after: int, upto: int | None) -> list[Link]:
    """The links after position ``after`` up to ``upto`` (inclusive; None: all), in order."""
    if isinstance(recorder, ChainedSQLiteRecorder):
        statement = (
            f"SELECT position, previous, digest FROM {recorder.chain_table_name} "
            "WHERE position > ? " + ("AND position <= ? " if upto is not None else "")
        ) + "ORDER BY position"
        with recorder.datastore.transaction(commit=False) as c:
            c.execute(statement, (after,) if upto is None else (after, upto))
            return [Link(r[0], r[1], bytes(r[2])) for r in c.fetchall()]
    if isinstance(recorder, ChainedPostgresRecorder):
        query = SQL("SELECT position, previous, digest FROM {}.{} WHERE position > %s").format(
            Identifier(recorder.datastore.schema), Identifier(recorder.chain_table_name)
        )
        if upto is not None:
            query += SQL(" AND position <= %s")
        query += SQL(" ORDER BY position")
        with (
            recorder.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row, binary=True) as curs,
        ):
            curs.execute(query, (after,) if upto is None else (after, upto))
            return [Link(r[0], r[1], bytes(r[2])) for r in curs.fetchall()]
    return []


def stored_snapshots(
    recorder: object,
) -> list[tuple[StoredEvent, bytes | None, bytes | None, int | None]]:
    """Every stored snapshot, raw: (snapshot, its seal, the chain digest at its version,
    the position of the event at its version); None where there is none."""
    rows: list[Any]
    if isinstance(recorder, SealedSQLiteSnapshots):
        events, chain = recorder.chained_events_table, chain_table(recorder.chained_events_table)
        with recorder.datastore.transaction(commit=False) as c:
            c.execute(
                "SELECT s.originator_id, s.originator_version, s.topic, s.state, g.seal, "
                f"c.digest, e.rowid FROM {recorder.events_table_name} s "
                f"LEFT JOIN {seal_table(recorder.events_table_name)} g "
                "ON g.originator_id = s.originator_id "
                "AND g.originator_version = s.originator_version "
                f"LEFT JOIN {events} e ON e.originator_id = s.originator_id "
                "AND e.originator_version = s.originator_version "
                f"LEFT JOIN {chain} c ON c.position = e.rowid "
                "ORDER BY s.originator_id, s.originator_version"
            )
            rows = [(UUID(r[0]), *r[1:]) for r in c.fetchall()]
    elif isinstance(recorder, SealedPostgresSnapshots):
        query = SQL(
            "SELECT s.originator_id, s.originator_version, s.topic, s.state, g.seal, c.digest, "
            "e.notification_id FROM {schema}.{snapshots} s LEFT JOIN {schema}.{seals} g "
            "ON g.originator_id = s.originator_id AND g.originator_version = s.originator_version "
            "LEFT JOIN {schema}.{events} e ON e.originator_id = s.originator_id "
            "AND e.originator_version = s.originator_version "
            "LEFT JOIN {schema}.{chain} c ON c.position = e.notification_id "
            "ORDER BY s.originator_id, s.originator_version"
        ).format(**recorder._names())
        with (
            recorder.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row, binary=True) as curs,
        ):
            curs.execute(query)
            rows = curs.fetchall()
    else:
        return []
    return [
        (
            StoredEvent(r[0], r[1], r[2], bytes(r[3])),
            None if r[4] is None else bytes(r[4]),
            None if r[5] is None else bytes(r[5]),
            r[6],
        )
        for r in rows
    ]
