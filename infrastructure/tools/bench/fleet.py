"""Fleets, sandboxes and requests of ``secondbox-scheduler bench`` (setup, never timed).

Setup writes the same aggregates and events as the application's commands
(``Runner.register`` + ``RunnerLease.open`` as ``register_runner`` does, a heartbeat's
``RunnerLease.observe``, ``Sandbox.create``), but saves a few hundred of them per
transaction: the benchmark times placements and loads, not its own setup.

Sandboxes of the placement and contention runs are created with ``Sandbox.create``
over their designated home runner only (a real home decision, over one candidate), so
that homes can be spread over the fleet or concentrated on hot runners at will;
``create_sandbox`` would send every sandbox of an idle fleet to the same best-ranked
runner. ``create_sandbox`` itself is timed by the selection measurement.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication

T = TypeVar("T")

ARCHITECTURE = "x86_64"
BACKEND = "firecracker"
RUNTIME = "sha256:bench-runtime"
TOOLCHAIN = "sha256:bench-toolchain"
OTHER_DIGEST = "sha256:bench-other"
CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
PROFILE = "bench-profile-1"
HEARTBEAT_TIMEOUT = timedelta(hours=1)  # runners stay fresh for the whole run
RENEWAL = timedelta(seconds=10)
GIB = 2**30
SETUP_BATCH = 250  # aggregates per setup transaction

# What one sandbox asks for.
REQUESTED = Capacity(vcpu_count=1, memory_bytes=GIB, disk_bytes=GIB, instances=1, operations=1)


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def bench_requirements(pool_name: str) -> Requirements:
    return Requirements(
        pool_name=pool_name,
        architecture=ARCHITECTURE,
        required_capabilities=frozenset(),
        capacity=REQUESTED,
        guest_protocol_generation=2,
        preferred_artifact_digests=(RUNTIME, TOOLCHAIN),
    )


MATERIALIZATION = MaterializationSnapshot(
    backend_kind=BACKEND,
    architecture=ARCHITECTURE,
    runtime_digest=RUNTIME,
    toolchain_digest=TOOLCHAIN,
    digest="sha256:bench-materialized",
)


@dataclass(frozen=True)
class FleetRunner:
    """One runner to register: what it offers and the evidence of its first heartbeat."""

    runner_id: str
    pool_name: str
    allocatable: Capacity
    artifact_digests: tuple[str, ...] = (RUNTIME,)
    materialized: bool = True
    draining: bool = False


def roomy_fleet(pool_name: str, count: int, *, instances: int) -> list[FleetRunner]:
    """``count`` identical compatible runners with room for ``instances`` sandboxes each."""
    allocatable = Capacity(
        vcpu_count=instances,
        memory_bytes=instances * GIB,
        disk_bytes=instances * GIB,
        instances=instances,
        operations=instances,
    )
    return [
        FleetRunner(f"{pool_name}-{index:05d}", pool_name, allocatable) for index in range(count)
    ]


def varied_fleet(pool_name: str, count: int, rng: random.Random) -> list[FleetRunner]:
    """A pool of mixed runners: sizes, artifact locality, a few incompatible ones
    (no materialization, draining), so that selection has real work to do."""
    fleet = []
    for index in range(count):
        instances = rng.randint(4, 64)
        digests = rng.choice([(RUNTIME,), (RUNTIME, TOOLCHAIN), (OTHER_DIGEST,), ()])
        fleet.append(
            FleetRunner(
                runner_id=f"{pool_name}-{index:05d}",
                pool_name=pool_name,
                allocatable=Capacity(
                    vcpu_count=instances * 2,
                    memory_bytes=instances * 4 * GIB,
                    disk_bytes=instances * 20 * GIB,
                    instances=instances,
                    operations=instances * 4,
                ),
                artifact_digests=digests,
                materialized=rng.random() >= 0.05,
                draining=rng.random() < 0.04,
            )
        )
    return fleet


def _registered(spec: FleetRunner, at: datetime) -> tuple[Runner, RunnerLease]:
    runner = Runner.register(
        runner_id=spec.runner_id,
        pool_name=spec.pool_name,
        backend_kind=BACKEND,
        architecture=ARCHITECTURE,
        capabilities=CAPABILITIES,
        allocatable=spec.allocatable,
        guest_protocol_minimum=1,
        guest_protocol_maximum=3,
        supported_egress_contexts=("default",),
        at=at,
    )
    if spec.draining:
        runner.start_drain(at)
    lease = RunnerLease.open(spec.runner_id, at)
    lease.observe(
        at=at,
        artifact_digests=spec.artifact_digests,
        materializations=[MATERIALIZATION] if spec.materialized else [],
        renewal_interval=RENEWAL,
        recorded_at=at,
    )
    return runner, lease


def register_fleet(
    app: SchedulerApplication, fleet: Sequence[FleetRunner], at: datetime
) -> dict[str, RunnerSnapshot]:
    """Register every runner of ``fleet`` and record its heartbeat at ``at``."""
    snapshots: dict[str, RunnerSnapshot] = {}
    for part in chunks(fleet, SETUP_BATCH // 2):
        objs: list[Any] = []
        for spec in part:
            runner, lease = _registered(spec, at)
            snapshots[spec.runner_id] = runner.snapshot(lease)
            objs += [runner, lease]
        app.save(*objs)
    return snapshots


def runner_snapshots(fleet: Iterable[FleetRunner], at: datetime) -> list[RunnerSnapshot]:
    """The snapshots ``register_fleet`` would produce, in memory only."""
    snapshots = []
    for spec in fleet:
        runner, lease = _registered(spec, at)
        snapshots.append(runner.snapshot(lease))
    return snapshots


def create_homed_sandboxes(
    app: SchedulerApplication,
    homes: Sequence[tuple[str, RunnerSnapshot]],
    requirements: Requirements,
    at: datetime,
) -> None:
    """Create each ``(sandbox_id, home runner)`` with its home decided over that runner."""
    for part in chunks(homes, SETUP_BATCH):
        sandboxes = [
            Sandbox.create(
                sandbox_id=sandbox_id,
                workspace_id=f"ws-{sandbox_id}",
                profile_revision_id=PROFILE,
                requirements=requirements,
                runners=[home],
                now=at,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
            )
            for sandbox_id, home in part
        ]
        app.save(*sandboxes)


def fencing_token(seed: int, sandbox_id: str, generation: int = 1) -> bytes:
    return hashlib.sha256(f"{seed}:{sandbox_id}:{generation}".encode()).digest()


CLAIM_AHEAD = timedelta(minutes=5)
DEADLINE_AHEAD = timedelta(minutes=10)


def fresh_times(request: ScheduleRequest) -> ScheduleRequest:
    """``request`` with its times moved to now (no validation: a copy). The scheduler's
    clock refuses a request whose ``now`` is off by more than its tolerance
    (docs/spec.md, section 6a), so requests prepared before a run are brought up to date
    as they are sent."""
    at = datetime.now(UTC)
    return request.model_copy(
        update={
            "now": at,
            "effect_started_at": at,
            "plan_ready_at": at,
            "claim_expires_at": at + CLAIM_AHEAD,
            "operation_deadline": at + DEADLINE_AHEAD,
        }
    )


def schedule_request(
    sandbox_id: str,
    requirements: Requirements,
    now: datetime,
    *,
    seed: int,
    serialization_retry_limit: int,
) -> ScheduleRequest:
    """A valid request for generation 1 of a sandbox made by :func:`create_homed_sandboxes`."""
    return ScheduleRequest(
        assignment_id=f"assignment-{sandbox_id}-1",
        assignment_command_id=f"command-{sandbox_id}-1",
        instance_id=f"instance-{sandbox_id}",
        sandbox_id=sandbox_id,
        workspace_id=f"ws-{sandbox_id}",
        start_mutation_id=f"start-{sandbox_id}-1",
        profile_revision_id=PROFILE,
        requirements=requirements,
        assignment_command={"kind": "start"},
        fencing_token=fencing_token(seed, sandbox_id),
        resolved_artifacts={"runtime": RUNTIME, "toolchain": TOOLCHAIN},
        claim_expires_at=now + CLAIM_AHEAD,
        operation_deadline=now + DEADLINE_AHEAD,
        retry_limit=2,
        serialization_retry_limit=serialization_retry_limit,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        now=now,
        effect_started_at=now,
        plan_ready_at=now,
    )
