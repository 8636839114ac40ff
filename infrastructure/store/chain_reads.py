"""Reading the chain and the sealed snapshots back as stored, for the audit
(infrastructure/audit/replay.py): the head of the chain, its links, every snapshot with
its seal and digest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

from eventsourcing.persistence import StoredEvent
from psycopg.rows import tuple_row
from psycopg.sql import SQL, Identifier

from secondbox_scheduler.domain.audit.chain import Link
from secondbox_scheduler.infrastructure.store.chain_tables import as_link, chain_table, seal_table
from secondbox_scheduler.infrastructure.store.chained_postgres import ChainedPostgresRecorder
from secondbox_scheduler.infrastructure.store.chained_sqlite import ChainedSQLiteRecorder
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from secondbox_scheduler.infrastructure.store.sealed_sqlite import SealedSQLiteSnapshots


def chain_head(recorder: object) -> Link | None:
    """The last link of the chain (None: no link, or the recorder does not chain)."""
    if isinstance(recorder, ChainedSQLiteRecorder):
        with recorder.datastore.transaction(commit=False) as c:
            c.execute(recorder.select_head_statement)
            return as_link(c.fetchone())
    if isinstance(recorder, ChainedPostgresRecorder):
        with (
            recorder.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as curs,
        ):
            curs.execute(recorder.select_head_statement)
            return as_link(curs.fetchone())
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
        ).format(**recorder.table_names())
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


# -- the snapshots read a chunk at a time (``audit verify`` streams the log) -------------
#
# ``stored_snapshots`` reads every snapshot with its state at once: a runner snapshotted
# every tenth event with R live reservations stores O(R) bytes each time, so the table
# grows faster than the log. The audit reads instead the snapshots' keys once (a few
# numbers each, :func:`snapshot_index`), then the states of those taken at each page's
# events, a chunk at a time (:func:`snapshot_rows`). The states are fetched by key: on
# SQLite the snapshots table is WITHOUT ROWID, whose B-tree holds whole rows, so a join
# driven by the events' positions would read a snapshot at every probe.

SnapshotKey = tuple[UUID, int, int | None, int]
"""(originator id, version, position of the event at its version or None, state bytes)"""
SnapshotRow = tuple[StoredEvent, bytes | None, bytes | None]
"""(the stored snapshot, its seal, the chain digest at its version)"""


INDEX_BATCH = 2000  # snapshot keys fetched at once (the index is read as it is used)


def snapshot_index(recorder: object) -> Iterator[SnapshotKey]:
    """Every snapshot's key, by stream and version (no state), fetched a batch at a
    time: the caller keeps what it needs of each (a few numbers), never every row."""
    if isinstance(recorder, SealedSQLiteSnapshots):
        with recorder.datastore.transaction(commit=False) as c:
            c.execute(
                "SELECT s.originator_id, s.originator_version, e.rowid, length(s.state) "
                f"FROM {recorder.events_table_name} s "
                f"LEFT JOIN {recorder.chained_events_table} e "
                "ON e.originator_id = s.originator_id "
                "AND e.originator_version = s.originator_version "
                "ORDER BY s.originator_id, s.originator_version"
            )
            while rows := c.sqlite_cursor.fetchmany(INDEX_BATCH):
                yield from ((UUID(r[0]), r[1], r[2], r[3] or 0) for r in rows)
        return
    if isinstance(recorder, SealedPostgresSnapshots):
        query = SQL(
            "SELECT s.originator_id, s.originator_version, e.notification_id, "
            "octet_length(s.state) FROM {schema}.{snapshots} s LEFT JOIN {schema}.{events} e "
            "ON e.originator_id = s.originator_id AND e.originator_version = s.originator_version "
            "ORDER BY s.originator_id, s.originator_version"
        ).format(**recorder.table_names())
        with (
            recorder.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row, binary=True) as curs,
        ):
            curs.execute(query)
            while rows := curs.fetchmany(INDEX_BATCH):
                yield from ((r[0], r[1], r[2], r[3] or 0) for r in rows)


def snapshot_rows(
    recorder: object, keys: list[tuple[UUID, int]]
) -> dict[tuple[UUID, int], SnapshotRow]:
    """The snapshots of ``keys`` (stream, version), each with its seal and the chain
    digest at its version."""
    found: list[Any] = []
    if not keys:
        return {}
    if isinstance(recorder, SealedSQLiteSnapshots):
        for spelled in (lambda u: u.hex, str):  # as the recorder writes it, or dashed
            found += _sqlite_snapshot_rows(recorder, [(spelled(k[0]), k[1]) for k in keys])
            got = {(r[0], r[1]) for r in found}
            keys = [k for k in keys if k not in got]
            if not keys:
                break
    elif isinstance(recorder, SealedPostgresSnapshots):
        query = SQL(
            "SELECT s.originator_id, s.originator_version, s.topic, s.state, g.seal, c.digest "
            "FROM {schema}.{snapshots} s LEFT JOIN {schema}.{seals} g "
            "ON g.originator_id = s.originator_id AND g.originator_version = s.originator_version "
            "LEFT JOIN {schema}.{events} e ON e.originator_id = s.originator_id "
            "AND e.originator_version = s.originator_version "
            "LEFT JOIN {schema}.{chain} c ON c.position = e.notification_id "
            "WHERE (s.originator_id, s.originator_version) IN "
            "(SELECT * FROM unnest(%s::uuid[], %s::bigint[]))"
        ).format(**recorder.table_names())
        with (
            recorder.datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row, binary=True) as curs,
        ):
            curs.execute(query, ([k[0] for k in keys], [k[1] for k in keys]))
            found = curs.fetchall()
    return {
        (r[0], r[1]): (
            StoredEvent(r[0], r[1], r[2], bytes(r[3])),
            None if r[4] is None else bytes(r[4]),
            None if r[5] is None else bytes(r[5]),
        )
        for r in found
    }


def _sqlite_snapshot_rows(
    recorder: SealedSQLiteSnapshots, keys: list[tuple[str, int]]
) -> list[Any]:
    events, chain = recorder.chained_events_table, chain_table(recorder.chained_events_table)
    values = ",".join("(?, ?)" for _ in keys)
    with recorder.datastore.transaction(commit=False) as c:
        c.execute(
            f"WITH k(id, version) AS (VALUES {values}) "
            "SELECT s.originator_id, s.originator_version, s.topic, s.state, g.seal, "
            f"c.digest FROM k CROSS JOIN {recorder.events_table_name} s "
            "ON s.originator_id = k.id AND s.originator_version = k.version "
            f"LEFT JOIN {seal_table(recorder.events_table_name)} g "
            "ON g.originator_id = s.originator_id "
            "AND g.originator_version = s.originator_version "
            f"LEFT JOIN {events} e ON e.originator_id = s.originator_id "
            "AND e.originator_version = s.originator_version "
            f"LEFT JOIN {chain} c ON c.position = e.rowid",
            [v for key in keys for v in key],
        )
        return [(UUID(r[0]), *r[1:]) for r in c.fetchall()]
