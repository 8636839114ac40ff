"""Reconciliation: policy, claims, the reconciler, and capacity under any command order."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain import ScheduleRequest, SchedulerError, StaleFenceError
from secondbox_scheduler.domain.assignment_history import assignment_history
from secondbox_scheduler.domain.errors import ReconcileClaimError
from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.reconcile import (
    ACTION_DEADLINE_EXCEEDED,
    ACTION_NONE,
    ACTION_UNCERTAIN,
    ReconcileDecision,
    decide_reconcile,
)
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.reconciler import Reconciler
from tests.conftest import Clock
from tests.factories import (
    HEARTBEAT_TIMEOUT,
    RUNTIME,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
    token,
)
from tests.test_projections import fresh_store

CLI = "secondbox_scheduler.infrastructure.cli"

PROOF = {"stopped": "yes"}
MINUTE = timedelta(minutes=1)


def scheduled(app: SchedulerApplication, clock: Clock, **overrides: Any) -> ScheduleRequest:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    request = schedule_request("s1", clock(), **overrides)
    app.schedule(request)
    return request


def beat(app: SchedulerApplication, clock: Clock, runner_id: str = "r1") -> None:
    app.record_heartbeat(
        runner_id=runner_id, at=clock(), artifact_digests=[RUNTIME],
        materializations=[materialization()],
    )  # fmt: skip


def reconciler(app: SchedulerApplication, owner: str = "rec-a") -> Reconciler:
    return Reconciler(
        app, owner, heartbeat_timeout=HEARTBEAT_TIMEOUT, claim_ttl=MINUTE, interval=10 * MINUTE
    )


def test_deadline_passed_while_assigned_redelivers_then_fails(
    app: SchedulerApplication, clock: Clock
) -> None:
    request = scheduled(app, clock, retry_limit=1, operation_deadline=clock() + MINUTE)
    clock.advance(minutes=2)
    beat(app, clock)
    worker = reconciler(app)
    assert worker.run_once() == (1, 1)
    redelivered = app.get_assignment("s1")
    assert redelivered is not None
    assert (redelivered.state, redelivered.retry_count) == ("assigned", 1)
    assert redelivered.failure_class == ACTION_DEADLINE_EXCEEDED
    assert redelivered.operation_deadline == clock() + MINUTE, "a fresh operation window"
    assert redelivered.next_reconcile_at == clock() + 10 * MINUTE
    assert redelivered.reconcile_owner == "", "the claim was released"
    assert app.get_runner("r1").reserved == request.requirements.capacity
    clock.advance(minutes=11)
    beat(app, clock)
    assert worker.run_once() == (1, 1)
    failed = app.get_assignment("s1")
    assert failed is not None
    assert (failed.state, failed.retry_count) == ("failed", 1)
    assert app.get_runner("r1").reserved == request.requirements.capacity, "kept until proof"
    assert worker.report.actions[ACTION_DEADLINE_EXCEEDED] == 2


def test_expired_home_heartbeat_makes_the_assignment_uncertain(
    app: SchedulerApplication, clock: Clock
) -> None:
    request = scheduled(app, clock, operation_deadline=clock() + 60 * MINUTE)
    app.mark_running("s1", 1, request.fencing_token)
    app.claim_reconcile("s1", 1, "rec-a", clock() + MINUTE)
    app.release_reconcile_claim("s1", 1, "rec-a")
    clock.advance(minutes=61)
    worker = reconciler(app)
    assert worker.run_once() == (1, 1)
    uncertain = app.get_assignment("s1")
    assert uncertain is not None
    assert uncertain.state == "uncertain"
    assert app.get_runner("r1").reserved == request.requirements.capacity
    app.mark_running("s1", 1, request.fencing_token)
    back = app.get_assignment("s1")
    assert back is not None
    assert back.state == "running", "the runner reported back"
    assert app.release("s1", 1, request.fencing_token, PROOF)
    assert app.get_runner("r1").reserved.instances == 0


def test_nothing_to_do_only_moves_next_reconcile(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock, operation_deadline=clock() + MINUTE)
    app.mark_running("s1", 1, request.fencing_token)
    clock.advance(minutes=2)
    beat(app, clock)
    worker = reconciler(app)
    assert worker.run_once() == (1, 1)
    assignment = app.get_assignment("s1")
    assert assignment is not None
    assert assignment.state == "running"
    assert assignment.next_reconcile_at == clock() + 10 * MINUTE
    assert worker.report.actions == {ACTION_NONE: 1}
    assert worker.run_once() == (0, 0), "not due again before next_reconcile_at"


def test_released_assignments_are_never_due(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock, operation_deadline=clock() + MINUTE)
    app.release("s1", 1, request.fencing_token, PROOF)
    clock.advance(minutes=5)
    assert reconciler(app).run_once() == (0, 0)


def test_a_result_commits_only_while_its_claim_is_current(
    app: SchedulerApplication, clock: Clock
) -> None:
    scheduled(app, clock, operation_deadline=clock() + MINUTE)
    clock.advance(minutes=2)
    decision = ReconcileDecision(ACTION_NONE, "test", clock() + MINUTE)
    before = app.event_count()
    with pytest.raises(ReconcileClaimError, match="nobody"):
        app.record_reconcile("s1", 1, "rec-a", decision)
    app.claim_reconcile("s1", 1, "rec-a", clock() + MINUTE)
    clock.advance(minutes=2)
    before = app.event_count()
    with pytest.raises(ReconcileClaimError):
        app.record_reconcile("s1", 1, "rec-a", decision)  # expired
    assert app.event_count() == before
    assert app.claim_reconcile("s1", 1, "rec-b", clock() + MINUTE), "taken over"
    with pytest.raises(ReconcileClaimError, match="rec-b"):
        app.record_reconcile("s1", 1, "rec-a", decision)
    assert app.event_count() == before + 1
    app.record_reconcile("s1", 1, "rec-b", decision)
    assert app.event_count() == before + 2


def test_a_claim_held_by_another_reconciler_is_skipped(
    app: SchedulerApplication, clock: Clock
) -> None:
    scheduled(app, clock, operation_deadline=clock() + MINUTE)
    clock.advance(minutes=2)
    beat(app, clock)
    assert app.claim_reconcile("s1", 1, "rec-b", clock() + MINUTE)
    worker = reconciler(app)
    assert worker.run_once() == (0, 0), "claimed assignments are not due"
    clock.advance(minutes=2)
    beat(app, clock)
    assert worker.run_once() == (1, 1), "an expired claim is taken over"


def test_policy_is_pure_and_total(clock: Clock) -> None:
    app_free = datetime(2026, 1, 1, tzinfo=UTC)
    from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot

    assignment = DurableAssignment(
        id="a", sandbox_id="s", state="running", operation_deadline=app_free,
        next_reconcile_at=app_free,
    )  # fmt: skip
    fresh = RunnerSnapshot(id="r", last_heartbeat_at=app_free)
    decide = decide_reconcile
    assert decide(assignment, fresh, app_free, MINUTE, MINUTE).action == ACTION_NONE
    assert decide(assignment, None, app_free, MINUTE, MINUTE).action == ACTION_UNCERTAIN
    late = app_free + 2 * MINUTE
    assert decide(assignment, fresh, late, MINUTE, MINUTE).action == ACTION_UNCERTAIN
    assigned = assignment.model_copy(update={"state": "assigned"})
    assert decide(assigned, fresh, late, MINUTE, MINUTE).action == ACTION_DEADLINE_EXCEEDED
    released = assignment.model_copy(update={"state": "released"})
    assert decide(released, None, late, MINUTE, MINUTE).next_reconcile_at is None


# -- capacity under any order of lifecycle commands -----------------------------------

COMMANDS = st.lists(
    st.tuples(
        st.sampled_from(["release", "release-other-proof", "fail", "fail-terminal", "running",
                         "claim", "unclaim", "advance", "schedule", "stale"]),
        st.integers(0, 2),
    ),
    max_size=30,
)  # fmt: skip


def reserved_sum_from_sandboxes(app: SchedulerApplication, sandboxes: list[str]) -> int:
    total = 0
    for sandbox_id in sandboxes:
        events = app.events.get(sandbox_uuid(sandbox_id))  # every generation, from the events
        for record in assignment_history(events).values():
            if record["state"] != "released":
                total += record["capacity"]["instances"]
    return total


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(commands=COMMANDS)
def test_capacity_is_returned_exactly_once_whatever_the_order(
    kind: str, commands: list[tuple[str, int]], request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("postgres_server") if kind == "postgres" else None
    with fresh_store(kind, server) as env:
        clock = Clock()
        app = SchedulerApplication(env=env, now=clock)
        try:
            register(app, "r1", at=clock(), allocatable=capacity(instances=3))
            sandboxes = ["s0", "s1", "s2"]
            tokens: dict[tuple[str, int], bytes] = {}
            for sandbox_id in sandboxes:
                create_sandbox(app, sandbox_id)
            releases: defaultdict[tuple[str, int], int] = defaultdict(int)
            for name, index in [("schedule", i) for i in range(3)] + commands:
                sandbox_id = sandboxes[index]
                current = app.get_assignment(sandbox_id)
                generation = current.generation if current else app_generation(app, sandbox_id)
                held = tokens.get((sandbox_id, generation), b"\1" * 32)
                try:
                    if name == "schedule":
                        fresh = token()
                        done, created = app.schedule(
                            schedule_request(
                                sandbox_id, clock(), fencing_token=fresh, retry_limit=1
                            )
                        )
                        if created:
                            tokens[(sandbox_id, done.generation)] = fresh
                    elif (
                        name == "release" and app.release(sandbox_id, generation, held, PROOF)
                    ) or (
                        name == "release-other-proof"
                        and app.release(sandbox_id, generation, held, {"other": "proof"})
                    ):
                        releases[(sandbox_id, generation)] += 1
                    elif name == "fail":
                        app.fail(sandbox_id, generation, held, "transport")
                    elif name == "fail-terminal":
                        app.fail(sandbox_id, generation, held, "authorization")
                    elif name == "running":
                        app.mark_running(sandbox_id, generation, held)
                    elif name == "claim":
                        app.claim_reconcile(sandbox_id, generation, "rec", clock() + MINUTE)
                    elif name == "unclaim":
                        app.release_reconcile_claim(sandbox_id, generation, "rec")
                    elif name == "advance":
                        app.advance_generation(sandbox_id, generation)
                    elif name == "stale":
                        app.release(sandbox_id, max(1, generation - 1), b"\2" * 32, PROOF)
                except SchedulerError:
                    pass
                runner: object = app.repository.get(runner_uuid("r1"))
                assert isinstance(runner, Runner)
                assert runner.reserved["instances"] == reserved_sum_from_sandboxes(app, sandboxes)
                assert 0 <= runner.reserved["instances"] <= 3
                assert all(count == 1 for count in releases.values())
            released_events = [
                n for n in app.recorder.select_notifications(start=1, limit=10_000)
                if n.topic.endswith("Runner.CapacityReleased")
            ]  # fmt: skip
            assert len(released_events) == sum(releases.values())
        finally:
            app.close()


def app_generation(app: SchedulerApplication, sandbox_id: str) -> int:
    sandbox: object = app.repository.get(sandbox_uuid(sandbox_id))
    assert isinstance(sandbox, Sandbox)
    return sandbox.generation


def test_stale_generation_claims_are_refused(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock)
    app.release("s1", 1, request.fencing_token, PROOF)
    app.advance_generation("s1", 1)
    with pytest.raises(StaleFenceError):
        app.claim_reconcile("s1", 1, "rec", clock() + MINUTE)


# -- several reconciler processes on one PostgreSQL -------------------------------------


@pytest.mark.slow
def test_three_reconciler_processes_never_overlap_and_process_everything(
    postgres_schema: Any,
) -> None:
    url = postgres_schema.url()
    frozen = Clock(datetime.now(UTC))  # the setup happens at one instant, however long it takes
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=frozen)
    try:
        now = app.now()
        roomy = capacity(
            instances=200, vcpu_count=1000, memory_bytes=2**50, disk_bytes=2**50, operations=1000
        )
        for index in range(5):
            register(app, f"r{index}", at=now, allocatable=roomy)
        sandboxes = [f"s{i:03d}" for i in range(500)]
        for sandbox_id in sandboxes:
            create_sandbox(app, sandbox_id)
            app.schedule(
                schedule_request(
                    sandbox_id, now, operation_deadline=now, heartbeat_timeout=timedelta(hours=2)
                )
            )
        processes = [
            subprocess.Popen(
                [sys.executable, "-m", CLI, "reconcile", "--once",
                 "--owner", f"reconciler-{i}", "--database-url", url, "--batch", "25",
                 "--interval", "3600", "--claim-ttl", "60", "--heartbeat-timeout", "7200",
                 "--poll", "0.05", "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            for i in range(3)
        ]  # fmt: skip
        outputs = [process.communicate(timeout=300) for process in processes]
        assert all(process.returncode == 0 for process in processes), outputs
        claims: defaultdict[str, list[tuple[datetime, datetime, str]]] = defaultdict(list)
        for sandbox_id in sandboxes:
            events = list(app.events.get(sandbox_uuid(sandbox_id)))
            opened: dict[str, tuple[datetime, datetime]] = {}
            for event in events:
                if isinstance(event, Sandbox.ReconcileClaimed):
                    opened[event.owner] = (event.timestamp, event.until)
                elif isinstance(event, Sandbox.ReconcileClaimReleased):
                    start, until = opened.pop(event.owner)
                    claims[sandbox_id].append((start, min(until, event.timestamp), event.owner))
            for owner, (start, until) in opened.items():
                claims[sandbox_id].append((start, until, owner))
            spans = sorted(claims[sandbox_id])
            for (_, end, owner), (start, _, other) in itertools.pairwise(spans):
                assert owner == other or end <= start, f"{sandbox_id}: claims overlap"
            assignment = app.get_assignment(sandbox_id)
            assert assignment is not None
            assert assignment.failure_class == ACTION_DEADLINE_EXCEEDED, sandbox_id
            assert assignment.retry_count == 1, "processed exactly once"
        owners = {owner for spans in claims.values() for _, _, owner in spans}
        assert len(owners) >= 2, "the work was shared"
    finally:
        app.close()


def test_each_redelivery_gets_the_original_operation_window(
    app: SchedulerApplication, clock: Clock
) -> None:
    """Found by the simulation: the window must not grow with every redelivery."""
    scheduled(app, clock, retry_limit=3, operation_deadline=clock() + MINUTE)
    worker = reconciler(app)
    for _ in range(3):
        clock.advance(minutes=11)
        beat(app, clock)
        assert worker.run_once() == (1, 1)
        redelivered = app.get_assignment("s1")
        assert redelivered is not None
        assert redelivered.operation_deadline == clock() + MINUTE
