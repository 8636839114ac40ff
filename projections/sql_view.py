"""Materialized views in SQL tables beside the events, on SQLite and PostgreSQL.

A view is an eventsourcing ``TrackingRecorder``: every batch of row changes commits in
one transaction together with the tracking position of the last notification it
covers, so each notification is applied exactly once, across crashes and restarts
(the position only moves with the rows, and a second writer of the same position
fails on the tracking row and rolls back).

The changes are row-level (:mod:`projections.row_changes`): a batch is folded in memory
into one net change per row, then written with one ``executemany`` per statement shape
(pipelined by psycopg on PostgreSQL), and many inserted rows with ``COPY`` on
PostgreSQL.

The SQL is written once with ``%s`` placeholders and ``{table}`` names; the SQLite
flavour turns ``%s`` into ``?``. Times are stored as fixed-width ISO text (UTC,
microseconds), which sorts and compares correctly as text on both databases.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

from eventsourcing.persistence import IntegrityError, Tracking, TrackingRecorder
from eventsourcing.postgres import PostgresDatastore, PostgresTrackingRecorder
from eventsourcing.projection import Projection
from eventsourcing.sqlite import SQLiteDatastore, SQLiteTrackingRecorder
from eventsourcing.utils import get_topic
from psycopg.sql import SQL, Composable, Composed, Identifier

from secondbox_scheduler.projections.row_changes import Encoders, Key, NetChanges, RowChange
from secondbox_scheduler.projections.unknown_events import UnknownEvents

Query = Callable[..., list[dict[str, Any]]]  # SqlView.query's signature: (sql, params)
COPY_MIN_ROWS = 64  # PostgreSQL: from this many inserted rows, COPY instead of INSERTs
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def time_text(value: datetime | None) -> str | None:
    if value is None:
        return None
    utc = value if value.tzinfo is UTC else value.astimezone(UTC)
    # TIME_FORMAT, with the year zero-padded to four digits in every year (strftime's %Y
    # is not below 1000: "1-01-01...", which strptime refused and which sorted wrongly)
    return utc.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def text_time(value: str | None) -> datetime | None:
    """The time of a text :func:`time_text` wrote (``TIME_FORMAT``), in UTC. That exact
    shape is read by ``datetime.fromisoformat`` (the same value, about 40 times faster
    than ``strptime``, which was half of a runner row's parsing); any other text, and one
    of that shape ``fromisoformat`` refuses (``strptime`` takes a space-padded field), by
    ``strptime``, as before."""
    if value is None:
        return None
    if (
        len(value) == 27
        and value[26] == "Z"
        and value[4] == "-"
        and value[10] == "T"
        and value[19] == "."
        and value.isascii()
    ):
        with suppress(ValueError):
            return datetime.fromisoformat(value)  # "Z": tzinfo UTC (datetime.UTC)
    return datetime.strptime(value, TIME_FORMAT).replace(tzinfo=UTC)


_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def to_json(value: Any) -> str:
    """Canonical JSON text (sorted keys, no spaces), as ``json.dumps`` with those options
    but without building an encoder per call."""
    return _JSON.encode(value)


class SqlView(TrackingRecorder):
    """Shared logic of the views: table DDL, batched changes with tracking, queries."""

    projection_name: ClassVar[str]
    table: ClassVar[str]
    ddl: ClassVar[tuple[str, ...]]  # CREATE statements, with {table}
    keys: ClassVar[tuple[Key, ...]]  # unique keys by which updates name their rows
    encoders: ClassVar[Encoders] = {}  # column -> Python value to stored value (not NULL)

    def _name(self, table: str) -> str:
        raise NotImplementedError

    def _sql(self, sql: str) -> Any:
        raise NotImplementedError

    def _format(self, sql: str) -> str:
        return sql.format(table=self._name(self.table))

    def net(self, changes: Iterable[RowChange] = ()) -> NetChanges:
        """A batch of this view's row changes, folded into one net change per row."""
        return NetChanges(self.keys).extend(changes)

    def apply(
        self,
        changes: Iterable[RowChange] | NetChanges,
        tracking: Tracking,
        expected: int | None = None,
        *,
        asynchronous_commit: bool = False,
    ) -> None:
        """Apply ``changes`` (folded first) and record ``tracking`` in one transaction.

        With ``expected`` (a batch that starts after that position), the position row is
        locked first and must still be ``expected``: two processes catching up the same
        batch concurrently cannot both apply it, even when their batches end at different
        positions (the tracking row alone only forbids going backwards).

        With ``asynchronous_commit`` (a rebuild), PostgreSQL acknowledges the commit
        before its WAL is on disk: a server crash may then lose the last batches, rows
        and position together (the transaction stays atomic), which are applied again.
        """
        net = changes if isinstance(changes, NetChanges) else self.net(changes)
        with self.datastore.transaction(commit=True) as cursor:  # type: ignore[attr-defined]
            if asynchronous_commit:
                self._commit_asynchronously(cursor)
            if expected is not None:
                position = self._locked_position(cursor, tracking.application_name)
                if position != expected:
                    raise IntegrityError(
                        f"{self.projection_name}: position moved from {expected} to {position}"
                    )
            self._write(cursor, net)
            self._insert_tracking(cursor, tracking)  # type: ignore[attr-defined]

    def _commit_asynchronously(self, cursor: Any) -> None:
        """Only PostgreSQL has asynchronous commits (SQLite: nothing)."""

    def _write(self, cursor: Any, net: NetChanges) -> None:
        for columns, rows in net.insert_groups(self.encoders).items():
            self._insert_rows(cursor, columns, rows)
        for (key, set_columns, add_columns), params in net.update_groups(self.encoders).items():
            assignments = [f"{column} = %s" for column in set_columns]
            assignments += [f"{column} = {column} + %s" for column in add_columns]
            where = " AND ".join(f"{column} = %s" for column in key)
            statement = f"UPDATE {{table}} SET {', '.join(assignments)} WHERE {where}"
            self._executemany(cursor, statement, params)

    def _insert_rows(
        self, cursor: Any, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
    ) -> None:
        placeholders = ", ".join("%s" for _ in columns)
        statement = f"INSERT INTO {{table}} ({', '.join(columns)}) VALUES ({placeholders})"
        self._executemany(cursor, statement, rows)

    def _executemany(self, cursor: Any, statement: str, params: list[tuple[Any, ...]]) -> None:
        if len(params) == 1:
            cursor.execute(self._sql(self._format(statement)), params[0])
        else:
            cursor.executemany(self._sql(self._format(statement)), params)

    def _locked_position(self, cursor: Any, application_name: str) -> int:
        raise NotImplementedError

    def ensure_position(self, application_name: str) -> None:
        """Create the position row (at 0) so that every batch can lock it."""
        with self.datastore.transaction(commit=True) as cursor:  # type: ignore[attr-defined]
            cursor.execute(
                self._sql(
                    f"INSERT INTO {self._tracking_name()} (application_name, notification_id) "
                    "VALUES (%s, 0) ON CONFLICT DO NOTHING"
                ),
                (application_name,),
            )

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        with self.datastore.transaction(commit=False) as cursor:  # type: ignore[attr-defined]
            cursor.execute(self._sql(self._format(sql)), tuple(params))
            return [dict(row) for row in cursor.fetchall()]

    @contextmanager
    def reading(self) -> Iterator[Query]:
        """A ``query`` whose statements share one read transaction and see one snapshot
        of the database (SQLite's; on PostgreSQL repeatable read)."""
        with self.datastore.transaction(commit=False) as cursor:  # type: ignore[attr-defined]
            self._begin_reading(cursor)

            def query(sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
                cursor.execute(self._sql(self._format(sql)), tuple(params))
                return [dict(row) for row in cursor.fetchall()]

            yield query

    def _begin_reading(self, cursor: Any) -> None:
        """SQLite: a read transaction sees one snapshot from its first read on."""

    # How ``clear`` empties the table; PostgreSQL truncates instead, so that a rebuild
    # fills fresh tables and indexes, not ones full of dead rows.
    clear_rows: ClassVar[str] = "DELETE FROM {table}"

    def clear(self, application_name: str) -> None:
        """Delete every row and the tracking position (before a rebuild)."""
        with self.datastore.transaction(commit=True) as cursor:  # type: ignore[attr-defined]
            cursor.execute(self._sql(self._format(self.clear_rows)), ())
            cursor.execute(
                self._sql(f"DELETE FROM {self._tracking_name()} WHERE application_name = %s"),
                (application_name,),
            )

    def _tracking_name(self) -> str:
        raise NotImplementedError


TView = TypeVar("TView", bound=SqlView)


class SqlProjection(Projection[TView]):
    """A projection whose handlers (``changes``, a ``singledispatchmethod`` in each
    subclass) turn an event into row changes of its :class:`SqlView`. The live runner
    (``projections run``) applies one event's changes per transaction; catch-up and
    rebuild call the handlers directly and fold a batch (``projections.read_models``).

    Each subclass accounts for every event class the aggregates record: a handler
    registered on ``changes`` (:meth:`handled_events`) or a reason in :attr:`IGNORED`.
    ``changes``'s default handler is :meth:`unhandled`: an event of a class in neither
    changes no row and is counted in :attr:`unknown_events`
    (:mod:`projections.unknown_events`)."""

    IGNORED: ClassVar[Mapping[type[Any], str]] = {}  # event class -> why it changes no row

    def __init__(self, view: TView) -> None:
        super().__init__(view)
        self.unknown_events = UnknownEvents(self.name)

    @classmethod
    def handled_events(cls) -> frozenset[type[Any]]:
        """The event classes registered on ``changes``."""
        changes = inspect.getattr_static(cls, "changes")
        return frozenset(c for c in changes.dispatcher.registry if c is not object)

    def changes(self, event: Any) -> list[RowChange]:
        raise NotImplementedError

    def unhandled(self, event: Any) -> list[RowChange]:
        """The changes of an event no handler is registered for: none. Unless its class
        is ignored, it is counted as unknown."""
        if type(event) not in self.IGNORED:
            self.unknown_events.add({get_topic(type(event)): 1})
        return []

    def process_event(self, domain_event: Any, tracking: Tracking) -> None:
        self.view.apply(self.changes(domain_event), tracking)


class SQLiteSqlView(SqlView, SQLiteTrackingRecorder):
    """SQLite flavour: a tracking table of the view's own (not the shared ``tracking``)."""

    def __init__(self, datastore: SQLiteDatastore, **kwargs: Any) -> None:
        super().__init__(datastore, **kwargs)
        tracking = self._tracking_name()
        self.insert_tracking_statement = (
            f"INSERT INTO {tracking} "
            "VALUES (:application_name, :notification_id) "
            "ON CONFLICT (application_name) DO UPDATE "
            "SET notification_id = :notification_id "
            f"WHERE {tracking}.notification_id < :notification_id "
            "RETURNING notification_id"
        )
        self.select_max_tracking_id_statement = (
            f"SELECT MAX(notification_id) FROM {tracking} WHERE application_name=?"
        )

    def construct_create_table_statements(self) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {self._tracking_name()} ("
            "application_name TEXT, notification_id INTEGER, "
            "PRIMARY KEY (application_name)) WITHOUT ROWID",
            *(self._format(statement) for statement in self.ddl),
        ]

    def _name(self, table: str) -> str:
        return table

    def _locked_position(self, cursor: Any, application_name: str) -> int:
        # A write first takes SQLite's write lock before this transaction reads anything.
        tracking = self._tracking_name()
        cursor.execute(
            f"UPDATE {tracking} SET notification_id = notification_id WHERE application_name = ?",
            (application_name,),
        )
        cursor.execute(
            f"SELECT notification_id FROM {tracking} WHERE application_name = ?",
            (application_name,),
        )
        row = cursor.fetchone()
        return 0 if row is None else int(row[0])

    def _tracking_name(self) -> str:
        return f"{self.projection_name}_tracking"

    def _sql(self, sql: str) -> str:
        return sql.replace("%s", "?")


class PostgresSqlView(SqlView, PostgresTrackingRecorder):
    """PostgreSQL flavour: tables in the application's schema."""

    clear_rows = "TRUNCATE {table}"

    def __init__(self, datastore: PostgresDatastore, **kwargs: Any) -> None:
        kwargs.setdefault("tracking_table_name", f"{self.projection_name}_tracking")
        super().__init__(datastore, **kwargs)
        for statement in self.ddl:
            self.sql_create_statements.append(Composed([SQL(self._format(statement))]))

    def _name(self, table: str) -> str:
        return f'"{self.datastore.schema}"."{table}"'

    def _tracking_name(self) -> str:
        return self._name(self.tracking_table_name)

    def _locked_position(self, cursor: Any, application_name: str) -> int:
        cursor.execute(
            SQL(
                f"SELECT notification_id FROM {self._tracking_name()} "
                "WHERE application_name = %s FOR UPDATE"
            ),
            (application_name,),
        )
        row = cursor.fetchone()
        return 0 if row is None else int(row["notification_id"])

    def _sql(self, sql: str) -> Composable:
        return SQL(sql)

    def _commit_asynchronously(self, cursor: Any) -> None:
        cursor.execute(SQL("SET LOCAL synchronous_commit TO OFF"))

    def _begin_reading(self, cursor: Any) -> None:
        cursor.execute(SQL("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))

    def _insert_rows(
        self, cursor: Any, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
    ) -> None:
        if len(rows) < COPY_MIN_ROWS:
            super()._insert_rows(cursor, columns, rows)
            return
        statement = f"COPY {self._name(self.table)} ({', '.join(columns)}) FROM STDIN"
        with cursor.copy(SQL(statement)) as copy:
            for row in rows:
                copy.write_row(row)


__all__ = [
    "Identifier",
    "PostgresSqlView",
    "Query",
    "SQLiteSqlView",
    "SqlProjection",
    "SqlView",
    "text_time",
    "time_text",
    "to_json",
]
