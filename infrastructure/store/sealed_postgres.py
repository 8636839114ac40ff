"""The sealed PostgreSQL snapshot recorder (:mod:`.sealed_snapshots`), and the
snapshots a save of the chained recorder (:mod:`.chained_postgres`) writes in its own
transaction (:class:`SnapshotsWithin`)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any
from uuid import UUID

from eventsourcing.persistence import InterfaceError, OperationalError, StoredEvent
from eventsourcing.postgres import PostgresAggregateRecorder, PostgresDatastore
from eventsourcing.utils import retry
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composable, Composed, Identifier, Literal

from secondbox_scheduler.domain.audit.chain import Chain
from secondbox_scheduler.infrastructure.store.chain_tables import (
    chain_table,
    lock_function,
    seal_table,
)
from secondbox_scheduler.infrastructure.store.keyed_append import (
    link_function,
    link_function_statement,
)
from secondbox_scheduler.infrastructure.store.postgres_chain_sql import (
    MAX_IDENTIFIER_LENGTH,
    chain_digests_statement,
    compiled,
    insert_unnested,
    quoted,
    seal_and_digest,
    unnested_insert,
)
from secondbox_scheduler.infrastructure.store.saves_in_server import SavesInServer
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots
from secondbox_scheduler.infrastructure.store.server_append import (
    APPEND_WITH_SNAPSHOTS_ARGUMENTS,
    append_function,
    append_with_snapshots_function,
    append_with_snapshots_statement,
)
from secondbox_scheduler.infrastructure.store.state_compression import compress_states_with_lz4
from secondbox_scheduler.infrastructure.store.typed_arrays import ids_array
from secondbox_scheduler.infrastructure.store.write_timeouts import (
    DEFAULT_WRITE_LOCK_TIMEOUT_MS,
    timeouts_as_contention,
)


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
        self.write_lock_timeout = f"{DEFAULT_WRITE_LOCK_TIMEOUT_MS}ms"  # :mod:`.write_timeouts`
        self._appends_in_server: bool | None = False  # until configured

    def configure(self, chain: Chain, events_table: str) -> None:
        """As :meth:`SealedSnapshots.configure`, and the save of events with snapshots
        in one statement (``<events>_append_with_snapshots``, created with the tables
        when its name fits PostgreSQL's identifiers: else the snapshots are sealed in
        the client)."""
        super().configure(chain, events_table)
        schema = Identifier(self.datastore.schema)
        if len(link_function(events_table)) <= MAX_IDENTIFIER_LENGTH:
            self.sql_create_statements.append(  # a keyed chain's links and snapshots
                link_function_statement(
                    schema,
                    Identifier(events_table),
                    Identifier(chain_table(events_table)),
                    Identifier(lock_function(events_table)),
                    Identifier(link_function(events_table)),
                    Identifier(self.events_table_name),
                    Identifier(seal_table(self.events_table_name)),
                )
            )
        name = append_with_snapshots_function(events_table)
        if len(name) > MAX_IDENTIFIER_LENGTH:
            return
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
            f"{quoted(self.datastore.schema)}.{quoted(name)}({APPEND_WITH_SNAPSHOTS_ARGUMENTS})"
        )
        self._appends_in_server = None  # known at the first save with snapshots

    def create_table(self) -> None:
        super().create_table()
        compress_states_with_lz4(self.datastore, self.events_table_name)

    @cached_property
    def _statements(self) -> dict[str, bytes]:
        """This store's statements, rendered once (after :meth:`configure`)."""
        names = self.table_names()
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
        # a row already at a snapshot's (id, version), planted ahead by a session of the
        # application role, is left as it is: the save goes on (found by a red team:
        # every save that crossed it failed, retried to SerializationContentionError).
        # A planted snapshot then fails its seal and a planted seal fails its snapshot:
        # both are refused when read, and the aggregate loads from its events.
        skip = SQL(" ON CONFLICT DO NOTHING")
        return {
            "insert": compiled(unnested_insert(self, returning=False) + skip),
            "digests": compiled(chain_digests_statement(names)),
            "seals": compiled(
                SQL(
                    "INSERT INTO {schema}.{seals} "
                    "SELECT * FROM unnest(%b::uuid[], %b::bigint[], %b::bytea[])"
                ).format(**names)
                + skip
            ),
            "latest_and_after": compiled(latest_and_after),
        }

    def table_names(self) -> dict[str, Identifier]:
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
    @timeouts_as_contention
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
                SQL("SET LOCAL lock_timeout = {}").format(Literal(self.write_lock_timeout))
            )
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
        names = self.table_names()
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
        ids = ids_array(originator_ids)
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
