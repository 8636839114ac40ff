"""docs/spec.md (section 6a): the application's clock is the authority on time.

A heartbeat from the future cannot keep a silent runner fresh, and a caller-chosen
``ScheduleRequest.now`` cannot get past the staleness rule: times outside the clock
plus or minus the tolerance are refused with ``InvalidRequestError`` and write nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from secondbox_scheduler.domain import (
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
)
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.ids import lease_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, schedule_request

TOLERANCE = timedelta(seconds=5)  # the documented default


def test_a_heartbeat_from_the_future_is_refused_and_writes_nothing(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    before = app.event_count()
    with pytest.raises(InvalidRequestError) as refused:
        app.record_heartbeat(runner_id="r1", at=datetime(9999, 12, 31, tzinfo=UTC))
    assert refused.value.field == "at"
    assert "clock" in refused.value.rule
    assert app.event_count() == before
    # Ten years later, with no heartbeat since, the runner is stale: nothing picks it.
    clock.advance(days=3650)
    with pytest.raises(NoCompatibleRunnerError, match="heartbeat stale"):
        create_sandbox(app, "s1")


def test_a_heartbeat_within_the_tolerance_is_recorded(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    clock.advance(seconds=60)
    app.record_heartbeat(runner_id="r1", at=clock() + TOLERANCE)
    assert app.get_runner("r1").last_heartbeat_at == clock() + TOLERANCE
    with pytest.raises(InvalidRequestError):
        app.record_heartbeat(runner_id="r1", at=clock() + TOLERANCE + timedelta(seconds=1))


def test_a_request_dated_in_the_past_cannot_make_a_silent_runner_fresh(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    last_heartbeat = clock()
    clock.advance(hours=6)  # the runner has been silent for six hours (timeout 30 s)
    with pytest.raises(HomeRunnerUnavailableError, match="heartbeat"):
        app.schedule(schedule_request("s1", clock()))
    before = app.event_count()
    for now in (last_heartbeat + timedelta(seconds=5), datetime(1, 1, 1, tzinfo=UTC)):
        with pytest.raises(InvalidRequestError) as refused:
            app.schedule(schedule_request("s1", now))
        assert refused.value.field == "now"
    assert app.event_count() == before


@pytest.mark.parametrize("field", ["effect_started_at", "plan_ready_at"])
def test_the_times_a_request_orders_are_checked_against_the_clock(
    app: SchedulerApplication, clock: Clock, field: str
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    before = app.event_count()
    late = clock() + timedelta(hours=1)
    overrides = {field: late, "plan_ready_at": late}
    with pytest.raises(InvalidRequestError) as refused:
        app.schedule(schedule_request("s1", clock(), **overrides))
    assert refused.value.field == field
    assert app.event_count() == before
    # within the tolerance, both ways, a request is accepted
    assert app.schedule(schedule_request("s1", clock() - TOLERANCE))[1]


def test_the_tolerance_is_a_setting(store: Store, clock: Clock) -> None:
    app = store.open()
    wide = SchedulerApplication(
        env={**store.env, "SECONDBOX_CLOCK_TOLERANCE_SECONDS": "120"}, now=clock
    )
    store.opened.append(wide)
    register(app, "r1", at=clock())
    wide.record_heartbeat(runner_id="r1", at=clock() + timedelta(seconds=100))
    assert wide.get_runner("r1").last_heartbeat_at == clock() + timedelta(seconds=100)
    with pytest.raises(InvalidRequestError):
        app.record_heartbeat(runner_id="r1", at=clock() + timedelta(seconds=130))


@pytest.mark.parametrize("value", ["-1", "301", "soon", "nan", "inf"])
def test_a_bad_tolerance_setting_is_refused(store: Store, clock: Clock, value: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SchedulerApplication(env={**store.env, "SECONDBOX_CLOCK_TOLERANCE_SECONDS": value})
    assert refused.value.field == "SECONDBOX_CLOCK_TOLERANCE_SECONDS"


def test_audit_verify_reports_a_recorded_heartbeat_from_the_future(
    app: SchedulerApplication, clock: Clock
) -> None:
    """A history written by a scheduler without the clock check (or edited) is flagged."""
    register(app, "r1", at=clock())
    lease: RunnerLease = app.repository.get(lease_uuid("r1"))
    lease.observe(
        at=datetime(9999, 12, 31, tzinfo=UTC),
        artifact_digests=lease.artifact_digests,
        materializations=(),
        renewal_interval=timedelta(seconds=10),
        recorded_at=clock(),
    )
    app.save(lease)
    report = verify(app, measure_raw=False)
    assert [v.rule for v in report.violations] == ["clock"]
    assert report.violations[0].position == app.head_position()


def test_the_audit_fold_tolerates_a_heartbeat_as_early_as_the_largest_tolerance_allows(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    lease: RunnerLease = app.repository.get(lease_uuid("r1"))
    for skew in (AuditFold.MAX_CLOCK_SKEW, AuditFold.MAX_CLOCK_SKEW + timedelta(seconds=1)):
        lease.observe(
            at=clock() + skew,
            artifact_digests=lease.artifact_digests,
            materializations=(),
            renewal_interval=timedelta(0),
            recorded_at=clock(),
        )
    app.save(lease)
    report = verify(app, measure_raw=False)
    assert [(v.rule, v.position) for v in report.violations] == [("clock", app.head_position())]
