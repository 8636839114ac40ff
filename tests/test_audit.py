"""Audit replay: broken histories are caught at their exact position; clean ones verify."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from typer.testing import CliRunner

from secondbox_scheduler.domain import HomeRunnerUnavailableError, NoCompatibleRunnerError
from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.queries import explain, state_at, timeline
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.cli import cli
from tests.conftest import Clock
from tests.factories import (
    CAPABILITIES,
    capacity,
    create_sandbox,
    register,
    schedule_request,
    token,
)

PROOF = {"stopped": "yes"}


def version_of(app: SchedulerApplication, stream: UUID) -> int:
    return max(event.originator_version for event in app.events.get(stream))


def append(app: SchedulerApplication, event_class: Any, stream: UUID, **fields: Any) -> int:
    """Append one event through the recorder, bypassing the aggregates; its position."""
    event = event_class(
        originator_id=stream,
        originator_version=version_of(app, stream) + 1,
        timestamp=fields.pop("timestamp"),
        **fields,
    )
    app.events.put([event])
    return app.head_position()


def fenced_event(app: SchedulerApplication, sandbox_id: str) -> Any:
    return next(
        e for e in app.events.get(sandbox_uuid(sandbox_id))
        if isinstance(e, Sandbox.AssignmentFenced)
    )  # fmt: skip


@pytest.fixture
def history(app: SchedulerApplication, clock: Clock) -> SchedulerApplication:
    """A clean history: r1 with room for 2, s1 scheduled and running, s2 created."""
    register(app, "r1", at=clock(), allocatable=capacity(instances=2))
    create_sandbox(app, "s1")
    create_sandbox(app, "s2")
    request = schedule_request("s1", clock(), fencing_token=b"\x01" * 32)
    app.schedule(request)
    app.mark_running("s1", 1, request.fencing_token)
    report = verify(app)
    assert report.ok, report.violations
    return app


def only(app: SchedulerApplication, position: int, rule: str) -> None:
    report = verify(app)
    assert report.violations, "the broken history was not caught"
    found = [(v.position, v.rule) for v in report.violations]
    assert (position, rule) in found, found


def test_invariant_1_reserved_above_allocatable(
    history: SchedulerApplication, clock: Clock
) -> None:
    position = append(
        history, Runner.AllocatableChanged, runner_uuid("r1"), timestamp=clock(),
        allocatable=capacity(instances=0).as_dict(),
    )  # fmt: skip
    only(history, position, "invariant-1")
    violation = verify(history).violations[0]
    assert violation.event == "Runner.AllocatableChanged"
    assert violation.aggregate.startswith("Runner ")


def test_invariant_2_reservation_without_assignment(
    history: SchedulerApplication, clock: Clock
) -> None:
    position = append(
        history, Runner.CapacityReserved, runner_uuid("r1"), timestamp=clock(),
        reservation="ghost#1", assignment_id="ghost", sandbox_id="ghost", generation=1,
        capacity=capacity(instances=1, vcpu_count=0, memory_bytes=0, disk_bytes=0,
                          operations=0).as_dict(),
    )  # fmt: skip
    only(history, position, "invariant-2")


def test_invariant_2_fence_without_reservation(history: SchedulerApplication, clock: Clock) -> None:
    original = fenced_event(history, "s1")
    assignment = {**original.assignment, "generation": 1, "sandbox_id": "s2",
                  "fencing_token": token().hex()}  # fmt: skip
    fenced = append(
        history, Sandbox.AssignmentFenced, sandbox_uuid("s2"), timestamp=clock(),
        assignment=assignment, placement=original.placement,
    )  # fmt: skip
    after = append(history, Runner.DrainStarted, runner_uuid("r1"), timestamp=clock())
    report = verify(history)
    assert (after, "invariant-2") in [(v.position, v.rule) for v in report.violations]
    assert fenced < after


def test_invariant_3_second_assignment_and_reused_token(
    history: SchedulerApplication, clock: Clock
) -> None:
    original = fenced_event(history, "s1")
    position = append(
        history, Sandbox.AssignmentFenced, sandbox_uuid("s1"), timestamp=clock(),
        assignment=original.assignment, placement=original.placement,
    )  # fmt: skip
    report = verify(history)
    details = [v.detail for v in report.violations if v.position == position]
    assert any("second assignment" in d for d in details)
    assert any("token reused" in d for d in details)
    assert {v.rule for v in report.violations if v.position == position} >= {"invariant-3"}


def test_invariant_4_incompatible_evidence(history: SchedulerApplication, clock: Clock) -> None:
    original = fenced_event(history, "s1")
    stale_runner = {
        **original.placement["runner"],
        "last_heartbeat_at": (clock() - timedelta(hours=1)).isoformat(),
    }
    assignment = {**original.assignment, "sandbox_id": "s2", "fencing_token": token().hex()}
    position = append(
        history, Sandbox.AssignmentFenced, sandbox_uuid("s2"), timestamp=clock(),
        assignment=assignment, placement={**original.placement, "runner": stale_runner},
    )  # fmt: skip
    report = verify(history)
    rules = [(v.position, v.rule, v.detail) for v in report.violations]
    assert any(p == position and r == "invariant-4" and "last heartbeat" in d for p, r, d in rules)


def test_invariant_4_non_home_runner(history: SchedulerApplication, clock: Clock) -> None:
    register(history, "r2", at=clock())
    original = fenced_event(history, "s1")
    assignment = {**original.assignment, "sandbox_id": "s2", "runner_id": "r2",
                  "fencing_token": token().hex()}  # fmt: skip
    position = append(
        history, Sandbox.AssignmentFenced, sandbox_uuid("s2"), timestamp=clock(),
        assignment=assignment, placement=original.placement,
    )  # fmt: skip
    report = verify(history)
    assert any(
        v.position == position and v.rule == "invariant-4" and "home runner" in v.detail
        for v in report.violations
    )


def test_invariant_5_reservation_on_a_draining_runner(
    history: SchedulerApplication, clock: Clock
) -> None:
    history.start_drain("r1")
    position = append(
        history, Runner.CapacityReserved, runner_uuid("r1"), timestamp=clock(),
        reservation="s2#1", assignment_id="a", sandbox_id="s2", generation=1,
        capacity=fenced_event(history, "s1").assignment["capacity"],
    )  # fmt: skip
    only(history, position, "invariant-5")


def test_invariant_6_capacity_released_twice(history: SchedulerApplication, clock: Clock) -> None:
    history.release("s1", 1, b"\x01" * 32, PROOF)
    capacity_of = fenced_event(history, "s1").assignment["capacity"]
    position = append(
        history, Runner.CapacityReleased, runner_uuid("r1"), timestamp=clock(),
        reservation="s1#1", assignment_id="x", capacity=capacity_of, release_proof=PROOF,
    )  # fmt: skip
    only(history, position, "invariant-6")


def test_invariant_6_release_without_proof(history: SchedulerApplication, clock: Clock) -> None:
    position = append(
        history, Sandbox.AssignmentReleased, sandbox_uuid("s1"), timestamp=clock(),
        generation=1, release_proof={},
    )  # fmt: skip
    only(history, position, "invariant-6")


def test_verify_until_a_position_stops_before_the_break(
    history: SchedulerApplication, clock: Clock
) -> None:
    clean_head = history.head_position()
    append(
        history, Runner.AllocatableChanged, runner_uuid("r1"), timestamp=clock(),
        allocatable=capacity(instances=0).as_dict(),
    )  # fmt: skip
    assert not verify(history).ok
    assert verify(history, until=clean_head).ok
    assert verify(history, until=clean_head).events == clean_head


def test_verify_until_a_time_stops_at_the_first_later_event(
    history: SchedulerApplication, clock: Clock
) -> None:
    clean_head = history.head_position()
    moment = clock.advance(seconds=1)
    append(
        history, Runner.AllocatableChanged, runner_uuid("r1"), timestamp=moment,
        allocatable=capacity(instances=0).as_dict(),
    )  # fmt: skip
    history.start_drain("r1")
    report = verify(history, until=moment - timedelta(microseconds=1))
    assert report.ok
    assert report.position == clean_head
    assert not verify(history, until=moment).ok
    assert not [t for t in threading.enumerate() if t.name.startswith("read-ahead")]


def test_state_at_a_position(history: SchedulerApplication, clock: Clock) -> None:
    before_release = history.head_position()
    history.release("s1", 1, b"\x01" * 32, PROOF)
    then = state_at(history, before_release)
    assert [r.id for r in then.runners] == ["r1"]
    assert then.runners[0].reserved.instances == 1
    assert [a.state for a in then.assignments] == ["running"]
    now = state_at(history, None)
    assert now.runners[0].reserved.instances == 0
    assert [a.state for a in now.assignments] == ["released"]
    assert now.assignments[0] == history.get_assignment("s1")


def test_timeline_of_a_sandbox_and_a_runner(history: SchedulerApplication) -> None:
    sandbox = [entry.event for entry in timeline(history, sandbox_id="s1")]
    assert sandbox == ["Sandbox.Created", "Sandbox.AssignmentFenced", "Sandbox.AssignmentRunning"]
    runner = [entry.event for entry in timeline(history, runner_id="r1")]
    assert runner[:2] == ["Runner.Registered", "RunnerLease.Opened"]
    assert "Runner.CapacityReserved" in runner


def test_explain_names_every_reason(app: SchedulerApplication, clock: Clock) -> None:
    """One compatible runner, and one runner failing each rule (pool aside: invisible)."""
    base: dict[str, Any] = {"at": clock()}
    register(app, "ok", **base)
    register(app, "arch", architecture="aarch64", **base)
    register(app, "drain", **base)
    app.start_drain("drain")
    register(app, "stale", heartbeat=False, **base)
    register(app, "backend", capabilities=tuple(c for c in CAPABILITIES if c != "compute"), **base)
    register(app, "guest", guest_protocol_minimum=3, guest_protocol_maximum=3, **base)
    register(app, "prereq", capabilities=tuple(c for c in CAPABILITIES if c != "cleanup"), **base)
    register(app, "cap", allocatable=capacity(instances=0, memory_bytes=1), **base)
    register(app, "egress", supported_egress_contexts=(), **base)
    register(app, "nomat", heartbeat=False, **base)
    app.record_heartbeat(runner_id="nomat", at=clock(), artifact_digests=["x"])
    register(app, "needs", **base)
    create_sandbox(app, "s1", egress_context="default", required_capabilities={"storage"})
    decisions = explain(app, "s1").decisions
    home = decisions[0]
    verdicts = {line.runner_id: line for line in home.candidates}
    assert verdicts["ok"].verdict in ("chosen", "compatible, ranked lower")
    expected = {
        "arch": "architecture", "drain": "draining", "stale": "heartbeat_stale",
        "backend": "backend", "guest": "guest_protocol", "prereq": "prerequisite",
        "cap": "capacity", "egress": "egress", "nomat": "materialization",
    }  # fmt: skip
    # A store with the read model excludes runners failing plain-column rules in SQL:
    # they have no line of their own, only counts per reason (docs/events.md 7.3).
    unlisted = home.detail.get("unlisted", {}).get("reasons", {})
    for runner_id, code in expected.items():
        line = verdicts.get(runner_id)
        if line is None:
            assert any(key.split(":")[0] == code for key in unlisted), runner_id
            continue
        assert line.verdict == "refused"
        assert code in [reason["code"] for reason in line.reasons], runner_id
    for runner_id in ("prereq", "egress", "nomat"):  # JSON-level rules: always evaluated
        assert runner_id in verdicts
    if "cap" in verdicts:
        cap_reason = next(r for r in verdicts["cap"].reasons if r["code"] == "capacity")
        assert cap_reason["shortfall"]["instances"] == 1
    else:
        assert unlisted["capacity:instances"] == 1
    assert home.summary.startswith("2/11 runners are available: ")
    assert "1 draining" in home.summary
    assert "1 insufficient memory_bytes" in home.summary


def test_explain_records_refusals_without_reserving(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock(), allocatable=capacity(instances=1))
    create_sandbox(app, "s1")
    create_sandbox(app, "s2")
    app.schedule(schedule_request("s1", clock()))
    with pytest.raises(HomeRunnerUnavailableError):
        app.schedule(schedule_request("s2", clock()))
    with pytest.raises(NoCompatibleRunnerError):
        create_sandbox(app, "s3", architecture="aarch64")
    refused = explain(app, "s2").decisions[-1]
    assert "refused" in refused.title
    assert refused.summary == "0/1 runners are available: 1 insufficient instances"
    assert refused.candidates[0].reasons[0]["shortfall"] == {"instances": 1}
    create_refused = explain(app, "s3").decisions[-1]
    assert "create_sandbox refused" in create_refused.title
    assert app.get_runner("r1").reserved.instances == 1
    assert verify(app).ok


def database_url(app: SchedulerApplication) -> str:
    """The --database-url of the application's store."""
    env = app.env
    if env.get("PERSISTENCE_MODULE") == "eventsourcing.sqlite":
        return f"sqlite:///{env.get('SQLITE_DBNAME')}"
    return (
        f"postgresql://{env.get('POSTGRES_USER')}:{env.get('POSTGRES_PASSWORD', '')}@"
        f"{env.get('POSTGRES_HOST')}:{env.get('POSTGRES_PORT')}/{env.get('POSTGRES_DBNAME')}"
        f"?schema={env.get('POSTGRES_SCHEMA')}"
    )


