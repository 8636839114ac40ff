"""Hypothesis strategies for the scheduler's inputs, and histories of commands.

- :func:`runner_snapshots` and :func:`fleets`: runner views that fail each placement
  rule now and then (another pool, draining, a stale or missing heartbeat, a missing
  capability or materialization, a guest-protocol range that misses, short capacity on
  any dimension, an egress context it lacks), for properties of ``select_runner``;
- :func:`requirements` and :func:`capacities`: what a ProfileRevision asks for;
- :func:`histories` and :func:`run_history`: random sequences of every command of
  ``SchedulerApplication`` (refusals are part of a history), for properties of a whole
  store such as "the read models equal a rebuild".

All of them draw from small sets of values on purpose: ties, exact fits and boundaries
are what find bugs here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from hypothesis import strategies as st

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.testing.builders import (
    RUNTIME,
    T0,
    TOOLCHAIN,
    Clock,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
    token,
)

GIB = 2**30
POOL = "pool-a"
PREREQUISITES = ("network-policy", "storage", "cleanup", "local-workspace")
BASE_CAPABILITIES = frozenset({"compute", *PREREQUISITES, "snapshot-restore"})
RUNNER_IDS = tuple(f"runner-{n}" for n in range(8))


def _materialization(**overrides: str) -> MaterializationSnapshot:
    return materialization().model_copy(update=overrides)


def capacities(
    *,
    vcpu_count: Sequence[int] = (0, 1, 2),
    memory_bytes: Sequence[int] = (0, 4 * GIB),
    disk_bytes: Sequence[int] = (0, 10 * GIB),
    instances: Sequence[int] = (0, 1),
    operations: Sequence[int] = (0, 1),
) -> st.SearchStrategy[Capacity]:
    """Capacities drawn per dimension from the given values (a request, by default)."""
    return st.builds(
        Capacity,
        vcpu_count=st.sampled_from(vcpu_count),
        memory_bytes=st.sampled_from(memory_bytes),
        disk_bytes=st.sampled_from(disk_bytes),
        instances=st.sampled_from(instances),
        operations=st.sampled_from(operations),
    )


def requirements() -> st.SearchStrategy[Requirements]:
    """Requirements of pool-a/x86_64 needing ``snapshot-restore``; the capacity, egress
    context and guest-protocol generation (0 included, which nothing may take) vary."""
    return st.builds(
        Requirements,
        pool_name=st.just(POOL),
        architecture=st.just("x86_64"),
        required_capabilities=st.just(frozenset({"snapshot-restore"})),
        capacity=capacities(),
        guest_protocol_generation=st.integers(0, 3),
        preferred_artifact_digests=st.just((RUNTIME, TOOLCHAIN)),
        egress_context=st.sampled_from([None, "public", "private"]),
    )


@st.composite
def runner_snapshots(
    draw: st.DrawFn, runner_id: str | None = None, now: datetime = T0
) -> RunnerSnapshot:
    """One runner as placement sees it at ``now``, failing any rule now and then."""
    allocatable = Capacity(
        vcpu_count=draw(st.sampled_from([0, 2, 4, 8])),
        memory_bytes=draw(st.sampled_from([0, 4 * GIB, 8 * GIB])),
        disk_bytes=draw(st.sampled_from([0, 10 * GIB, 100 * GIB])),
        instances=draw(st.integers(0, 3)),
        operations=draw(st.integers(0, 2)),
    )
    reserved = Capacity(
        **{dim: draw(st.integers(0, amount)) for dim, amount in allocatable.as_dict().items()}
    )
    optional_caps = draw(
        st.frozensets(
            st.sampled_from(
                ["compute", *PREREQUISITES, "snapshot-restore", "physical-storage-admission"]
            )
        )
    )
    heartbeat_age = draw(st.one_of(st.none(), st.integers(-5, 60)))
    return RunnerSnapshot(
        id=runner_id if runner_id is not None else draw(st.sampled_from(RUNNER_IDS)),
        pool_name=draw(st.sampled_from([POOL, POOL, POOL, "pool-b"])),
        backend_kind="firecracker",
        architecture="x86_64",
        drain_phase=draw(st.sampled_from([DRAIN_PHASE_ACTIVE] * 4 + [DRAIN_PHASE_DRAINING])),
        last_heartbeat_at=None if heartbeat_age is None else now - timedelta(seconds=heartbeat_age),
        capabilities=draw(st.sampled_from([BASE_CAPABILITIES] * 3 + [optional_caps])),
        allocatable=allocatable,
        reserved=reserved,
        artifact_digests=tuple(
            draw(st.lists(st.sampled_from([RUNTIME, TOOLCHAIN, "sha256:x"]), unique=True))
        ),
        materializations=draw(
            st.sampled_from([(materialization(),)] * 3 + [(), (_materialization(digest=""),)])
        ),
        supported_egress_contexts=tuple(
            draw(st.lists(st.sampled_from(["public", "private"]), unique=True))
        ),
        guest_protocol_minimum=draw(st.integers(0, 3)),
        guest_protocol_maximum=draw(st.integers(1, 4)),
    )


@st.composite
def fleets(draw: st.DrawFn, now: datetime = T0) -> list[RunnerSnapshot]:
    """Up to eight runners with distinct ids (none at all, too)."""
    ids = draw(st.lists(st.sampled_from(RUNNER_IDS), unique=True, max_size=len(RUNNER_IDS)))
    return [draw(runner_snapshots(runner_id, now)) for runner_id in ids]


# -- histories of commands --------------------------------------------------------------

HISTORY_RUNNERS = ("r1", "r2", "r3")
HISTORY_SANDBOXES = ("s1", "s2", "s3", "s4")
COMMANDS = (
    "heartbeat", "drain", "cancel", "allocatable", "create", "schedule", "running",
    "release", "fail", "claim", "advance", "deregister", "tick",
)  # fmt: skip
Command = tuple[str, int, int]


def histories(max_size: int = 40) -> st.SearchStrategy[list[Command]]:
    """Sequences of ``(command, a, b)``: ``a`` picks a runner (and varies the command),
    ``b`` a sandbox. :func:`run_history` applies one."""
    return st.lists(
        st.tuples(st.sampled_from(COMMANDS), st.integers(0, 3), st.integers(0, 3)),
        max_size=max_size,
    )


def run_history(app: SchedulerApplication, clock: Clock, history: Sequence[Command]) -> None:
    """Register :data:`HISTORY_RUNNERS` (room for 1, 2 and 3 instances), then apply every
    command of ``history``; refusals (``SchedulerError``) are part of a history. Stale
    fences, early advances and double releases happen by chance."""
    tokens: dict[tuple[str, int], bytes] = {}
    for index, runner_id in enumerate(HISTORY_RUNNERS):
        register(app, runner_id, at=clock(), allocatable=capacity(instances=1 + index))
    for name, a, b in history:
        runner_id = HISTORY_RUNNERS[a % len(HISTORY_RUNNERS)]
        sandbox_id = HISTORY_SANDBOXES[b % len(HISTORY_SANDBOXES)]
        with contextlib.suppress(SchedulerError):
            _apply(app, clock, tokens, name, a, b, runner_id, sandbox_id)


def _apply(
    app: SchedulerApplication,
    clock: Clock,
    tokens: dict[tuple[str, int], bytes],
    name: str,
    a: int,
    b: int,
    runner_id: str,
    sandbox_id: str,
) -> Any:
    if name == "heartbeat":
        return app.record_heartbeat(
            runner_id=runner_id, at=clock(), artifact_digests=[RUNTIME] * (a % 2 + 1),
            materializations=[materialization()],
        )  # fmt: skip
    if name == "drain":
        return app.start_drain(runner_id)
    if name == "cancel":
        return app.cancel_drain(runner_id)
    if name == "allocatable":
        return app.change_allocatable(runner_id, capacity(instances=b + 1))
    if name == "create":
        return create_sandbox(app, sandbox_id)
    if name == "deregister":
        return app.deregister_runner(runner_id)
    if name == "tick":
        return clock.advance(seconds=7 * (a + 1))
    current = app.get_assignment(sandbox_id)
    generation = current.generation if current else 1
    if name == "schedule":
        assignment, _ = app.schedule(
            schedule_request(sandbox_id, clock(), fencing_token=token(), retry_limit=1)
        )
        tokens[(sandbox_id, assignment.generation)] = assignment.fencing_token
        return assignment
    held = tokens.get((sandbox_id, generation), b"\0" * 32)
    if name == "running":
        return app.mark_running(sandbox_id, generation, held)
    if name == "release":
        return app.release(sandbox_id, generation, held, {"proof": str(a)})
    if name == "fail":
        return app.fail(sandbox_id, generation, held, ["transport", "admission"][a % 2])
    if name == "claim":
        return app.claim_reconcile(
            sandbox_id, generation, f"owner-{a}", clock() + timedelta(seconds=10)
        )
    if name == "advance":
        return app.advance_generation(sandbox_id, generation)
    raise ValueError(f"unknown command {name!r}")
