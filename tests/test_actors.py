"""The actor in every event: who asked, recorded on each command's events
(domain/actors.py, infrastructure/acting.py), shown by ``audit timeline`` and ``audit
explain``; events of earlier releases read as actor unknown (a versioned upcast)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from secondbox_scheduler.domain.actors import ACTOR_VERSION, Actor, ActorRecord, describe_actor
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.event_catalogue import event_classes
from secondbox_scheduler.domain.ids import refusal_log_uuid
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.acting import acting_as
from secondbox_scheduler.infrastructure.audit.queries import explain, timeline
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.batcher import PlacementBatcher
from secondbox_scheduler.projections.event_decoder import EventDecoder
from tests.conftest import Clock
from tests.factories import (
    RUNTIME,
    create_sandbox,
    materialization,
    register,
    requirements,
    schedule_request,
)
from tests.histories import HISTORY_0_1, HISTORY_0_2, copy_sqlite

ALICE: ActorRecord = {"kind": "library", "name": "alice"}
BOB: ActorRecord = {"kind": "library", "name": "bob"}


@pytest.fixture
def sqlite_app(tmp_path: Path, clock: Clock) -> Iterator[SchedulerApplication]:
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'a.db'}"}, now=clock
    )
    try:
        yield app
    finally:
        app.close()


def stored_events(app: SchedulerApplication) -> list[Any]:
    """Every event of the log, decoded by the mapper."""
    notifications = app.recorder.select_notifications(start=1, limit=100_000)
    return [app.mapper.to_domain_event(n) for n in notifications]


def test_every_event_class_records_its_actor_at_a_new_class_version() -> None:
    for cls in event_classes():
        assert "actor" in cls.__dataclass_fields__, cls
        version = cls.class_version
        assert version >= ACTOR_VERSION
        assert callable(getattr(cls, f"upcast_v{version - 1}_v{version}")), cls
    assert Sandbox.AssignmentFenced.class_version == 3


def test_an_embedders_name_a_setting_or_nothing_is_recorded(tmp_path: Path, clock: Clock) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    named = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": url, "SECONDBOX_ACTOR": "billing"}, now=clock
    )
    try:
        register(app, "r1", at=clock())
        with acting_as("alice"):
            register(app, "r2", at=clock())
            with acting_as(Actor.cli("root")):  # the innermost wins
                register(app, "r3", at=clock())
            register(named, "r4", at=clock())  # the context wins over the setting
        register(named, "r5", at=clock())
        actors = {e.runner_id: e.actor for e in stored_events(app) if hasattr(e, "allocatable")}
    finally:
        app.close()
        named.close()
    assert actors == {
        "r1": {"kind": "library", "name": None},
        "r2": ALICE,
        "r3": {"kind": "cli", "name": "root"},
        "r4": ALICE,
        "r5": {"kind": "library", "name": "billing"},
    }


def test_an_actor_name_that_is_no_acceptable_name_is_refused(tmp_path: Path, clock: Clock) -> None:
    env = {"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'a.db'}", "SECONDBOX_ACTOR": "a\x1b"}
    with pytest.raises(InvalidRequestError) as refused:
        SchedulerApplication(env=env, now=clock)
    assert refused.value.field == "SECONDBOX_ACTOR"
    with pytest.raises(InvalidRequestError), acting_as(" alice"):
        pass
    assert Actor.cli("a" * 300).name is None  # an OS name past the limit: no name


def test_new_events_are_stored_at_the_new_version_with_their_actor(
    sqlite_app: SchedulerApplication, clock: Clock
) -> None:
    with acting_as("alice"):
        register(sqlite_app, "r1", at=clock())
        create_sandbox(sqlite_app, "s1")
        sqlite_app.schedule(schedule_request("s1", clock()))
    notifications = sqlite_app.recorder.select_notifications(start=1, limit=100)
    for notification in notifications:
        state = json.loads(notification.state)
        fence = notification.topic.endswith("AssignmentFenced")
        assert state["class_version"] == (3 if fence else 2), notification.topic
        assert state["actor"] == ALICE, notification.topic


def test_batched_placements_of_different_callers_record_each_callers_actor(
    sqlite_app: SchedulerApplication, clock: Clock
) -> None:
    """One transaction, three callers: each request's fence, reservation and token use
    record its own caller, and a refusal its own, not the leader's."""
    register(sqlite_app, "r1", at=clock())
    register(sqlite_app, "r2", at=clock(), pool_name="pool-b")
    create_sandbox(sqlite_app, "s1")
    create_sandbox(sqlite_app, "s2")
    create_sandbox(sqlite_app, "s3", pool_name="pool-b")
    clock.advance(seconds=3600)  # s3's placement is refused: its home runner went silent
    sqlite_app.record_heartbeat(
        runner_id="r1", at=clock(), artifact_digests=[RUNTIME], materializations=[materialization()]
    )
    head = sqlite_app.head_position()
    requests = [
        schedule_request("s1", clock()),
        schedule_request("s2", clock()),
        schedule_request("s3", clock(), requirements=requirements(pool_name="pool-b")),
    ]
    carol: ActorRecord = {"kind": "token", "name": "0123456789ab", "role": "control-plane"}
    with acting_as("leader"):
        outcomes = PlacementBatch(sqlite_app).run_deferring(
            requests, [False] * 3, [ALICE, BOB, carol]
        )
    assert [isinstance(o, tuple) for o in outcomes] == [True, True, False], outcomes
    streams = {refusal_log_uuid(s): s for s in ("s1", "s2", "s3")}
    by_sandbox: dict[str, list[Any]] = {}
    for notification in sqlite_app.recorder.select_notifications(start=head + 1, limit=100):
        event: Any = sqlite_app.mapper.to_domain_event(notification)
        sandbox = getattr(event, "sandbox_id", None) or streams.get(event.originator_id)
        if sandbox is None:
            sandbox = event.assignment["sandbox_id"]
        by_sandbox.setdefault(sandbox, []).append(event.actor)
    assert by_sandbox == {
        "s1": [ALICE, ALICE, ALICE],  # fence, reservation, token use
        "s2": [BOB, BOB, BOB],
        "s3": [carol, carol],  # the refusal log opened, the refusal
    }


