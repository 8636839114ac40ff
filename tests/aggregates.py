"""In-memory aggregates for tests that drive the domain with nothing in front of it.

No application, no store: a runner, its lease and sandboxes built through their public
constructors and commands, and :class:`EventLog`, which collects their events in the
order an application would save them and can forge events the aggregates would refuse
(to feed the pure audit fold).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement.deciding import Placed, Refused, decide_placement
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
TIMEOUT = timedelta(seconds=30)
RUNTIME = "sha256:runtime"
TOOLCHAIN = "sha256:toolchain"
CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
PHYSICAL_STORAGE = "physical-storage-admission"
PROOF = {"stopped": "yes"}
# What every sandbox here asks for: a different amount on each dimension, so that a
# check that mixes two dimensions up is seen.
REQUEST = Capacity(vcpu_count=2, memory_bytes=3, disk_bytes=5, instances=1, operations=7)
_tokens = itertools.count(1)


def fresh_token() -> bytes:
    return next(_tokens).to_bytes(32, "big")


def slots(count: int, **extra: int) -> Capacity:
    """Room for exactly ``count`` REQUESTs on every dimension (plus ``extra`` units)."""
    amounts = {dim: amount * count for dim, amount in REQUEST.as_dict().items()}
    for dim, amount in extra.items():
        amounts[dim] += amount
    return Capacity(**amounts)


def one(dim: str, amount: int = 1) -> Capacity:
    """``amount`` on one dimension, zero on the others."""
    return Capacity(**{dim: amount})


def materialization() -> MaterializationSnapshot:
    return MaterializationSnapshot(
        backend_kind="firecracker",
        architecture="x86_64",
        runtime_digest=RUNTIME,
        toolchain_digest=TOOLCHAIN,
        digest="sha256:materialized",
    )


def new_runner(
    runner_id: str = "r1",
    *,
    allocatable: Capacity | None = None,
    capabilities: Iterable[str] = CAPABILITIES,
    at: datetime = T0,
) -> Runner:
    return Runner.register(
        runner_id=runner_id,
        pool_name="pool-a",
        backend_kind="firecracker",
        architecture="x86_64",
        capabilities=capabilities,
        allocatable=allocatable or slots(2),
        guest_protocol_minimum=1,
        guest_protocol_maximum=3,
        supported_egress_contexts=("default",),
        at=at,
    )


def new_lease(runner_id: str = "r1", at: datetime = T0) -> RunnerLease:
    lease = RunnerLease.open(runner_id, at)
    lease.observe(
        at=at,
        artifact_digests=[RUNTIME],
        materializations=[materialization()],
        renewal_interval=timedelta(seconds=10),
        recorded_at=at,
    )
    return lease


def requirements(**overrides: Any) -> Requirements:
    fields: dict[str, Any] = {
        "pool_name": "pool-a",
        "architecture": "x86_64",
        "capacity": REQUEST,
        "guest_protocol_generation": 2,
        "preferred_artifact_digests": (RUNTIME, TOOLCHAIN),
    }
    fields.update(overrides)
    return Requirements(**fields)


def new_sandbox(
    sandbox_id: str, runners: list[RunnerSnapshot], at: datetime = T0, **overrides: Any
) -> Sandbox:
    return Sandbox.create(
        sandbox_id=sandbox_id,
        workspace_id=f"workspace-{sandbox_id}",
        profile_revision_id="profile-1",
        requirements=requirements(**overrides),
        runners=runners,
        now=at,
        heartbeat_timeout=TIMEOUT,
    )


def request(sandbox_id: str, at: datetime = T0, **overrides: Any) -> ScheduleRequest:
    fields: dict[str, Any] = {
        "assignment_id": f"assignment-{sandbox_id}-{next(_tokens)}",
        "assignment_command_id": f"command-{sandbox_id}",
        "instance_id": f"instance-{sandbox_id}",
        "sandbox_id": sandbox_id,
        "workspace_id": f"workspace-{sandbox_id}",
        "start_mutation_id": f"start-{sandbox_id}",
        "profile_revision_id": "profile-1",
        "requirements": requirements(),
        "fencing_token": fresh_token(),
        "claim_expires_at": at + timedelta(minutes=5),
        "operation_deadline": at + timedelta(minutes=10),
        "retry_limit": 1,
        "serialization_retry_limit": 3,
        "heartbeat_timeout": TIMEOUT,
        "now": at,
        "effect_started_at": at,
        "plan_ready_at": at,
    }
    fields.update(overrides)
    return ScheduleRequest(**fields)


@dataclass(frozen=True)
class Placement:
    """A placement made on the aggregates: its request and the token's index stream (to
    save after the sandbox and the runner, as ``schedule`` does)."""

    request: ScheduleRequest
    token_use: FencingTokenUse


def place(
    sandbox: Sandbox, runner: Runner, lease: RunnerLease, at: datetime = T0, **overrides: Any
) -> Placement:
    """What ``schedule`` does: fence on the sandbox, reserve on the runner."""
    sandbox_id = sandbox.sandbox_id
    wanted = request(sandbox_id, at, **overrides)
    decided = decide_placement(wanted, sandbox, lambda _: (runner, lease), attempt=0, clock=at)
    if isinstance(decided, Refused):
        raise decided.error
    assert isinstance(decided, Placed), decided
    return Placement(wanted, decided.token)


def free(runner: Runner, lease: RunnerLease) -> dict[str, int]:
    return runner.snapshot(lease).free().as_dict()


def unchanged(aggregate: Aggregate) -> tuple[int, int]:
    """What must not move when a command is refused: version and pending events."""
    return aggregate.version, len(aggregate.pending_events)


@dataclass
class EventLog:
    """Events in log order (positions from 1), as one application would have saved them."""

    events: list[Any] = field(default_factory=list)

    def save(self, *aggregates: Aggregate) -> int:
        """Collect the aggregates' pending events in this order; the last position."""
        for aggregate in aggregates:
            self.events.extend(aggregate.collect_events())
        return len(self.events)

    def version(self, stream: UUID) -> int:
        return max(
            (event.originator_version for event in self.events if event.originator_id == stream),
            default=0,
        )

    def forge(self, event_class: type[Any], stream: UUID, **fields: Any) -> int:
        """Append an event the aggregates would refuse; its position."""
        fields.setdefault("timestamp", T0)
        self.events.append(
            event_class(originator_id=stream, originator_version=self.version(stream) + 1, **fields)
        )
        return len(self.events)

    def fold(self) -> AuditFold:
        audit = AuditFold()
        for position, event in enumerate(self.events, start=1):
            audit.apply(position, event)
        audit.finish()
        return audit

    def violations(self) -> list[Violation]:
        return self.fold().violations

    def found(self) -> list[tuple[int, str]]:
        return [(violation.position, violation.rule) for violation in self.violations()]
