"""Builders of valid runners, profiles and schedule requests, and a clock moved by hand.

Plain functions (no Hypothesis): what example tests, the strategies and the state
machine of this package share. Every builder returns something the scheduler accepts;
override any field to break exactly one thing. :func:`compatible_runner` and
:func:`near_miss_runner` build a runner view from a profile's requirements that passes
every placement rule, or fails exactly the rules named (one near miss per rule).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from secondbox_scheduler.domain import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
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


# -- runners built from requirements: compatible, or a near miss of chosen rules --------

# The placement rules of docs/spec.md (section 3) by reason code, in the order they run (the
# codes of ``secondbox_scheduler.domain.placement``; tests/test_testing_kit.py checks
# that the two lists agree).
PLACEMENT_RULES = (
    "pool", "architecture", "draining", "heartbeat_stale", "backend", "materialization",
    "guest_protocol", "capability", "prerequisite", "capacity", "egress",
)  # fmt: skip
COMPUTE = "compute"
PREREQUISITES = ("network-policy", "storage", "cleanup", "local-workspace")
PHYSICAL_STORAGE_ADMISSION = "physical-storage-admission"  # disk is then not checked
CLIENT_SELECTED_IMAGE = "client-selected-image"  # the materialization rule then passes
TICK = timedelta(microseconds=1)  # the smallest step of a datetime

# The ways :func:`near_miss_runner` fails each rule; ``ways[rule]`` picks one by index.
NEAR_MISSES: Mapping[str, tuple[str, ...]] = {
    "pool": ("another pool",),
    "architecture": ("another architecture (its materializations follow)",),
    "draining": ("draining",),
    "heartbeat_stale": ("last heartbeat one tick before now - heartbeat_timeout", "never"),
    "backend": ("no 'compute' capability", "empty backend kind (its materializations follow)"),
    "materialization": (
        "another runtime digest",
        "another toolchain digest",
        "an empty materialization digest",
        "another backend's materialization",
        "no materialization",
    ),
    "guest_protocol": ("maximum one below the generation", "minimum one above the generation"),
    "capability": ("one required capability missing (the way-th of the eligible ones)",),
    "prerequisite": tuple(f"{name} missing" for name in PREREQUISITES),
    "capacity": tuple(f"{dim} one unit short" for dim in Capacity.DIMENSIONS),
    "egress": ("the requested egress context unsupported",),
}


def check_placeable(requirements: Requirements) -> None:
    """ValueError when no runner can pass every rule for ``requirements``: a guest
    protocol generation below 1, or preferred digests that are not [runtime, toolchain]."""
    if requirements.guest_protocol_generation < 1:
        raise ValueError("no runner takes guest protocol generation 0")
    if len(requirements.preferred_artifact_digests) != 2:
        raise ValueError("preferred artifact digests must be exactly [runtime, toolchain]")


def compatible_runner(
    requirements: Requirements,
    runner_id: str = "runner-0",
    *,
    now: datetime = T0,
    **overrides: Any,
) -> RunnerSnapshot:
    """A runner view that passes every placement rule for ``requirements`` at ``now``
    (heartbeat at ``now``, fresh for any timeout; room for the request plus four default
    profiles). Overrides replace fields and may break that. ValueError: no runner can
    pass (:func:`check_placeable`)."""
    check_placeable(requirements)
    generation = requirements.guest_protocol_generation
    runtime, toolchain = requirements.preferred_artifact_digests
    requested = requirements.capacity.as_dict()
    room = capacity().as_dict()
    fields: dict[str, Any] = {
        "id": runner_id,
        "pool_name": requirements.pool_name,
        "backend_kind": "firecracker",
        "architecture": requirements.architecture,
        "capabilities": frozenset({COMPUTE, *PREREQUISITES, *requirements.required_capabilities}),
        "allocatable": Capacity(**{dim: requested[dim] + room[dim] for dim in requested}),
        "reserved": Capacity(),
        "drain_phase": DRAIN_PHASE_ACTIVE,
        "last_heartbeat_at": now,
        "artifact_digests": (),
        "materializations": (
            MaterializationSnapshot(
                backend_kind="firecracker",
                architecture=requirements.architecture,
                runtime_digest=runtime,
                toolchain_digest=toolchain,
                digest="sha256:materialized",
            ),
        ),
        "supported_egress_contexts": tuple(filter(None, [requirements.egress_context])),
        "guest_protocol_minimum": 1,
        "guest_protocol_maximum": max(3, generation),
    }
    fields.update(overrides)
    return RunnerSnapshot(**fields)


def near_miss_runner(
    requirements: Requirements,
    rules: str | Iterable[str],
    runner_id: str = "runner-0",
    *,
    now: datetime = T0,
    heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
    base: RunnerSnapshot | None = None,
    ways: Mapping[str, int] | None = None,
) -> RunnerSnapshot:
    """A runner that fails exactly ``rules`` (reason codes of :data:`PLACEMENT_RULES`)
    for ``requirements`` at ``now``, each by the smallest step past its boundary, and
    passes every other rule.

    ``base``: a runner that passes every rule, to start from (its id is kept); by
    default :func:`compatible_runner`. ``ways``: per rule, the index of the near miss
    of :data:`NEAR_MISSES` to use (default 0); one that cannot fail its rule alone for
    these requirements (say, removing a prerequisite the profile also requires) gives
    way to the next one that can. ValueError: an unknown rule, or one that no runner
    can fail alone for these requirements (``egress`` without an egress context,
    ``capability`` without a required capability other than ``compute`` and the
    prerequisites, ``materialization`` with ``client-selected-image``, ``capacity``
    with a request of zero on every checked dimension).

    >>> runner = near_miss_runner(profile(), "heartbeat_stale")
    >>> runner.last_heartbeat_at == T0 - HEARTBEAT_TIMEOUT - TICK
    True
    """
    wanted = {rules} if isinstance(rules, str) else set(rules)
    unknown = wanted - set(PLACEMENT_RULES)
    if unknown:
        raise ValueError(f"unknown placement rules {sorted(unknown)}")
    runner = base or compatible_runner(requirements, runner_id, now=now)
    fields = dict(runner)
    for rule in PLACEMENT_RULES:  # in the order the rules run: later ones see earlier ones
        if rule in wanted:
            way = (ways or {}).get(rule, 0)
            _NEAR_MISS[rule](fields, requirements, now - heartbeat_timeout, way)
    return RunnerSnapshot(**fields)


_Fields = dict[str, Any]


def _other(value: str) -> str:
    return f"{value}-other" if value else "other"


def _pick(options: Iterable[str], viable: Iterable[str], way: int, rule: str) -> str:
    """The way-th option, or the next one after it that is viable."""
    ordered, usable = list(options), set(viable)
    for step in range(len(ordered)):
        option = ordered[(way + step) % len(ordered)]
        if option in usable:
            return option
    raise ValueError(f"no runner can fail only {rule!r} for these requirements")


def _follow(fields: _Fields, field: str, old: str, new: str) -> None:
    """Move the runner's materializations of ``old`` (backend or architecture) to ``new``."""
    fields["materializations"] = tuple(
        item.model_copy(update={field: new}) if getattr(item, field) == old else item
        for item in fields["materializations"]
    )


