"""The Merkle tree over the notification log, stored (domain/audit/merkle.py; docs/audit.md,
"Merkle tree").

``<events table>_merkle`` holds every complete subtree of the tree: ``(level, idx,
hash)``, level 0 the leaf hashes (leaf ``idx`` is the event at position ``idx + 1``, or
the position's gap). It is derived data: nothing but the log decides it, anyone who can
read the log recomputes it (``audit verify`` does, rule ``merkle``), and it is brought
up to date lazily, when a tree head or a proof is asked (:meth:`MerkleTree.update`),
reading only the events after its size: the saves do not touch it.

On PostgreSQL it is written only by ``<events>_merkle_extend(max_leaves)``, a
``SECURITY DEFINER`` function owned by the schema owner that computes the new leaves
and nodes from the events table itself (set-based: one statement for the leaves, one
per level) and takes nothing from its caller but a bound on the work: the application
and audit roles may call it, and hold no write privilege on the table (docs/operations.md).
It serialises its callers on the tree table's lock (``SHARE ROW EXCLUSIVE``: readers
and the saves go on). It extends only to the last committed position: the events
table's lock orders commits by position, so a position below it that holds no event
is a gap the sequence skipped (a save that rolled back), never one still being written.
On SQLite the tree is computed here and written in one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from uuid import UUID

import psycopg
from eventsourcing.persistence import OperationalError, ProgrammingError
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Composed, Identifier

from secondbox_scheduler.domain.audit.merkle import (
    Node,
    extend,
    frontier,
    gap_leaf_data,
    leaf_data,
    leaf_hash,
)
from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.store.chained_postgres import ChainedPostgresRecorder
from secondbox_scheduler.infrastructure.store.chained_sqlite import ChainedSQLiteRecorder
from secondbox_scheduler.infrastructure.store.merkle_tables import extend_function, tree_table

UPDATE_CHUNK = 65_536  # leaves added per transaction


class TreeUnavailableError(SchedulerError):
    """The store keeps no tree (not a chained store, or its tables are older)."""


class MerkleTree:
    """The stored tree of one application's log: its size, its nodes, and bringing it
    up to date."""

    def __init__(self, recorder: Any) -> None:
        if isinstance(recorder, ChainedSQLiteRecorder):
            self.postgres = False
        elif isinstance(recorder, ChainedPostgresRecorder):
            self.postgres = True
        else:
            raise TreeUnavailableError("this store keeps no Merkle tree (it keeps no chain)")
        self.recorder = recorder
        self.events_table = recorder.events_table_name
        self.table = tree_table(self.events_table)

    # -- reading ---------------------------------------------------------------

    def _pg(self, query: Composed | str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement; psycopg's errors as the library's (a role that may not run
        the tree's function: ``ProgrammingError``)."""
        datastore = self.recorder.datastore
        try:
            with (
                datastore.get_connection() as conn,
                conn.cursor(row_factory=tuple_row) as curs,
            ):
                curs.execute(query, params)
                return list(curs.fetchall()) if curs.description else []
        except psycopg.OperationalError as error:
            raise OperationalError(str(error)) from error
        except psycopg.Error as error:
            raise ProgrammingError(str(error)) from error

    def _names(self) -> dict[str, Identifier]:
        return {
            "schema": Identifier(self.recorder.datastore.schema),
            "tree": Identifier(self.table),
            "events": Identifier(self.events_table),
            "extend": Identifier(extend_function(self.events_table)),
        }

    def size(self) -> int:
        """How many leaves the stored tree holds."""
        if self.postgres:
            rows = self._pg(
                SQL("SELECT max(idx) FROM {schema}.{tree} WHERE level = 0").format(**self._names())
            )
        else:
            with self.recorder.datastore.transaction(commit=False) as c:
                c.execute(f"SELECT max(idx) FROM {self.table} WHERE level = 0")
                rows = [tuple(c.fetchone())]
        top = rows[0][0] if rows else None
        return 0 if top is None else int(top) + 1

    def log_size(self) -> int:
        """The last position of the log (the size of the tree once brought up to date)."""
        if self.postgres:
            rows = self._pg(
                SQL("SELECT max(notification_id) FROM {schema}.{events}").format(**self._names())
            )
        else:
            with self.recorder.datastore.transaction(commit=False) as c:
                c.execute(f"SELECT max(rowid) FROM {self.events_table}")
                rows = [tuple(c.fetchone())]
        top = rows[0][0] if rows else None
        return 0 if top is None else int(top)

    def read(self, nodes: Iterable[Node]) -> dict[Node, bytes]:
        """The stored hashes of ``nodes`` (those stored)."""
        wanted = list(nodes)
        if not wanted:
            return {}
        if self.postgres:
            rows = self._pg(
                SQL(
                    "SELECT t.level, t.idx, t.hash FROM unnest(%s::smallint[], %s::bigint[]) "
                    "AS w(level, idx) JOIN {schema}.{tree} t "
                    "ON t.level = w.level AND t.idx = w.idx"
                ).format(**self._names()),
                ([n[0] for n in wanted], [n[1] for n in wanted]),
            )
        else:
            values = ", ".join("(?, ?)" for _ in wanted)
            with self.recorder.datastore.transaction(commit=False) as c:
                c.execute(
                    f"SELECT level, idx, hash FROM {self.table} "
                    f"WHERE (level, idx) IN (VALUES {values})",
                    [v for n in wanted for v in n],
                )
                rows = [tuple(r) for r in c.fetchall()]
        return {(int(r[0]), int(r[1])): bytes(r[2]) for r in rows}

    def leaf_data_at(self, position: int) -> bytes:
        """The leaf data of ``position`` from the row stored there (or the gap's)."""
        if self.postgres:
            rows = self._pg(
                SQL(
                    "SELECT notification_id, originator_id, originator_version, topic, state "
                    "FROM {schema}.{events} WHERE notification_id = %s"
                ).format(**self._names()),
                (position,),
            )
        else:
            with self.recorder.datastore.transaction(commit=False) as c:
                c.execute(
                    "SELECT rowid, originator_id, originator_version, topic, state "
                    f"FROM {self.events_table} WHERE rowid = ?",
                    (position,),
                )
                rows = [tuple(r) for r in c.fetchall()]
        if not rows:
            return gap_leaf_data(position)
        return row_leaf_data(rows[0])

    # -- writing ---------------------------------------------------------------

    def update(self, upto: int | None = None) -> int:
        """Bring the tree up to the log's last position (or to ``upto``, if the log
        reaches it); returns its size. Reads only the events after the tree's size."""
        size = self.size()
        while True:
            wanted = UPDATE_CHUNK if upto is None else min(UPDATE_CHUNK, upto - size)
            if wanted <= 0:
                return size
            grown = self._extend(wanted)
            if grown - size < wanted:  # the log ends there
                return grown
            size = grown

    def _extend(self, leaves: int) -> int:
        if self.postgres:
            rows = self._pg(SQL("SELECT {schema}.{extend}(%s)").format(**self._names()), (leaves,))
            return int(rows[0][0])
        return self._extend_sqlite(leaves)

    def _extend_sqlite(self, leaves: int) -> int:
        with self.recorder.datastore.transaction(commit=True) as c:
            c.execute(f"SELECT max(idx) FROM {self.table} WHERE level = 0")
            top = c.fetchone()[0]
            size = 0 if top is None else int(top) + 1
            c.execute(f"SELECT max(rowid) FROM {self.events_table}")
            last = c.fetchone()[0]
            target = min(0 if last is None else int(last), size + leaves)
            if target <= size:
                return size
            wanted = frontier(size)
            old: dict[Node, bytes] = {}
            if wanted:
                values = ", ".join("(?, ?)" for _ in wanted)
                c.execute(
                    f"SELECT level, idx, hash FROM {self.table} "
                    f"WHERE (level, idx) IN (VALUES {values})",
                    [v for n in wanted for v in n],
                )
                old = {(int(r[0]), int(r[1])): bytes(r[2]) for r in c.fetchall()}
            c.execute(
                "SELECT rowid, originator_id, originator_version, topic, state "
                f"FROM {self.events_table} WHERE rowid > ? AND rowid <= ? ORDER BY rowid",
                (size, target),
            )
            hashes = leaf_hashes(size, target, c.fetchall())
            nodes = extend(size, old, hashes)
            c.executemany(
                f"INSERT OR IGNORE INTO {self.table} (level, idx, hash) VALUES (?, ?, ?)",
                [(level, idx, h) for (level, idx), h in nodes.items()],
            )
            return target

    def truncate(self, size: int) -> None:
        """Forget every node past the tree of ``size`` leaves (the schema owner's: it
        deletes rows); :meth:`update` computes them again from the log."""
        if self.postgres:
            self._pg(
                SQL("DELETE FROM {schema}.{tree} WHERE ((idx + 1) << level) > %s").format(
                    **self._names()
                ),
                (size,),
            )
        else:
            with self.recorder.datastore.transaction(commit=True) as c:
                c.execute(f"DELETE FROM {self.table} WHERE ((idx + 1) << level) > ?", (size,))

    def rebuild(self) -> int:
        """The tree computed again from the log, from its first leaf (the schema owner's:
        it deletes the table's rows). After a repair, or to see what the log holds now."""
        if self.postgres:
            self._pg(SQL("DELETE FROM {schema}.{tree}").format(**self._names()))
        else:
            with self.recorder.datastore.transaction(commit=True) as c:
                c.execute(f"DELETE FROM {self.table}")
        return self.update()


def row_leaf_data(row: Any) -> bytes:
    """The leaf data of a stored row (position, originator id, version, topic, state)."""
    state = row[4]
    return leaf_data(
        int(row[0]),
        row[1] if isinstance(row[1], UUID) else UUID(str(row[1])),
        int(row[2]),
        str(row[3]),
        state.encode() if isinstance(state, str) else bytes(state),
    )


def leaf_hashes(after: int, upto: int, rows: Iterable[Any]) -> list[bytes]:
    """The leaf hashes of positions ``after + 1`` to ``upto`` from the rows stored there
    (position, originator id, version, topic, state; in position order), a gap's leaf
    where a position holds none."""
    hashes: list[bytes] = []
    expected = after + 1
    for row in rows:
        position = int(row[0])
        while expected < position:
            hashes.append(leaf_hash(gap_leaf_data(expected)))
            expected += 1
        hashes.append(leaf_hash(row_leaf_data(row)))
        expected = position + 1
    while expected <= upto:
        hashes.append(leaf_hash(gap_leaf_data(expected)))
        expected += 1
    return hashes
