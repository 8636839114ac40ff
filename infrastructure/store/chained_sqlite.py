"""The chained SQLite application recorder: the library's, plus a chain table
(``<events table>_chain``: position, previous position, digest) written in the same
transaction as the events. Inserts are serialised by the database's write lock, so the
head of the chain read inside the transaction is the link before the new events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventsourcing.persistence import StoredEvent
from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteCursor, SQLiteDatastore

from secondbox_scheduler.domain.audit.chain import ChainedEvent
from secondbox_scheduler.infrastructure.store.chain_tables import (
    ChainedRecorder,
    as_link,
    chain_table,
)
from secondbox_scheduler.infrastructure.store.merkle_tables import sqlite_create_statement


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
        statements.append(sqlite_create_statement(self.events_table_name))  # merkle_tree.py
        return statements

    def _insert_events(
        self, c: SQLiteCursor, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        positions = super()._insert_events(c, stored_events, **kwargs)
        assert positions is not None
        c.execute(self.select_head_statement)
        head = as_link(c.fetchone())
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