def test_cli_verify_exits_non_zero_on_a_violation(
    history: SchedulerApplication, clock: Clock, tmp_path: Any
) -> None:
    url = database_url(history)
    runner = CliRunner()
    clean = runner.invoke(cli, ["audit", "verify", "--database-url", url, "--json"])
    assert clean.exit_code == 0, clean.output
    append(
        history, Runner.AllocatableChanged, runner_uuid("r1"), timestamp=clock(),
        allocatable=capacity(instances=0).as_dict(),
    )  # fmt: skip
    broken = runner.invoke(cli, ["audit", "verify", "--database-url", url])
    assert broken.exit_code == 1
    assert "invariant-1" in broken.output


def test_cli_explain_takes_the_sandbox_as_an_option_or_as_before_an_argument(
    history: SchedulerApplication,
) -> None:
    url = database_url(history)
    runner = CliRunner()

    def explained(*args: str) -> Any:
        result = runner.invoke(cli, ["audit", "explain", *args, "--database-url", url, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    documented = explained("--sandbox", "s1")
    assert documented["decisions"]
    assert explained("s1") == documented
    assert explained("s1", "--sandbox", "s1") == documented
    generation = explained("--sandbox", "s1", "--generation", "1")
    assert explained("s1", "--generation", "1") == generation
    for args in (["s2", "--sandbox", "s1"], []):
        refused = runner.invoke(cli, ["audit", "explain", *args, "--database-url", url])
        assert refused.exit_code == 2
        assert "--sandbox" in refused.output


def test_a_clean_history_from_simulate_verifies(postgres_schema: Any, tmp_path: Any) -> None:
    """Both stores: a simulated history (placements, refusals, drains, stale heartbeats,
    reconciliation, manual releases) has zero violations."""
    from secondbox_scheduler.infrastructure.tools.simulation import SimulationConfig, run_simulation

    for url in (f"sqlite:///{tmp_path}/sim.db", postgres_schema.url()):
        result = run_simulation(SimulationConfig(database_url=url, runners=9, sandboxes=25))
        assert result.placements > 0
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
        try:
            report = verify(app)
            assert report.ok, [str(v) for v in report.violations]
            assert report.events == app.event_count()
        finally:
            app.close()
