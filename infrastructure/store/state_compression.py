"""LZ4 compression of the ``state`` column of the PostgreSQL events and snapshots
tables (:mod:`.chained_postgres`, :mod:`.sealed_postgres`)."""

from __future__ import annotations

import logging

from eventsourcing.persistence import PersistenceError
from eventsourcing.postgres import PostgresDatastore
from psycopg.sql import SQL, Identifier, Literal

log = logging.getLogger("secondbox_scheduler.chain")

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
