"""How a sandbox's storage and load time grow with its generations (part of the
history section of ``secondbox-scheduler bench``).

For each size it drives one sandbox through that many generations (fence with its
token index and reservation, release, advance: the commands' own aggregates, saved
generation by generation so that snapshots are taken as in production) and reports:

- ``stored_bytes``: the sandbox's events and snapshots and its token index, as stored;
- ``latest_snapshot_bytes``: the size of its latest snapshot (flat if the state is);
- ``cold_ms``: loading it in a new application without a cache (snapshot and tail).

Release 0.1 kept every past assignment in the Sandbox's state: its snapshots grew with
the generations and the stored bytes quadratically; see docs/performance.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from secondbox_scheduler.domain.fencing_tokens import token_sha256
from secondbox_scheduler.domain.ids import fencing_token_uuid, sandbox_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement.deciding import Placed, decide_placement
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    MaterializationSnapshot,
    Requirements,
    ScheduleRequest,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.bench.timing import median_ms

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUNTIME, TOOLCHAIN = "sha256:bench-runtime", "sha256:bench-toolchain"
CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
ONE = Capacity(vcpu_count=1, memory_bytes=1, disk_bytes=1, instances=1, operations=1)
TIMEOUT = timedelta(days=1)


@dataclass(frozen=True)
class GenerationRow:
    generations: int
    sandbox_events: int
    stored_bytes: int
    latest_snapshot_bytes: int
    cold_ms: float
    bytes_per_generation: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _requirements() -> Requirements:
    return Requirements(
        pool_name="bench-generations",
        architecture="x86_64",
        capacity=ONE,
        guest_protocol_generation=1,
        preferred_artifact_digests=(RUNTIME, TOOLCHAIN),
    )


def build_generations(app: SchedulerApplication, stamp: str, generations: int) -> str:
    """A runner and a sandbox homed there, driven through ``generations`` generations."""
    runner_id, sandbox_id = f"gen-runner-{stamp}", f"gen-sandbox-{stamp}"
    runner = Runner.register(
        runner_id=runner_id, pool_name="bench-generations", backend_kind="firecracker",
        architecture="x86_64", capabilities=CAPABILITIES, allocatable=ONE,
        guest_protocol_minimum=1, guest_protocol_maximum=1, supported_egress_contexts=(), at=T0,
    )  # fmt: skip
    lease = RunnerLease.open(runner_id, T0)
    lease.observe(
        at=T0, artifact_digests=[RUNTIME],
        materializations=[MaterializationSnapshot(
            backend_kind="firecracker", architecture="x86_64", runtime_digest=RUNTIME,
            toolchain_digest=TOOLCHAIN, digest="sha256:bench-materialized",
        )],
        renewal_interval=timedelta(0), recorded_at=T0,
    )  # fmt: skip
    snapshot = runner.snapshot(lease)
    sandbox = Sandbox.create(
        sandbox_id=sandbox_id, workspace_id="w", profile_revision_id="p",
        requirements=_requirements(), runners=[snapshot], now=T0, heartbeat_timeout=TIMEOUT,
    )  # fmt: skip
    app.save(runner, lease, sandbox)
    for number in range(generations):
        at = T0 + timedelta(seconds=number)
        request = ScheduleRequest(
            assignment_id=f"a{number}", assignment_command_id="c", instance_id="i",
            sandbox_id=sandbox_id, workspace_id="w", start_mutation_id="m",
            profile_revision_id="p", requirements=_requirements(),
            fencing_token=number.to_bytes(32, "big"), claim_expires_at=at, operation_deadline=at,
            heartbeat_timeout=TIMEOUT, now=at, effect_started_at=at, plan_ready_at=at,
        )  # fmt: skip
        placed = decide_placement(request, sandbox, lambda _: (runner, lease), attempt=0, clock=at)
        assert isinstance(placed, Placed), placed
        app.save(*placed.aggregates)
        fence = request.fencing_token
        sandbox.release(sandbox.generation, fence, {"exit": "0"}, at)
        runner.release(
            sandbox_id=sandbox_id, generation=sandbox.generation, release_proof={"exit": "0"},
            at=at,
        )  # fmt: skip
        sandbox.advance_generation(sandbox.generation, at)
        app.save(sandbox, runner)
    return sandbox_id


def stored_bytes(app: SchedulerApplication, sandbox_id: str, generations: int) -> tuple[int, int]:
    """(bytes of the sandbox's events, snapshots and token index; latest snapshot's)."""
    stream = sandbox_uuid(sandbox_id)
    total = sum(len(e.state) for e in app.recorder.select_events(stream))
    latest = 0
    if app.snapshots is not None:
        snapshots = app.snapshots.recorder.select_events(stream)
        total += sum(len(s.state) for s in snapshots)
        latest = len(snapshots[-1].state) if snapshots else 0
    for number in range(generations):
        token = number.to_bytes(32, "big").hex()
        index = fencing_token_uuid(sandbox_id, token_sha256(token))
        total += sum(len(e.state) for e in app.recorder.select_events(index))
    return total, latest


def measure_generations(
    env: Mapping[str, str],
    sizes: Sequence[int] = (100, 1_000, 10_000),
    repeat: int = 7,
    progress: Callable[[str], None] = lambda _: None,
) -> list[GenerationRow]:
    writer = SchedulerApplication(env={**env, "SECONDBOX_READ_MODELS": "off"})
    stamp = time.strftime("%Y%m%d%H%M%S")
    rows = []
    try:
        for size in sizes:
            progress(f"driving a sandbox through {size:,} generations")
            sandbox_id = build_generations(writer, f"{stamp}-{size}", size)
            total, latest = stored_bytes(writer, sandbox_id, size)
            events = len(writer.recorder.select_events(sandbox_uuid(sandbox_id)))
            cold_app = SchedulerApplication(
                env={**env, "AGGREGATE_CACHE_MAXSIZE": "", "SECONDBOX_READ_MODELS": "off"}
            )
            try:
                cold = median_ms(partial(cold_app.repository.get, sandbox_uuid(sandbox_id)), repeat)
            finally:
                cold_app.close()
            rows.append(GenerationRow(size, events, total, latest, cold, total / size))
    finally:
        writer.close()
    return rows
