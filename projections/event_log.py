"""Facts about the stored event log that the eventsourcing recorder API does not give.

``max_notification_id`` is a position, not a count: on PostgreSQL a rolled-back insert
(a lost optimistic-concurrency race) still consumes a notification id, so the head
position can run ahead of the number of stored events.
"""

from __future__ import annotations

from eventsourcing.persistence import ApplicationRecorder
from eventsourcing.popo import POPOApplicationRecorder
from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.sqlite import SQLiteApplicationRecorder
from psycopg.sql import SQL, Identifier


def count_events(recorder: ApplicationRecorder) -> int:
    """How many events the application's log holds."""
    if isinstance(recorder, PostgresApplicationRecorder):
        statement = SQL("SELECT count(*) AS n FROM {}.{}").format(
            Identifier(recorder.datastore.schema), Identifier(recorder.events_table_name)
        )
        with recorder.datastore.transaction(commit=False) as cursor:
            cursor.execute(statement)
            row = cursor.fetchone()
            assert row is not None
            return int(row["n"])
    if isinstance(recorder, SQLiteApplicationRecorder):
        with recorder.datastore.transaction(commit=False) as cursor:
            cursor.execute(f"SELECT count(*) FROM {recorder.events_table_name}")
            return int(cursor.fetchone()[0])
    if isinstance(recorder, POPOApplicationRecorder):
        return len(recorder._stored_events)
    raise TypeError(f"cannot count the events of {type(recorder).__name__}")


def count_events_after(recorder: ApplicationRecorder, position: int) -> int:
    """How many stored events lie after notification ``position``."""
    if isinstance(recorder, PostgresApplicationRecorder):
        statement = SQL("SELECT count(*) AS n FROM {}.{} WHERE notification_id > %s").format(
            Identifier(recorder.datastore.schema), Identifier(recorder.events_table_name)
        )
        with recorder.datastore.transaction(commit=False) as cursor:
            cursor.execute(statement, (position,))
            row = cursor.fetchone()
            assert row is not None
            return int(row["n"])
    if isinstance(recorder, SQLiteApplicationRecorder):
        with recorder.datastore.transaction(commit=False) as cursor:
            cursor.execute(
                f"SELECT count(*) FROM {recorder.events_table_name} WHERE rowid > ?",
                (position,),
            )
            return int(cursor.fetchone()[0])
    return max(0, count_events(recorder) - position)
