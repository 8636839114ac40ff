"""Builders of valid runners, requirements and schedule requests for tests."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from typing import Any

from secondbox_scheduler.domain import (
    Capacity,
    MaterializationSnapshot,
    Requirements,
    ScheduleRequest,
)
from secondbox_scheduler.infrastructure import SchedulerApplication

RUNTIME = "sha256:runtime"
TOOLCHAIN = "sha256:toolchain"
CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
_tokens = itertools.count(1)


def token() -> bytes:
    """A fresh 32-byte fencing token."""
    return next(_tokens).to_bytes(32, "big")


def capacity(**amounts: int) -> Capacity:
    base = {
        "vcpu_count": 8,
        "memory_bytes": 16 * 2**30,
        "disk_bytes": 100 * 2**30,
        "instances": 4,
        "operations": 16,
    }
    base.update(amounts)
    return Capacity(**base)


def requirements(**overrides: Any) -> Requirements:
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
        "requirements": requirements(),
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
    return app.create_sandbox(
        sandbox_id=sandbox_id,
        workspace_id=f"workspace-{sandbox_id}",
        profile_revision_id="profile-1",
        requirements=requirements(**requirement_overrides),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )


REFUSAL_TOPICS = {"RefusalLog.Opened", "RefusalLog.Refused"}


def topics_since(app: SchedulerApplication, position: int) -> list[str]:
    """``Class.Event`` names of the events recorded after notification ``position``."""
    return [
        notification.topic.rsplit(":", 1)[1]
        for notification in app.recorder.select_notifications(
            start=position, limit=10_000, inclusive_of_start=False
        )
    ]


def only_refusals_since(app: SchedulerApplication, position: int) -> bool:
    """True when nothing but refusal evidence was recorded after ``position``."""
    return set(topics_since(app, position)) <= REFUSAL_TOPICS
