"""The chained PostgreSQL application recorder: the library's, plus a chain table
(``<events table>_chain``: position, previous position, digest) written in the same
transaction as the events. Inserts are serialised by the events table's ``EXCLUSIVE``
lock, so the head of the chain read inside the transaction is the link before the new
events, whichever replica commits next.

The lock is taken by a ``SECURITY DEFINER`` function owned by the schema owner
(``<events table>_lock()``) instead of ``LOCK TABLE`` in the application's own session:
``LOCK TABLE ... IN EXCLUSIVE MODE`` needs UPDATE, DELETE or TRUNCATE privilege on the
table, which an append-only application role does not have (docs/operations.md). An
unkeyed chain's save is one call of ``<events table>_append`` (:mod:`.server_append`), a
keyed chain's two calls in one transaction (``<events table>_insert`` and ``_link``,
:mod:`.keyed_append`); the client inserts and links itself only where they are absent or
forbidden (a role with INSERT on the tables: the owner, or a schema of an earlier release).

The events table refuses a position <= 0 (``CHECK (notification_id > 0)``, added at
creation, and by the owner's next start to a table of an earlier release): the red team
inserted events at position 0, outside the log that the audit, the checkpoints and the
read models read, which the aggregates loaded by stream and acted on.

Every save waits at most the write lock timeout for a lock and the write statement
timeout for a statement (:mod:`.write_timeouts`), then fails with a typed contention
error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from eventsourcing.persistence import (
    InterfaceError,
    OperationalError,
    ProgrammingError,
    StoredEvent,
)
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from eventsourcing.utils import retry
from psycopg import Rollback
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Identifier, Literal

from secondbox_scheduler.domain.audit.chain import ChainedEvent, Link
from secondbox_scheduler.infrastructure.store.chain_tables import (
    ChainedRecorder,
    as_link,
    chain_table,
    lock_function,
)
from secondbox_scheduler.infrastructure.store.keyed_append import (
    INSERT_ARGUMENTS,
    LINK_ARGUMENTS,
    insert_function,
    insert_function_statement,
    link_function,
)
from secondbox_scheduler.infrastructure.store.merkle_tables import (
    extend_function,
    postgres_create_statements,
    tree_table,
)
from secondbox_scheduler.infrastructure.store.postgres_chain_sql import (
    compiled,
    insert_unnested,
    positive_positions_statement,
    quoted,
    unnested,
    unnested_insert,
)
from secondbox_scheduler.infrastructure.store.saves_in_server import SavesInServer
from secondbox_scheduler.infrastructure.store.sealed_postgres import SnapshotsWithin
from secondbox_scheduler.infrastructure.store.server_append import (
    APPEND_ARGUMENTS,
    append_function,
    append_function_statement,
)
from secondbox_scheduler.infrastructure.store.state_compression import compress_states_with_lz4
from secondbox_scheduler.infrastructure.store.write_timeouts import (
    DEFAULT_WRITE_LOCK_TIMEOUT_MS,
    DEFAULT_WRITE_STATEMENT_TIMEOUT_MS,
    timeouts_as_contention,
)

log = logging.getLogger("secondbox_scheduler.chain")
BEGIN, COMMIT = b"BEGIN", b"COMMIT"  # a save's own transaction, as statements (_appended)


class ChainedPostgresRecorder(SavesInServer, ChainedRecorder, PostgresApplicationRecorder):
    """PostgreSQL: the position of an event is its notification id."""

    links_keyed_in_server = True  # a keyed chain saves through <events>_insert and _link

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
        self.sql_create_statements.append(
            positive_positions_statement(datastore.schema, events_table_name)
        )
        append = Identifier(append_function(events_table_name))
        self.check_identifier_length(append_function(events_table_name))
        self.sql_create_statements.append(
            append_function_statement(schema, events, chain, function, append, self.channel_name)
        )
        insert = Identifier(insert_function(events_table_name))
        self.check_identifier_length(insert_function(events_table_name))
        self.check_identifier_length(link_function(events_table_name))
        self.sql_create_statements.append(
            insert_function_statement(schema, events, chain, function, insert, self.channel_name)
        )  # <events>_link is created with the snapshots (:mod:`.sealed_postgres`)
        # the Merkle tree (derived from the log; :mod:`.merkle_tree`)
        self.check_identifier_length(tree_table(events_table_name))
        self.check_identifier_length(extend_function(events_table_name))
        self.sql_create_statements.extend(
            postgres_create_statements(datastore.schema, events_table_name)
        )
        self.insert_statement = compiled(
            SQL(
                "SELECT * FROM {}.{}(%b::uuid[], %b::bigint[], %b::text[], %b::bytea[], %s)"
            ).format(schema, insert)
        )
        self.link_statement = compiled(
            SQL(
                "SELECT {}.{}(%b::bigint[], %b::bigint[], %b::bytea[], %b::bytea, %b::uuid[], "
                "%b::bigint[], %b::text[], %b::bytea[], %b::bytea[])"
            ).format(schema, Identifier(link_function(events_table_name)))
        )
        self.keyed_signatures = (
            f"{quoted(datastore.schema)}.{quoted(insert_function(events_table_name))}"
            f"({INSERT_ARGUMENTS})",
            f"{quoted(datastore.schema)}.{quoted(link_function(events_table_name))}"
            f"({LINK_ARGUMENTS})",
        )
        self.append_statement = compiled(
            SQL(
                "SELECT * FROM {}.{}(%b::uuid[], %b::bigint[], %b::text[], %b::bytea[], %s)"
            ).format(schema, append)
        )
        self.append_signature = (
            f"{quoted(datastore.schema)}.{quoted(append_function(events_table_name))}"
            f"({APPEND_ARGUMENTS})"
        )
        self._appends_in_server: bool | None = None  # known at the first save
        # statements rendered once: psycopg renders a Composed again at every execute
        self.lock_statement = compiled(SQL("SELECT {}.{}()").format(schema, function))
        self.set_write_timeouts(DEFAULT_WRITE_LOCK_TIMEOUT_MS, DEFAULT_WRITE_STATEMENT_TIMEOUT_MS)
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

    def set_write_timeouts(self, lock_ms: int, statement_ms: int) -> None:
        """How long a save waits for a lock and for a statement (0: no bound), set in
        each save's transaction (:mod:`.write_timeouts`)."""
        self.write_lock_timeout = f"{lock_ms}ms"
        self.statement_timeout_statement = compiled(
            SQL("SET LOCAL statement_timeout = {}").format(Literal(f"{statement_ms}ms"))
        )
        self.lock_table_statements = [
            compiled(SQL("SET LOCAL lock_timeout = {}").format(Literal(self.write_lock_timeout))),
            self.statement_timeout_statement,
            self.lock_statement,
        ]

    def create_table(self) -> None:
        super().create_table()
        compress_states_with_lz4(self.datastore, self.events_table_name)

    def _notify_channel(self, curs: Any) -> None:
        curs.execute(self.notify_statement)

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    @timeouts_as_contention
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
                if self.chain.keyed:
                    return self._link_in_server(stored_events, snapshots)
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
                            head = as_link(head_cursor.fetchone())
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
        params = (*unnested(stored_events), self.write_lock_timeout)
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
                    curs.execute(self.statement_timeout_statement)
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

    def _link_in_server(
        self, stored_events: Sequence[StoredEvent], snapshots: SnapshotsWithin | None
    ) -> Sequence[int]:
        """A keyed chain's save (:mod:`.keyed_append`): ``<events>_insert`` (lock, the
        head, the events, the notification), the links computed here with the key, then
        ``<events>_link`` (the links checked against the head, stored, and the snapshots
        of this save with their seals): one transaction, two round trips."""
        params = (*unnested(stored_events), f"{self.datastore.lock_timeout}s")
        exc: Exception | None = None
        positions: list[int] = []
        with (
            self.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as inserted,
        ):
            with conn.pipeline() as pipeline, conn.transaction(), conn.cursor() as curs:
                try:
                    inserted.execute(self.insert_statement, params, prepare=True)
                    pipeline.sync()
                    rows = inserted.fetchall()
                    positions = self._positions(rows, stored_events)
                    head = (
                        None if rows[0][2] is None else Link(int(rows[0][1]), 0, bytes(rows[0][2]))
                    )
                    links = self.chain.links(
                        head,
                        [
                            ChainedEvent(p, s.originator_id, s.originator_version, s.topic, s.state)
                            for p, s in zip(positions, stored_events, strict=True)
                        ],
                    )
                    stored = [] if snapshots is None else snapshots.stored
                    digests = {
                        (s.originator_id, s.originator_version): k.digest
                        for s, k in zip(stored_events, links, strict=True)
                    }
                    curs.execute(
                        self.link_statement,
                        (
                            [k.position for k in links],
                            [k.previous for k in links],
                            [k.digest for k in links],
                            None if head is None else head.digest,
                            *unnested(stored),
                            [
                                snapshots.recorder.seal_for(
                                    s, digests[(s.originator_id, s.originator_version)]
                                )
                                for s in stored
                            ]
                            if snapshots is not None
                            else [],
                        ),
                        prepare=True,
                    )
                except Exception as e:
                    exc = e  # raised after the pipeline is closed, as the library does
                if exc is not None:
                    raise Rollback
            if exc:
                raise exc
        return positions

    def _appended(
        self, stored_events: Sequence[StoredEvent], statement: bytes, params: tuple[Any, ...]
    ) -> Sequence[int]:
        """The positions of ``stored_events`` saved by one statement (a function of
        :mod:`.server_append`) in a transaction of its own that bounds it by the write
        statement timeout (one round trip: the pipeline sends the ``BEGIN``, the
        ``SET LOCAL``, the call and the ``COMMIT`` together). The transaction is
        written out as statements on the pool's autocommit connection rather than
        psycopg's ``transaction()`` block (about 90 us less Python per save, measured
        alone; the same statements reach the server). Whatever fails (the server
        skips the rest of the pipeline after an error, ``COMMIT`` included), the
        pool's connection block rolls the session back before the error goes on."""
        with (
            self.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as commands,
            conn.cursor(row_factory=tuple_row) as appended,
        ):
            with conn.pipeline():
                commands.execute(BEGIN)
                commands.execute(self.statement_timeout_statement)
                appended.execute(statement, params, prepare=True)
                commands.execute(COMMIT)
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
