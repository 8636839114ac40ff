"""docs/examples/assignment_host.py: a host that follows the assignments into its own
read model, on SQLite and PostgreSQL.

Its rows must equal the scheduler's assignments (runner and state), each event applied
exactly once (its ``changes`` count equals the events of its key in the log), across
restarts of the host, a crash in the middle of applying an event, and writes that go
on while it follows; run as a script it prints what it applied.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.feed import lists
from secondbox_scheduler.infrastructure.feed.reading import FeedFilter, read_feed
from tests.conftest import Clock, Store
from tests.feed_helpers import Writers

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "assignment_host.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("assignment_host", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected(app: SchedulerApplication, types: tuple[str, ...]) -> dict[tuple[str, int], Any]:
    """Every assignment as the scheduler has it, and how many events changed it."""
    found: dict[tuple[str, int], Any] = {}
    cursor = None
    while True:
        page = lists.list_assignments(app, cursor=cursor, limit=1000)
        for assignment in page.items:
            found[(assignment.sandbox_id, assignment.generation)] = (
                assignment.runner_id,
                assignment.state,
            )
        cursor = page.next
        if cursor is None:
            break
    changes: Counter[tuple[str, int]] = Counter()
    after = 0
    while True:
        feed = read_feed(app, after, 1000, FeedFilter(types=types))
        for item in feed.events:
            generation = getattr(item.event, "generation", None)
            if generation is None:
                generation = item.event.assignment["generation"]
            changes[(str(item.subject.sandbox_id), int(generation))] += 1
        after = feed.next
        if not feed.more:
            break
    return {key: (*value, changes[key]) for key, value in found.items()}


def _rows(host: Any) -> dict[tuple[str, int], Any]:
    return {
        (row["sandbox_id"], row["generation"]): (row["runner_id"], row["state"], row["changes"])
        for row in host.rows()
    }


def test_the_example_host_applies_every_assignment_event_exactly_once(
    store: Store, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = _example()
    app = store.open()
    host_db = str(tmp_path / "host.db")
    Writers(store.open, clock, rounds=3).start_and_join()
    host = example.AssignmentHost(app, host_db)

    # a crash in the middle of the fourth event: its change rolls back with its position
    calls = {"n": 0}
    real_execute = host.db.execute

    def crashing(statement: str, *args: Any) -> Any:
        if statement.startswith("UPDATE followed"):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("the host died here")
        return real_execute(statement, *args)

    host.db = _Wrapped(host.db, crashing)
    with pytest.raises(RuntimeError, match="died"):
        host.follow(wait=False)
    host.close()

    host = example.AssignmentHost(app, host_db)  # a restart: resumes after its position
    assert host.follow(wait=False) > 0
    assert _rows(host) == _expected(app, example.TYPES)
    assert host.follow(wait=False) == 0  # nothing new: nothing applied again

    # following live while writes go on, then stopped
    stop = threading.Event()
    follower = threading.Thread(target=lambda: host.follow(wait=True, stop=stop), daemon=True)
    follower.start()
    Writers(store.open, clock, rounds=3, prefix="b").start_and_join()
    expected = _expected(app, example.TYPES)
    started = time.monotonic()
    while _rows(host) != expected and time.monotonic() - started < 60:
        time.sleep(0.05)
    stop.set()
    follower.join(timeout=10)
    assert _rows(host) == expected
    assert {state for _, state, _ in expected.values()} >= {"assigned", "released"}
    host.close()


class _Wrapped:
    """A connection whose ``execute`` is replaced (sqlite3's own cannot be patched)."""

    def __init__(self, connection: Any, execute: Any) -> None:
        self._connection = connection
        self.execute = execute

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


def test_the_example_host_runs_as_a_script(tmp_path: Path, clock: Clock) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    try:
        Writers(lambda: SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock),
                clock, count=1, rounds=2).start_and_join()  # fmt: skip
        expected = _expected(app, _example().TYPES)
    finally:
        app.close()
    command = [sys.executable, str(EXAMPLE), "--database-url", url, "--host-db",
               str(tmp_path / "host.db"), "--once"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    rows = {
        (row["sandbox_id"], row["generation"]): (row["runner_id"], row["state"], row["changes"])
        for row in summary["assignments"]
    }
    assert rows == expected
    assert summary["applied"] == sum(changes for *_, changes in expected.values())
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert json.loads(again.stdout)["applied"] == 0
