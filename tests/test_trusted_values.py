"""The placement path's shortcuts build exactly what the long way builds: trusted
snapshots and capacities as ``model_construct`` would (same fields, same order, so the
same records in events), and a request's requirements record as ``to_record``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.assignment import to_durable_assignment
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.runner import Runner, runner_snapshot
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.factories import create_sandbox, register, schedule_request

AT = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def _runner() -> tuple[Runner, RunnerLease]:
    runner = Runner.register(
        runner_id="r1",
        pool_name="p",
        backend_kind="vm",
        architecture="arm64",
        capabilities=["storage", "compute"],
        allocatable=Capacity(vcpu_count=8, memory_bytes=1 << 30, instances=4),
        guest_protocol_minimum=1,
        guest_protocol_maximum=3,
        supported_egress_contexts=["b", "a"],
        at=AT,
    )
    runner.reserve(
        assignment_id="a1",
        sandbox_id="s1",
        generation=1,
        capacity=Capacity(vcpu_count=2, instances=1),
        at=AT,
    )
    lease = RunnerLease.open("r1", AT)
    lease.observe(
        at=AT,
        artifact_digests=["d1", "d2"],
        materializations=[
            MaterializationSnapshot(
                backend_kind="vm", architecture="arm64", runtime_digest="x", digest="y"
            )
        ],
        renewal_interval=timedelta(seconds=5),
        recorded_at=AT,
    )
    return runner, lease


def _same(built: Any, expected: Any) -> None:
    assert type(built) is type(expected)
    assert built == expected
    assert list(vars(built)) == list(vars(expected))  # the order a dump follows
    # python mode: a fencing token is bytes that need not be UTF-8 (JSON mode would decode it)
    assert built.model_dump() == expected.model_dump()
    assert list(built.model_dump()) == list(expected.model_dump())
    assert built.model_fields_set == expected.model_fields_set
    assert built.__pydantic_extra__ == expected.__pydantic_extra__
    assert built.__pydantic_private__ == expected.__pydantic_private__


def test_a_runner_snapshot_is_what_model_construct_builds() -> None:
    runner, lease = _runner()
    for with_lease in (lease, None):
        built = runner_snapshot(runner, with_lease)
        fields = {name: getattr(built, name) for name in reversed(RunnerSnapshot.model_fields)}
        _same(built, RunnerSnapshot.model_construct(**fields))
        assert built.free() == RunnerSnapshot.model_construct(**fields).free()


def test_capacity_of_is_what_model_construct_builds() -> None:
    for amounts in ({}, {"instances": 3}, {"operations": 1, "vcpu_count": 2, "disk_bytes": 5}):
        values: dict[str, Any] = {dim: int(amounts.get(dim, 0)) for dim in Capacity.DIMENSIONS}
        expected = Capacity.model_construct(**values)
        _same(Capacity.of(amounts), expected)


def test_a_requirements_record_parses_back_to_the_value_it_was_dumped_from() -> None:
    """What ``Sandbox.fence`` relies on to use the request's requirements once
    ``check_pinned`` found their record equal to the pinned one (instead of parsing the
    pinned record again): equal records, equal values."""
    for requirements in (
        Requirements(
            pool_name="p", architecture="arm64", required_capabilities=frozenset({"b", "a"}),
            capacity=Capacity(instances=1), guest_protocol_generation=2,
            preferred_artifact_digests=("r", "t"),
        ),
        Requirements(
            pool_name="q", architecture="amd64", capacity=Capacity(vcpu_count=3),
            guest_protocol_generation=1,
        ),
    ):  # fmt: skip
        assert Requirements.from_record(requirements.to_record()) == requirements


def test_a_durable_assignment_is_built_as_model_construct_builds_it() -> None:
    """From a placement's record (every field: the shortcut) and from a record missing
    one (model_construct itself): the same value, field order and fields set."""
    app = SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"}, now=lambda: AT)
    register(app, "r1", at=AT)
    create_sandbox(app, "s1")
    # not UTF-8 on purpose: the token a long test process draws is not either
    app.schedule(schedule_request("s1", AT, fencing_token=bytes(range(0xE0, 0x100))))
    sandbox = app.load(sandbox_uuid("s1"), Sandbox)
    assert sandbox is not None
    record = sandbox.current
    assert record is not None
    built = to_durable_assignment(record)
    fields: dict[str, Any] = dict(record)
    fields["fencing_token"] = bytes.fromhex(record["fencing_token"])
    fields["capacity"] = Capacity.of(record["capacity"])
    for name in ("capability_snapshot", "resolved_artifacts", "release_proof"):
        fields[name] = dict(record[name])
    expected = DurableAssignment.model_construct(**fields)
    _same(built, expected)
    assert built.model_fields_set == expected.model_fields_set
    assert built.model_dump(round_trip=True) == expected.model_dump(round_trip=True)
    assert type(vars(built)["capacity"]) is Capacity
