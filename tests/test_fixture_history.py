"""Histories written by earlier releases still load, verify, rebuild and explain.

Release 0.1 stored its events under the topics of top-level packages
(``domain.sandbox:Sandbox.AssignmentFenced``); release 0.2 under those of the package
``secondbox_scheduler`` as its modules were laid out before they moved into
subpackages. Each fixture history and the answers its release gave about it were
written by that release (``tests/fixtures/make_history_0_1.py``); today's code must give
the same answers, on SQLite (the file itself) and on PostgreSQL (the same rows copied
into a fresh schema).
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
from tests.histories import (
    ANSWERS_0_1,
    ANSWERS_0_2,
    HISTORY_0_1,
    HISTORY_0_2,
    copy_history,
    copy_sqlite,
    stored_rows,
)

HISTORIES = {"0.1": (HISTORY_0_1, ANSWERS_0_1, 3074), "0.2": (HISTORY_0_2, ANSWERS_0_2, 3171)}
# the module prefix of every stored topic of each release
PREFIX = {"0.1": "domain.", "0.2": "secondbox_scheduler.domain."}


def fixture_app(
    history: Path, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> SchedulerApplication:
    clock = Clock(LATER + timedelta(days=1))
    if kind == "sqlite":
        path = copy_sqlite(history, tmp_path)
        return SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{path}"}, now=clock)
    schema = request.getfixturevalue("postgres_schema")
    app = SchedulerApplication(env=schema.env(), now=clock)
    copy_history(history, app)
    return app


@pytest.mark.parametrize("release", sorted(HISTORIES))
def test_the_fixture_was_written_under_the_topics_of_its_release(release: str) -> None:
    history = HISTORIES[release][0]
    prefix = PREFIX[release]
    topics = {event.topic for event in stored_rows(history, "stored_events")}
    assert topics  # a history, and every topic names the release's layer package
    assert all(topic.startswith(prefix) for topic in topics)
    snapshots = stored_rows(history, "stored_snapshots")
    aggregates = {json.loads(s.state)["topic"] for s in snapshots}
    assert aggregates == {
        f"{prefix}runner:Runner",
        f"{prefix}lease:RunnerLease",
        f"{prefix}sandbox:Sandbox",
    }


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("release", sorted(HISTORIES))
def test_a_history_of_an_earlier_release_gives_the_answers_it_gave_then(
    release: str, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    history, answers_file, events = HISTORIES[release]
    app = fixture_app(history, kind, tmp_path, request)
    try:
        found = answers(app)
        found["events"] = app.event_count()
    finally:
        app.close()
    expected: dict[str, Any] = json.loads(answers_file.read_text())
    assert found["events"] == expected["events"] == events
    assert found["audit_verify"] == expected["audit_verify"]
    assert found["audit_verify"]["ok"] is True
    assert found["read_models"] == expected["read_models"]  # projections rebuild
    assert found["aggregates"] == expected["aggregates"]  # every aggregate loaded
    # every decision of an earlier release reads as actor unknown (the upcast to the
    # actor's class version, tests/test_actors.py); the rest is the answer given then
    actors = {
        decision.pop("actor")
        for explanation in found["explain"].values()
        for decision in explanation["decisions"]
    }
    assert actors == {None}
    assert found["explain"] == expected["explain"]
