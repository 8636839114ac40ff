"""An example host: follows the scheduler's assignments into a read model of its own.

A control plane that embeds the scheduler (``pip install secondbox-scheduler``) keeps
the assignments it cares about in its own database: here a SQLite file with one row
per sandbox generation (its runner, its state, who changed it last, how many events
changed it) and the position of the last event applied. Each event's change and the
new position commit in one transaction, so the host applies every event exactly once,
however often it stops and starts again: it resumes after the position it stored.

    python docs/examples/assignment_host.py --database-url sqlite:///secondbox.db \
        --host-db host.db            # follows until interrupted
    python docs/examples/assignment_host.py ... --once   # applies what is there, prints

docs/api.md ("Following the events in-process") explains ``follow``;
``tests/test_example_host.py`` runs this file on SQLite and PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from secondbox_scheduler import SchedulerApplication
from secondbox_scheduler.events import (
    FeedEvent,
    SandboxAssignmentFailed,
    SandboxAssignmentFenced,
    SandboxAssignmentReleased,
    SandboxAssignmentRunning,
    SandboxAssignmentUncertain,
    follow,
)

# The event types this host applies (docs/events.md): every change of an assignment's state.
TYPES = (
    "Sandbox.AssignmentFenced",
    "Sandbox.AssignmentRunning",
    "Sandbox.AssignmentReleased",
    "Sandbox.AssignmentFailed",
    "Sandbox.AssignmentUncertain",
)
CHANGES = (
    SandboxAssignmentRunning,
    SandboxAssignmentReleased,
    SandboxAssignmentFailed,
    SandboxAssignmentUncertain,
)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS assignments (sandbox_id TEXT NOT NULL, generation INTEGER "
    "NOT NULL, runner_id TEXT NOT NULL, state TEXT NOT NULL, changed_by TEXT, "
    "changes INTEGER NOT NULL, PRIMARY KEY (sandbox_id, generation))",
    "CREATE TABLE IF NOT EXISTS followed (id INTEGER PRIMARY KEY CHECK (id = 1), "
    "position INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO followed (id, position) VALUES (1, 0)",
)


class AssignmentHost:
    """The host's read model of assignments, kept by following the scheduler's log."""

    def __init__(self, scheduler: SchedulerApplication, path: str) -> None:
        self.scheduler = scheduler
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        for statement in SCHEMA:
            self.db.execute(statement)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def position(self) -> int:
        (position,) = self.db.execute("SELECT position FROM followed").fetchone()
        return int(position)

    def apply(self, item: FeedEvent) -> None:
        """One event's change and its position, in one transaction."""
        event, actor = item.event, describe(item.event.actor)
        with self.transaction() as db:
            if isinstance(event, SandboxAssignmentFenced):
                record = event.assignment
                db.execute(
                    "INSERT INTO assignments VALUES (?, ?, ?, ?, ?, 1)",
                    (record["sandbox_id"], record["generation"], record["runner_id"],
                     record["state"], actor),
                )  # fmt: skip
            elif isinstance(event, CHANGES):
                db.execute(
                    "UPDATE assignments SET state = ?, changed_by = ?, changes = changes + 1 "
                    "WHERE sandbox_id = ? AND generation = ?",
                    (state_after(event), actor, item.subject.sandbox_id, event.generation),
                )
            db.execute("UPDATE followed SET position = ?", (item.position,))

    def follow(self, *, wait: bool = True, stop: threading.Event | None = None) -> int:
        """Apply every new event of :data:`TYPES` after the stored position; with
        ``wait``, go on until ``stop`` is set. Returns how many it applied."""
        applied = 0
        for item in follow(self.scheduler, after=self.position(), types=TYPES, wait=wait,
                           stop=stop):  # fmt: skip
            self.apply(item)
            applied += 1
        return applied

    def rows(self) -> list[dict[str, Any]]:
        cursor = self.db.execute("SELECT * FROM assignments ORDER BY sandbox_id, generation")
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self) -> None:
        self.db.close()


def state_after(event: Any) -> str:
    if isinstance(event, SandboxAssignmentRunning):
        return "running"
    if isinstance(event, SandboxAssignmentReleased):
        return "released"
    if isinstance(event, SandboxAssignmentUncertain):
        return "uncertain"
    return str(event.state)  # a failure: failed, or back to assigned for a retry


def describe(actor: dict[str, Any] | None) -> str | None:
    if actor is None:
        return None
    role = f" ({actor['role']})" if actor.get("role") else ""
    return f"{actor['kind']} {actor.get('name')}{role}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="The scheduler's store.")
    parser.add_argument("--host-db", required=True, help="The host's own SQLite file.")
    parser.add_argument("--once", action="store_true", help="Apply what is there, then stop.")
    options = parser.parse_args()
    scheduler = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": options.database_url})
    host = AssignmentHost(scheduler, options.host_db)
    try:
        applied = host.follow(wait=not options.once)
        summary = {"applied": applied, "position": host.position(), "assignments": host.rows()}
        print(json.dumps(summary, indent=2))
    except KeyboardInterrupt:
        pass
    finally:
        host.close()
        scheduler.close()


if __name__ == "__main__":
    main()