def test_the_batcher_hands_each_callers_actor_to_the_batch(clock: Clock) -> None:
    """Callers queued behind a leader are decided in its batch, each with its own actor
    (the leader's thread runs the batch)."""
    batches: list[list[Any]] = []
    opened = threading.Event()

    def run(requests: Sequence[Any], _: Sequence[bool], actors: Sequence[Any]) -> list[Any]:
        batches.append([(r.sandbox_id, a) for r, a in zip(requests, actors, strict=True)])
        if requests[0].sandbox_id == "opener":
            assert opened.wait(10)
        return [(r.sandbox_id, True) for r in requests]

    batcher = PlacementBatcher(run)

    def call(name: str, actor: str) -> None:
        with acting_as(actor):
            batcher.schedule(schedule_request(name, clock()))

    opener = threading.Thread(target=call, args=("opener", "leader"), daemon=True)
    opener.start()
    while not batches:
        opened.wait(0.001)
    callers = [
        threading.Thread(target=call, args=(name, actor), daemon=True)
        for name, actor in (("a", "alice"), ("b", "bob"))
    ]
    for caller in callers:
        caller.start()
    while len(batcher._queue) < 2:
        opened.wait(0.001)
    opened.set()
    for thread in (opener, *callers):
        thread.join(10)
        assert not thread.is_alive()
    assert batches[0] == [("opener", {"kind": "library", "name": "leader"})]
    assert sorted(batches[1], key=lambda item: item[0]) == [("a", ALICE), ("b", BOB)]


def test_timeline_and_explain_show_the_actor(
    sqlite_app: SchedulerApplication, clock: Clock
) -> None:
    with acting_as("alice"):
        register(sqlite_app, "r1", at=clock())
        create_sandbox(sqlite_app, "s1")
    with acting_as(Actor.token("0123456789ab", "control-plane")):
        sqlite_app.schedule(schedule_request("s1", clock()))
    entries = {e.event: e.to_dict() for e in timeline(sqlite_app, sandbox_id="s1")}
    assert entries["Sandbox.Created"]["actor"] == ALICE
    assert "actor" not in entries["Sandbox.Created"]["fields"]
    fenced = entries["Sandbox.AssignmentFenced"]["actor"]
    assert fenced == {"kind": "token", "name": "0123456789ab", "role": "control-plane"}
    decisions = explain(sqlite_app, "s1").to_dict()["decisions"]
    assert [d["actor"] for d in decisions] == [ALICE, fenced]
    assert describe_actor(fenced) == "token 0123456789ab (control-plane)"
    assert describe_actor(None) == "unknown"


@pytest.mark.parametrize("history", [HISTORY_0_1, HISTORY_0_2], ids=["0.1", "0.2"])
def test_events_of_earlier_releases_read_as_actor_unknown(
    history: Path, tmp_path: Path, clock: Clock
) -> None:
    """Every event of the fixture histories, through the mapper and the replay's
    decoder, has the actor None (upcast), and the audit shows it as unknown; the
    histories still verify, rebuild and explain (tests/test_fixture_history.py)."""
    path = copy_sqlite(history, tmp_path)
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{path}"}, now=clock)
    try:
        notifications = app.recorder.select_notifications(start=1, limit=100_000)
        decoder = EventDecoder(app.mapper)
        assert decoder.lean
        fences = 0
        for notification in notifications:
            assert "class_version" not in json.loads(notification.state) or (
                notification.topic.endswith("AssignmentFenced")
            )
            decoded: list[Any] = [app.mapper.to_domain_event(notification), decoder(notification)]
            for event in decoded:
                assert event.actor is None, notification.topic
            if notification.topic.endswith("AssignmentFenced"):
                fences += 1
                assert "token_indexed" in vars(decoder(notification))  # v1 -> v2 -> v3
        assert fences
        sandbox = next(
            getattr(app.mapper.to_domain_event(n), "sandbox_id")  # noqa: B009
            for n in notifications
            if n.topic.endswith("Sandbox.Created")
        )
        assert {entry.actor for entry in timeline(app, sandbox_id=sandbox)} == {None}
        assert {d.actor is None for d in explain(app, sandbox).decisions} == {True}
        shown = CliRunner().invoke(
            cli,
            ["audit", "timeline", "--sandbox", sandbox, "--database-url", f"sqlite:///{path}"],
            env={"COLUMNS": "300"},
        )
        assert shown.exit_code == 0, shown.output
        assert "unknown" in shown.output
    finally:
        app.close()


def test_the_command_line_records_cli_and_the_os_user(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    runner = CliRunner()
    made = runner.invoke(
        cli, ["tokens", "create", "--role", "auditor", "--database-url", url, "--json"],
        env={"LOGNAME": "alice"},
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    listed = runner.invoke(cli, ["tokens", "list", "--database-url", url, "--json"])
    assert listed.exit_code == 0, listed.output
    (token,) = json.loads(listed.output)
    assert token["issued_by"] == {"kind": "cli", "name": "alice"}
