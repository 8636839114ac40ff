"""docs/spec.md (section 6a), times along the log: the clock readings the events record
do not go backwards along the log by more than the largest clock tolerance (rule
``time-order`` of ``audit verify``), and a caller's time before the scheduler's clock
minus the largest heartbeat timeout is refused.

The histories here are written through the application and then, behind its checks,
through ``app.save`` (as the application role can through the save functions, see
tests/test_red_team.py for that very path on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from secondbox_scheduler.domain import InvalidRequestError
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.limits import MAX_CLOCK_TOLERANCE, MAX_HEARTBEAT_TIMEOUT
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import fold
from secondbox_scheduler.infrastructure.audit.verify import verify
from tests.conftest import Clock
from tests.factories import RUNTIME, create_sandbox, materialization, register, schedule_request


@pytest.fixture
def sqlite(tmp_path: Path, clock: Clock) -> Iterator[SchedulerApplication]:
    env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "t.db")}
    app = SchedulerApplication(env=env, now=clock)
    try:
        yield app
    finally:
        app.close()


def _renewal(app: SchedulerApplication, runner_id: str, at: datetime, recorded: datetime) -> int:
    """A liveness renewal saved behind the clock checks; its position."""
    lease: RunnerLease = app.repository.get(lease_uuid(runner_id))
    lease.trigger_event(RunnerLease.LivenessRenewed, timestamp=recorded, at=at)
    app.save(lease)
    return app.head_position()


def _drain(app: SchedulerApplication, runner_id: str, at: datetime) -> int:
    runner: Runner = app.repository.get(runner_uuid(runner_id))
    runner.trigger_event(Runner.DrainStarted, timestamp=at)
    app.save(runner)
    return app.head_position()


def _time_order(app: SchedulerApplication) -> list[int]:
    report = verify(app, measure_raw=False)
    assert {v.rule for v in report.violations} <= {"time-order"}, report.violations
    return [v.position for v in report.violations]


def test_a_heartbeat_from_the_future_is_named_by_the_clock_and_by_the_log_going_on(
    sqlite: SchedulerApplication, clock: Clock
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    future = clock() + timedelta(days=365)
    planted = _renewal(app, "r1", future, future)
    # audit verify: later than the auditor's clock (the application's) + the tolerance
    report = verify(app, measure_raw=False)
    assert [(v.position, v.rule) for v in report.violations] == [(planted, "time-order")]
    assert "later than the auditor's clock" in report.violations[0].detail
    assert fold(app).violations == []  # the fold alone has no clock, and nothing follows
    clock.advance(minutes=10)
    assert app.record_heartbeat(runner_id="r1", at=clock()) == "stale"
    create_sandbox(app, "s1")  # the silent runner is still fresh, by the planted heartbeat
    app.schedule(schedule_request("s1", clock()))
    for violations in (verify(app, measure_raw=False).violations, fold(app).violations):
        assert [(v.position, v.rule) for v in violations] == [(planted, "time-order")]
        assert violations[0].aggregate == "RunnerLease r1"
        assert violations[0].event == "RunnerLease.LivenessRenewed"
    detail = fold(app).violations[0].detail
    assert f"later than the next event #{planted + 1} Sandbox.Created" in detail
    assert "365.0 days" in detail
    assert "from the future" in detail


def test_each_event_from_the_future_is_a_finding_of_its_own(
    sqlite: SchedulerApplication, clock: Clock
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    first = _renewal(app, "r1", clock(), clock() + timedelta(days=365))
    clock.advance(seconds=1)
    app.record_heartbeat(runner_id="r2", at=clock())
    second = _drain(app, "r2", clock() + timedelta(days=30))  # less far ahead than the first
    register(app, "r3", at=clock())
    assert _time_order(app) == [first, second]


def test_times_within_the_largest_tolerance_are_no_finding(
    sqlite: SchedulerApplication, clock: Clock
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    _drain(app, "r1", clock() + MAX_CLOCK_TOLERANCE)  # a writer's clock ahead, within it
    register(app, "r2", at=clock())
    assert _time_order(app) == []
    ahead = _drain(app, "r2", clock() + MAX_CLOCK_TOLERANCE + timedelta(seconds=1))
    register(app, "r3", at=clock())
    assert _time_order(app) == [ahead]


def test_a_request_dated_the_largest_tolerance_back_is_no_finding(
    tmp_path: Path, clock: Clock
) -> None:
    """A placement is stamped with its request's time, which may lie the configured
    tolerance (up to the largest) before the clock: its events follow an event recorded
    at the clock without a finding (the placement's own clock is what is ordered)."""
    env = {
        "PERSISTENCE_MODULE": "eventsourcing.sqlite",
        "SQLITE_DBNAME": str(tmp_path / "t.db"),
        "SECONDBOX_CLOCK_TOLERANCE_SECONDS": str(int(MAX_CLOCK_TOLERANCE.total_seconds())),
    }
    app = SchedulerApplication(env=env, now=clock)
    try:
        register(app, "r1", at=clock())
        create_sandbox(app, "s1")
        create_sandbox(app, "s2")
        clock.advance(seconds=10)
        app.record_heartbeat(
            runner_id="r1", at=clock(), artifact_digests=[RUNTIME],
            materializations=[materialization("x86_64")],
        )  # fmt: skip
        timeout = {"heartbeat_timeout": timedelta(minutes=10)}
        app.schedule(schedule_request("s1", clock() + MAX_CLOCK_TOLERANCE, **timeout))
        app.schedule(schedule_request("s2", clock() - MAX_CLOCK_TOLERANCE, **timeout))
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


def test_an_event_dated_in_the_past_is_named_when_the_log_goes_on_later(
    sqlite: SchedulerApplication, clock: Clock
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    clock.advance(hours=1)
    before = _renewal(app, "r1", clock(), clock())
    backdated = _drain(app, "r1", clock() - timedelta(hours=1))
    register(app, "r2", at=clock())
    for violations in (verify(app, measure_raw=False).violations, fold(app).violations):
        assert [(v.position, v.rule) for v in violations] == [(backdated, "time-order")]
        assert f"earlier than an event before it #{before} " in violations[0].detail
        assert "dated in the past" in violations[0].detail


def test_an_event_dated_in_the_past_at_the_end_of_the_log_is_named(
    sqlite: SchedulerApplication, clock: Clock
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    clock.advance(hours=1)
    _renewal(app, "r1", clock(), clock())
    backdated = _drain(app, "r1", clock() - timedelta(hours=1))
    assert _time_order(app) == [backdated]


# -- caller times before the clock - the largest heartbeat timeout ----------------------


@pytest.mark.parametrize("field", ["claim_expires_at", "operation_deadline"])
def test_a_request_time_long_before_the_clock_is_refused(
    sqlite: SchedulerApplication, clock: Clock, field: str
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    before = app.event_count()
    for value in (
        clock() - MAX_HEARTBEAT_TIMEOUT - timedelta(seconds=1),
        datetime(1, 1, 1, tzinfo=UTC),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            app.schedule(schedule_request("s1", clock(), **{field: value}))
        assert refused.value.field == field
        assert "largest heartbeat timeout" in refused.value.rule
    assert app.event_count() == before
    # as early as the clock - the largest heartbeat timeout is accepted
    earliest = clock() - MAX_HEARTBEAT_TIMEOUT
    assert app.schedule(schedule_request("s1", clock(), **{field: earliest}))[1]


@pytest.mark.parametrize("field", ["now", "effect_started_at", "plan_ready_at"])
def test_the_ordered_request_times_long_before_the_clock_are_refused(
    sqlite: SchedulerApplication, clock: Clock, field: str
) -> None:
    """Already refused: ``now`` within the clock +/- tolerance, and the others not before
    it (step 1's order)."""
    app = sqlite
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    old = clock() - MAX_HEARTBEAT_TIMEOUT - timedelta(seconds=1)
    with pytest.raises(InvalidRequestError):
        app.schedule(schedule_request("s1", clock(), **{field: old}))


def test_a_heartbeat_long_before_the_clock_is_refused(
    sqlite: SchedulerApplication, clock: Clock
) -> None:
    app = sqlite
    register(app, "r1", at=clock())
    with pytest.raises(InvalidRequestError) as refused:
        app.record_heartbeat(
            runner_id="r1", at=clock() - MAX_HEARTBEAT_TIMEOUT - timedelta(seconds=1)
        )
    assert refused.value.field == "at"