def _fail_pool(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    fields["pool_name"] = _other(req.pool_name)


def _fail_architecture(
    fields: _Fields, req: Requirements, stale_before: datetime, way: int
) -> None:
    new = "aarch64" if req.architecture != "aarch64" else "x86_64"
    _follow(fields, "architecture", fields["architecture"], new)
    fields["architecture"] = new


def _fail_draining(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    fields["drain_phase"] = DRAIN_PHASE_DRAINING


def _fail_heartbeat(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    fields["last_heartbeat_at"] = None if way % 2 else stale_before - TICK


def _fail_backend(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    viable = ["empty"] if COMPUTE in req.required_capabilities else ["compute", "empty"]
    if _pick(["compute", "empty"], viable, way, "backend") == "compute":
        fields["capabilities"] = fields["capabilities"] - {COMPUTE}
    else:
        _follow(fields, "backend_kind", fields["backend_kind"], "")
        fields["backend_kind"] = ""


def _fail_materialization(
    fields: _Fields, req: Requirements, stale_before: datetime, way: int
) -> None:
    if CLIENT_SELECTED_IMAGE in req.required_capabilities:
        raise ValueError(f"no runner fails 'materialization' with {CLIENT_SELECTED_IMAGE!r}")
    runtime, toolchain = req.preferred_artifact_digests
    backend, architecture = fields["backend_kind"], fields["architecture"]
    match = MaterializationSnapshot(
        backend_kind=backend,
        architecture=architecture,
        runtime_digest=runtime,
        toolchain_digest=toolchain,
        digest="sha256:materialized",
    )
    broken = [
        match.model_copy(update={"runtime_digest": _other(runtime)}),
        match.model_copy(update={"toolchain_digest": _other(toolchain)}),
        match.model_copy(update={"digest": ""}),
        match.model_copy(update={"backend_kind": _other(backend)}),
        None,
    ][way % 5]
    kept = tuple(
        item
        for item in fields["materializations"]
        if not (
            (item.backend_kind, item.architecture, item.runtime_digest, item.toolchain_digest)
            == (backend, architecture, runtime, toolchain)
            and item.digest
        )
    )
    fields["materializations"] = kept if broken is None else (*kept, broken)


def _fail_guest_protocol(
    fields: _Fields, req: Requirements, stale_before: datetime, way: int
) -> None:
    generation = req.guest_protocol_generation
    if way % 2 == 1 and generation < 2**32 - 1:
        fields["guest_protocol_minimum"] = generation + 1
        fields["guest_protocol_maximum"] = max(fields["guest_protocol_maximum"], generation + 1)
    else:
        fields["guest_protocol_maximum"] = generation - 1
        fields["guest_protocol_minimum"] = min(fields["guest_protocol_minimum"], generation - 1)


def _fail_capability(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    eligible = sorted(req.required_capabilities - {COMPUTE, *PREREQUISITES})
    name = _pick(eligible, eligible, way, "capability")
    fields["capabilities"] = fields["capabilities"] - {name}
    if name == PHYSICAL_STORAGE_ADMISSION:  # disk is checked again: make it fit
        allocatable, reserved = fields["allocatable"], fields["reserved"]
        disk = max(allocatable.disk_bytes, reserved.disk_bytes + req.capacity.disk_bytes)
        fields["allocatable"] = allocatable.model_copy(update={"disk_bytes": disk})


def _fail_prerequisite(
    fields: _Fields, req: Requirements, stale_before: datetime, way: int
) -> None:
    viable = [name for name in PREREQUISITES if name not in req.required_capabilities]
    fields["capabilities"] = fields["capabilities"] - {
        _pick(PREREQUISITES, viable, way, "prerequisite")
    }


def _fail_capacity(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    requested = req.capacity.as_dict()
    unchecked = {"disk_bytes"} if PHYSICAL_STORAGE_ADMISSION in fields["capabilities"] else set()
    viable = [dim for dim in Capacity.DIMENSIONS if requested[dim] > 0 and dim not in unchecked]
    dim = _pick(Capacity.DIMENSIONS, viable, way, "capacity")
    reserved = getattr(fields["reserved"], dim)
    fields["allocatable"] = fields["allocatable"].model_copy(
        update={dim: reserved + requested[dim] - 1}
    )


def _fail_egress(fields: _Fields, req: Requirements, stale_before: datetime, way: int) -> None:
    wanted = req.egress_context
    if wanted is None:
        raise ValueError("no runner fails 'egress' when the requirements name no context")
    supported = fields["supported_egress_contexts"]
    fields["supported_egress_contexts"] = tuple(c for c in supported if c != wanted)


_NEAR_MISS = {
    "pool": _fail_pool,
    "architecture": _fail_architecture,
    "draining": _fail_draining,
    "heartbeat_stale": _fail_heartbeat,
    "backend": _fail_backend,
    "materialization": _fail_materialization,
    "guest_protocol": _fail_guest_protocol,
    "capability": _fail_capability,
    "prerequisite": _fail_prerequisite,
    "capacity": _fail_capacity,
    "egress": _fail_egress,
}
