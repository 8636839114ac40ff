"""Runner-side commands of docs/spec.md (section 5) on SQLite and PostgreSQL, refusals included."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    HomeRunnerUnavailableError,
    InvalidRequestError,
)
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    CapacityExceededError,
    ConflictError,
    RunnerNotFoundError,
)
from secondbox_scheduler.domain.lease import (
    OBSERVED_COALESCED,
    OBSERVED_EVIDENCE,
    OBSERVED_RENEWED,
    OBSERVED_STALE,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock, Store
from tests.factories import (
    CAPABILITIES,
    RUNTIME,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
    topics_since,
)


def test_register_runner_gives_its_snapshot(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock(), supported_egress_contexts=("default", "corp"))
    snapshot = app.get_runner("r1")
    assert snapshot.id == "r1"
    assert snapshot.pool_name == "pool-a"
    assert snapshot.capabilities == frozenset(CAPABILITIES)
    assert snapshot.allocatable == capacity()
    assert snapshot.reserved == Capacity()
    assert snapshot.drain_phase == DRAIN_PHASE_ACTIVE
    assert snapshot.last_heartbeat_at == clock()
    assert snapshot.artifact_digests == (RUNTIME,)
    assert snapshot.materializations == (materialization(),)
    assert snapshot.supported_egress_contexts == ("corp", "default")
    assert (snapshot.guest_protocol_minimum, snapshot.guest_protocol_maximum) == (1, 3)
    assert [r.id for r in app.runner_snapshots()] == ["r1"]
    assert app.runner_snapshots("pool-b") == []


def test_register_accepts_the_seed_capability_map(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock(), capabilities={"compute": True, "gpu": False, "storage": True})
    assert app.get_runner("r1").capabilities == frozenset({"compute", "storage"})


def test_the_identical_registration_again_is_a_no_op(
    app: SchedulerApplication, clock: Clock
) -> None:
    # as over HTTP (200, created: false): a runner agent retrying its registration after a
    # lost answer must not fail; nothing is written
    assert app.register_runner(**registration("r1")) is True
    before = app.event_count()
    assert app.register_runner(**registration("r1")) is False
    reordered = registration("r1", capabilities=sorted(CAPABILITIES, reverse=True))
    assert app.register_runner(**reordered) is False
    assert app.event_count() == before


@pytest.mark.parametrize(
    "override",
    [
        {"pool_name": "pool-b"},
        {"allocatable": capacity(instances=3)},
        {"capabilities": ["compute"]},
        {"guest_protocol_maximum": 2},
        {"supported_egress_contexts": ("default", "corp")},
    ],
)
def test_another_registration_of_a_taken_id_is_refused(
    app: SchedulerApplication, override: dict[str, Any]
) -> None:
    app.register_runner(**registration("r1"))
    before = app.event_count()
    with pytest.raises(AlreadyExistsError):
        app.register_runner(**registration("r1", **override))
    assert app.event_count() == before


def test_a_deregistered_runners_id_stays_taken(app: SchedulerApplication) -> None:
    app.register_runner(**registration("r1"))
    app.deregister_runner("r1")
    with pytest.raises(AlreadyExistsError):
        app.register_runner(**registration("r1"))


def test_a_changed_allocatable_is_no_longer_the_identical_registration(
    app: SchedulerApplication,
) -> None:
    app.register_runner(**registration("r1"))
    app.change_allocatable("r1", capacity(instances=3))
    with pytest.raises(AlreadyExistsError):
        app.register_runner(**registration("r1"))
    assert app.register_runner(**registration("r1", allocatable=capacity(instances=3))) is False


def registration(runner_id: str, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "runner_id": runner_id,
        "pool_name": "pool-a",
        "backend_kind": "firecracker",
        "architecture": "x86_64",
        "capabilities": CAPABILITIES,
        "allocatable": capacity(),
        "guest_protocol_minimum": 1,
        "guest_protocol_maximum": 3,
        "supported_egress_contexts": ("default",),
    }
    return {**fields, **overrides}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"runner_id": ""}, "runner_id"),
        ({"pool_name": ""}, "pool_name"),
        ({"architecture": ""}, "architecture"),
        ({"allocatable": {"vcpu_count": -1}}, "allocatable.vcpu_count"),
        ({"allocatable": {"vcpus": 1}}, "allocatable.vcpus"),
        ({"capabilities": "compute"}, "capabilities"),
        ({"guest_protocol_minimum": -1}, "guest_protocol_minimum"),
        ({"guest_protocol_minimum": 4, "guest_protocol_maximum": 3}, "guest_protocol_minimum"),
        ({"supported_egress_contexts": [1]}, "supported_egress_contexts.0"),
    ],
)
def test_register_refuses_bad_input_and_writes_nothing(
    app: SchedulerApplication, clock: Clock, override: dict[str, object], field: str
) -> None:
    fields = {"runner_id": "r1", **override}
    runner_id = str(fields.pop("runner_id"))
    with pytest.raises(InvalidRequestError) as raised:
        register(app, runner_id, at=clock(), heartbeat=False, **fields)
    assert raised.value.field == field
    assert app.event_count() == 0


def test_heartbeat_older_than_the_last_changes_nothing(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    before = app.event_count()
    outcome = app.record_heartbeat(
        runner_id="r1", at=clock() - timedelta(seconds=1), artifact_digests=["other"]
    )
    assert outcome == OBSERVED_STALE
    assert app.event_count() == before
    assert app.get_runner("r1").artifact_digests == (RUNTIME,)


def test_heartbeat_renewals_are_coalesced_within_the_renewal_interval(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    register(app, "r1", at=clock())
    evidence: dict[str, Any] = {
        "artifact_digests": [RUNTIME],
        "materializations": [materialization()],
    }
    before = app.event_count()
    start = clock()
    outcomes = []
    for s in (1, 2, 3, 9):
        clock.current = start + timedelta(seconds=s)
        outcomes.append(app.record_heartbeat(runner_id="r1", at=clock(), **evidence))
    assert outcomes == [OBSERVED_COALESCED] * 4
    assert app.event_count() == before
    renewed_at = clock.current = start + timedelta(seconds=10)
    assert app.record_heartbeat(runner_id="r1", at=renewed_at, **evidence) == OBSERVED_RENEWED
    assert app.event_count() == before + 1
    assert app.get_runner("r1").last_heartbeat_at == renewed_at


def test_heartbeat_evidence_changes_are_always_recorded(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    before = app.event_count()
    at = clock() + timedelta(seconds=1)
    outcome = app.record_heartbeat(runner_id="r1", at=at, artifact_digests=[RUNTIME, "extra"])
    assert outcome == OBSERVED_EVIDENCE
    assert app.event_count() == before + 1
    snapshot = app.get_runner("r1")
    assert snapshot.artifact_digests == (RUNTIME, "extra")
    assert snapshot.materializations == ()
    assert snapshot.last_heartbeat_at == at


def test_heartbeat_refusals(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock())
    with pytest.raises(InvalidRequestError) as raised:
        app.record_heartbeat(runner_id="r1", at=clock().replace(tzinfo=None))
    assert raised.value.field == "at"
    with pytest.raises(InvalidRequestError) as raised:
        app.record_heartbeat(runner_id="r1", at=clock(), materializations=[{"digest": 3}])  # type: ignore[dict-item]
    assert raised.value.field.startswith("materializations")
    with pytest.raises(RunnerNotFoundError):
        app.record_heartbeat(runner_id="nobody", at=clock())


def test_a_heartbeat_never_conflicts_with_a_placement(store: Store, clock: Clock) -> None:
    """Heartbeats write the lease stream only, so a racing placement never retries."""
    app, other = store.open(), store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    request = schedule_request("s1", clock(), serialization_retry_limit=0)
    real_save = app.save_in_order

    def save_after_a_heartbeat(*objs: object, **kwargs: object) -> object:
        clock.advance(seconds=1)
        other.record_heartbeat(runner_id="r1", at=clock(), artifact_digests=["new"])
        return real_save(*objs, **kwargs)  # type: ignore[arg-type]

    app.save_in_order = save_after_a_heartbeat  # type: ignore[method-assign,assignment]
    _assignment, created = app.schedule(request)
    assert created
    assert app.metrics.contention_retries == 0
    assert other.get_runner("r1").artifact_digests == ("new",)


def test_drain_refuses_new_placements_and_cancel_restores(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.start_drain("r1")
    assert app.get_runner("r1").drain_phase == DRAIN_PHASE_DRAINING
    before = app.head_position()
    app.start_drain("r1")
    assert app.head_position() == before, "a repeated drain writes nothing"
    with pytest.raises(HomeRunnerUnavailableError, match="draining"):
        app.schedule(schedule_request("s1", clock()))
    assert topics_since(app, before) == ["RefusalLog.Opened", "RefusalLog.Refused"]
    app.cancel_drain("r1")
    assert app.get_runner("r1").drain_phase == DRAIN_PHASE_ACTIVE
    _, created = app.schedule(schedule_request("s1", clock()))
    assert created


def test_change_allocatable_is_refused_below_reserved(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s1", clock()))
    before = app.event_count()
    with pytest.raises(CapacityExceededError):
        app.change_allocatable("r1", capacity(vcpu_count=1))
    assert app.event_count() == before
    app.change_allocatable("r1", capacity(vcpu_count=2))
    assert app.get_runner("r1").allocatable.vcpu_count == 2
    with pytest.raises(InvalidRequestError) as raised:
        app.change_allocatable("r1", {"vcpu_count": -2})
    assert raised.value.field == "allocatable.vcpu_count"


def test_physical_storage_admission_leaves_disk_unchecked(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(
        app,
        "r1",
        at=clock(),
        capabilities=(*CAPABILITIES, "physical-storage-admission"),
        allocatable=capacity(disk_bytes=0),
    )
    create_sandbox(app, "s1")
    _, created = app.schedule(schedule_request("s1", clock()))
    assert created
    assert app.get_runner("r1").reserved.disk_bytes > app.get_runner("r1").allocatable.disk_bytes


def test_deregister_is_refused_while_reserved(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    request = schedule_request("s1", clock())
    app.schedule(request)
    before = app.event_count()
    with pytest.raises(ConflictError, match="reservation"):
        app.deregister_runner("r1")
    assert app.event_count() == before
    app.release("s1", 1, request.fencing_token, {"stopped": "yes"})
    app.deregister_runner("r1")
    assert app.runner_snapshots() == []
    with pytest.raises(RunnerNotFoundError):
        app.get_runner("r1")
    app.advance_generation("s1", 1)
    with pytest.raises(HomeRunnerUnavailableError, match="not registered"):
        app.schedule(schedule_request("s1", clock()))


def test_commands_on_unknown_runners_are_refused(app: SchedulerApplication) -> None:
    for command in (app.start_drain, app.cancel_drain, app.deregister_runner):
        with pytest.raises(RunnerNotFoundError):
            command("nobody")
    with pytest.raises(RunnerNotFoundError):
        app.change_allocatable("nobody", capacity())
    with pytest.raises(InvalidRequestError):
        app.start_drain("")


def test_a_heartbeat_as_old_as_the_last_still_records_new_evidence(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    before = app.event_count()
    same_evidence = app.record_heartbeat(
        runner_id="r1", at=clock(), artifact_digests=[RUNTIME], materializations=[materialization()]
    )
    assert same_evidence == OBSERVED_COALESCED
    assert app.event_count() == before
    assert app.record_heartbeat(runner_id="r1", at=clock(), artifact_digests=["x"]) == (
        OBSERVED_EVIDENCE
    )
    assert app.get_runner("r1").artifact_digests == ("x",)
