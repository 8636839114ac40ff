"""A history written by release 0.1 still loads, verifies, rebuilds and explains.

Release 0.1 stored its events under the topics of top-level packages
(``domain.sandbox:Sandbox.AssignmentFenced``). The fixture history and the answers 0.1
gave about it were written before the package was renamed
(``tests/fixtures/make_history_0_1.py``); today's code must give the same answers, on
SQLite (the file itself) and on PostgreSQL (the same rows copied into a fresh schema).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock
from tests.fixtures.make_history_0_1 import LATER, answers
from tests.histories import ANSWERS_0_1, HISTORY_0_1, copy_history, copy_sqlite, stored_rows


def expected_answers() -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(ANSWERS_0_1.read_text())
    return recorded


def fixture_app(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> SchedulerApplication:
    clock = Clock(LATER + timedelta(days=1))
    if kind == "sqlite":
        path = copy_sqlite(HISTORY_0_1, tmp_path)
        return SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{path}"}, now=clock)
    schema = request.getfixturevalue("postgres_schema")
    app = SchedulerApplication(env=schema.env(), now=clock)
    copy_history(HISTORY_0_1, app)
    return app


def test_the_fixture_was_written_under_the_topics_of_release_0_1() -> None:
    topics = {event.topic for event in stored_rows(HISTORY_0_1, "stored_events")}
    assert topics  # a history, and every topic names a top-level layer package
    assert all(topic.startswith("domain.") for topic in topics)
    snapshots = stored_rows(HISTORY_0_1, "stored_snapshots")
    aggregates = {json.loads(s.state)["topic"] for s in snapshots}
    assert aggregates == {
        "domain.runner:Runner",
        "domain.lease:RunnerLease",
        "domain.sandbox:Sandbox",
    }


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_release_0_1_history_gives_the_answers_it_gave_then(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    app = fixture_app(kind, tmp_path, request)
    try:
        found = answers(app)
        found["events"] = app.event_count()
    finally:
        app.close()
    expected = expected_answers()
    assert found["events"] == expected["events"] == 3074
    assert found["audit_verify"] == expected["audit_verify"]
    assert found["audit_verify"]["ok"] is True
    assert found["read_models"] == expected["read_models"]  # projections rebuild
    assert found["aggregates"] == expected["aggregates"]  # every aggregate loaded
    assert found["explain"] == expected["explain"]
