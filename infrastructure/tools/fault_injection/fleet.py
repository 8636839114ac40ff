"""The fleet a fault-injection run works on, and the shapes its setup and its workers share.

Most sandboxes are homed on two hot-spot runners (the ones with the most free
instances, so ranked first); every sandbox asks for the same :func:`requirements`.

Profile ``standard``: the runners have room to spare on every dimension but
``instances``. Profile ``adversarial``: a request asks for a different amount on each
of the five dimensions and every runner has room for exactly a whole number of requests
on every one of them, so all five run out together; the last runner has
``physical-storage-admission`` and less disk than one request (disk is not checked
there).
"""

from __future__ import annotations

from datetime import timedelta

from secondbox_scheduler.domain.values import Capacity, Requirements
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.fault_injection.config import FaultRunConfig

CAPABILITIES = ["compute", "network-policy", "storage", "cleanup", "local-workspace",
                "client-selected-image"]  # fmt: skip
HEARTBEAT_TIMEOUT = timedelta(minutes=10)


ADVERSARIAL_REQUEST = Capacity(
    vcpu_count=2, memory_bytes=3 * 2**20, disk_bytes=5 * 2**20, instances=1, operations=3
)
PHYSICAL_STORAGE = "physical-storage-admission"


def requirements(pool: str, profile: str = "standard") -> Requirements:
    return Requirements(
        pool_name=pool,
        architecture="x86_64",
        capacity=(
            ADVERSARIAL_REQUEST
            if profile == "adversarial"
            else Capacity(vcpu_count=1, memory_bytes=1, disk_bytes=1, instances=1, operations=1)
        ),
        guest_protocol_generation=1,
        required_capabilities={"client-selected-image"},
        # exactly [runtime, toolchain] digests, also when the client selects the image
        preferred_artifact_digests=("sha256:verify-runtime", "sha256:verify-image"),
    )


def allocatable(index: int, runners: int, profile: str) -> tuple[Capacity, list[str]]:
    """Runner ``index``'s allocatable and capabilities under ``profile``."""
    hot = index < 2  # the hot spots: most free instances, so ranked first
    if profile != "adversarial":
        roomy = Capacity(vcpu_count=10**6, memory_bytes=10**6, disk_bytes=10**6,
                         instances=40 if hot else 8, operations=10**6)  # fmt: skip
        return roomy, CAPABILITIES
    slots = 6 if hot else 3
    amounts = {dim: amount * slots for dim, amount in ADVERSARIAL_REQUEST.as_dict().items()}
    if index == runners - 1:
        amounts["disk_bytes"] = ADVERSARIAL_REQUEST.disk_bytes - 1
        return Capacity(**amounts), [*CAPABILITIES, PHYSICAL_STORAGE]
    return Capacity(**amounts), CAPABILITIES


def setup_fleet(app: SchedulerApplication, config: FaultRunConfig) -> tuple[list[str], list[str]]:
    runners = [f"runner-{i:02d}" for i in range(config.runners)]
    for index, runner_id in enumerate(runners):
        room, capabilities = allocatable(index, len(runners), config.profile)
        app.register_runner(
            runner_id=runner_id, pool_name="verify", backend_kind="firecracker",
            architecture="x86_64", capabilities=capabilities, allocatable=room,
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )  # fmt: skip
        app.record_heartbeat(runner_id=runner_id, at=app.now())
    sandboxes = [f"sbx-{i:04d}" for i in range(config.sandboxes)]
    if config.profile != "adversarial":
        for sandbox_id in sandboxes:
            create(app, sandbox_id, config.profile)
        return runners, sandboxes
    # Adversarial: homes spread over every runner (three times as many on the hot spots),
    # so that each runner, the one without disk checks too, fills up: each runner's
    # sandboxes are created while it is the only active one.
    cycle = [index for index in range(len(runners)) for _ in range(3 if index < 2 else 1)]
    for target, runner_id in enumerate(runners):
        for other in runners:
            (app.cancel_drain if other == runner_id else app.start_drain)(other)
        for number, sandbox_id in enumerate(sandboxes):
            if cycle[number % len(cycle)] == target:
                create(app, sandbox_id, config.profile)
    for runner_id in runners:
        app.cancel_drain(runner_id)
    return runners, sandboxes


def create(app: SchedulerApplication, sandbox_id: str, profile: str) -> None:
    app.create_sandbox(
        sandbox_id=sandbox_id, workspace_id=f"ws-{sandbox_id}",
        profile_revision_id="verify-profile", requirements=requirements("verify", profile),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )  # fmt: skip
