"""Stored histories for tests: the committed fixture of release 0.1, copied to any store.

The fixture (``tests/fixtures/history-0.1.db``) is never opened in place: each test
copies it, into its own SQLite file or into a fresh PostgreSQL schema, exactly as
stored (topics, state bytes, order), snapshots included.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from uuid import UUID

from eventsourcing.persistence import StoredEvent

from secondbox_scheduler.infrastructure import SchedulerApplication

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HISTORY_0_1 = FIXTURES / "history-0.1.db"
ANSWERS_0_1 = FIXTURES / "history-0.1.answers.json"
HISTORY_0_2 = FIXTURES / "history-0.2.db"
ANSWERS_0_2 = FIXTURES / "history-0.2.answers.json"
_CHUNK = 500


def copy_sqlite(source: Path, directory: Path) -> Path:
    """A private copy of a SQLite history file."""
    target = directory / source.name
    shutil.copyfile(source, target)
    return target


def stored_rows(source: Path, table: str) -> list[StoredEvent]:
    """The rows of a SQLite history's events or snapshots table, in stored order."""
    connection = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    try:
        rows = connection.execute(
            "SELECT originator_id, originator_version, topic, state FROM "
            f"{table} ORDER BY {'rowid' if table == 'stored_events' else 'originator_id'}"
        ).fetchall()
    finally:
        connection.close()
    return [StoredEvent(UUID(row[0]), row[1], row[2], bytes(row[3])) for row in rows]


def copy_history(source: Path, app: SchedulerApplication) -> int:
    """Append a SQLite history's events (in log order) and snapshots to ``app``'s store,
    byte for byte; returns the number of events."""
    events = stored_rows(source, "stored_events")
    for start in range(0, len(events), _CHUNK):
        app.recorder.insert_events(events[start : start + _CHUNK])
    assert app.snapshots is not None
    snapshots = stored_rows(source, "stored_snapshots")
    for start in range(0, len(snapshots), _CHUNK):
        app.snapshots.recorder.insert_events(snapshots[start : start + _CHUNK])
    return len(events)
