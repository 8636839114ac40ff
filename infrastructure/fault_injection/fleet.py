"""The fleet a fault-injection run works on, and the shapes its setup and its workers share.

Most sandboxes are homed on two hot-spot runners (the ones with the most free
instances, so ranked first); every sandbox asks for the same :func:`requirements`.
"""

from __future__ import annotations

from datetime import timedelta

from secondbox_scheduler.domain.values import Capacity, Requirements
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.fault_injection.config import FaultRunConfig

CAPABILITIES = ["compute", "network-policy", "storage", "cleanup", "local-workspace",
                "client-selected-image"]  # fmt: skip
HEARTBEAT_TIMEOUT = timedelta(minutes=10)


def requirements(pool: str) -> Requirements:
    return Requirements(
        pool_name=pool,
        architecture="x86_64",
        capacity=Capacity(vcpu_count=1, memory_bytes=1, disk_bytes=1, instances=1, operations=1),
        guest_protocol_generation=1,
        required_capabilities={"client-selected-image"},
        # exactly [runtime, toolchain] digests, also when the client selects the image
        preferred_artifact_digests=("sha256:verify-runtime", "sha256:verify-image"),
    )


def setup_fleet(app: SchedulerApplication, config: FaultRunConfig) -> tuple[list[str], list[str]]:
    runners = [f"runner-{i:02d}" for i in range(config.runners)]
    for index, runner_id in enumerate(runners):
        hot = index < 2  # the hot spots: most free instances, so ranked first
        app.register_runner(
            runner_id=runner_id, pool_name="verify", backend_kind="firecracker",
            architecture="x86_64", capabilities=CAPABILITIES,
            allocatable=Capacity(vcpu_count=10**6, memory_bytes=10**6, disk_bytes=10**6,
                                 instances=40 if hot else 8, operations=10**6),
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )  # fmt: skip
        app.record_heartbeat(runner_id=runner_id, at=app.now())
    sandboxes = [f"sbx-{i:04d}" for i in range(config.sandboxes)]
    for sandbox_id in sandboxes:
        app.create_sandbox(
            sandbox_id=sandbox_id, workspace_id=f"ws-{sandbox_id}",
            profile_revision_id="verify-profile", requirements=requirements("verify"),
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )  # fmt: skip
    return runners, sandboxes
