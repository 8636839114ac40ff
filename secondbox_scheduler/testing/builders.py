"""Builders of valid runners, profiles and schedule requests, and a clock moved by hand.

Plain functions (no Hypothesis): what example tests, the strategies and the state
machine of this package share. Every builder returns something the scheduler accepts;
override any field to break exactly one thing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.values import (
    Capacity,
    MaterializationSnapshot,
    Requirements,
    ScheduleRequest,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RUNTIME = "sha256:runtime"
TOOLCHAIN = "sha256:toolchain"
CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
_tokens = itertools.count(1)


@dataclass
class Clock:
    """A clock the test moves by hand: pass it as ``SchedulerApplication(now=clock)``."""

    current: datetime = T0

    def __call__(self) -> datetime:
        return self.current

    def advance(self, **delta: float) -> datetime:
        self.current += timedelta(**delta)
        return self.current


def token() -> bytes:
    """A fresh 32-byte fencing token (never the same twice in one process)."""
    return next(_tokens).to_bytes(32, "big")


def capacity(**amounts: int) -> Capacity:
    """A runner's allocatable: room for four default profiles (override any dimension)."""
    base = {
        "vcpu_count": 8,
        "memory_bytes": 16 * 2**30,
        "disk_bytes": 100 * 2**30,
        "instances": 4,
        "operations": 16,
    }
    base.update(amounts)
    return Capacity(**base)


def profile(**overrides: Any) -> Requirements:
    """The default ProfileRevision's requirements (pool-a, x86_64, one instance)."""
    fields: dict[str, Any] = {
        "pool_name": "pool-a",
        "architecture": "x86_64",
        "required_capabilities": frozenset(),
        "capacity": Capacity(
            vcpu_count=2, memory_bytes=4 * 2**30, disk_bytes=10 * 2**30, instances=1, operations=1
        ),
        "guest_protocol_generation": 2,
        "preferred_artifact_digests": (RUNTIME, TOOLCHAIN),
    }
    fields.update(overrides)
    return Requirements(**fields)


def materialization(architecture: str = "x86_64") -> MaterializationSnapshot:
    return MaterializationSnapshot(
        backend_kind="firecracker",
        architecture=architecture,
        runtime_digest=RUNTIME,
        toolchain_digest=TOOLCHAIN,
        digest="sha256:materialized",
    )


def register(
    app: SchedulerApplication,
    runner_id: str,
    *,
    at: datetime,
    heartbeat: bool = True,
    **overrides: Any,
) -> None:
    """Register a fully compatible runner (override any field) and heartbeat it at ``at``."""
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
    fields.update(overrides)
    app.register_runner(**fields)
    if heartbeat:
        app.record_heartbeat(
            runner_id=runner_id,
            at=at,
            artifact_digests=[RUNTIME],
            materializations=[materialization(fields["architecture"])],
        )


def schedule_request(sandbox_id: str, now: datetime, /, **overrides: Any) -> ScheduleRequest:
    """A valid request for ``sandbox_id`` created with the default profile."""
    fields: dict[str, Any] = {
        "assignment_id": f"assignment-{sandbox_id}-{next(_tokens)}",
        "assignment_command_id": f"command-{sandbox_id}",
        "instance_id": f"instance-{sandbox_id}",
        "sandbox_id": sandbox_id,
        "workspace_id": f"workspace-{sandbox_id}",
        "start_mutation_id": f"start-{sandbox_id}",
        "profile_revision_id": "profile-1",
        "requirements": profile(),
        "assignment_command": {"kind": "start"},
        "fencing_token": token(),
        "resolved_artifacts": {"runtime": RUNTIME},
        "claim_expires_at": now + timedelta(minutes=5),
        "operation_deadline": now + timedelta(minutes=10),
        "retry_limit": 2,
        "serialization_retry_limit": 8,
        "heartbeat_timeout": HEARTBEAT_TIMEOUT,
        "now": now,
        "effect_started_at": now,
        "plan_ready_at": now,
    }
    fields.update(overrides)
    return ScheduleRequest(**fields)


def create_sandbox(app: SchedulerApplication, sandbox_id: str, **requirement_overrides: Any) -> str:
    """Create ``sandbox_id`` with the default profile (override any requirement)."""
    return app.create_sandbox(
        sandbox_id=sandbox_id,
        workspace_id=f"workspace-{sandbox_id}",
        profile_revision_id="profile-1",
        requirements=profile(**requirement_overrides),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
