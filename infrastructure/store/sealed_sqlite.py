"""The sealed SQLite snapshot recorder (:mod:`.sealed_snapshots`): snapshots sealed
with the chain digest of the event at their version, read back only when the seal
checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import StoredEvent
from eventsourcing.sqlite import SQLiteAggregateRecorder, SQLiteCursor

from secondbox_scheduler.infrastructure.store.chain_tables import chain_table, seal_table
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots


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
