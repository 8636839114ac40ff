"""The fleet and the profiles a simulation runs on, planned from the runner count and an id prefix.

:func:`plan_fleet` plans the runners of the three pools (:data:`POOLS`), most fully
capable and a few lacking something; :func:`plan_profiles` plans the profile revisions
of every pool and architecture. Artifact and materialization digests are stable
functions of their names (:func:`digest`), so equal inputs plan equal fleets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from secondbox_scheduler.domain.values import Capacity, MaterializationSnapshot, Requirements

GIB = 2**30
BACKENDS = ("firecracker", "cloud-hypervisor")
X86, ARM = "x86_64", "aarch64"
FULL_CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
CAP_CLIENT_IMAGE = "client-selected-image"
CAP_PHYSICAL_STORAGE = "physical-storage-admission"
EGRESS_CORP = "corp-proxy"
EGRESS_PARTNER = "partner-vpn"
EGRESS_NOWHERE = "eu-sovereign"  # advertised by no runner: creations are refused
SIZES = (  # vcpu, memory GiB, disk GiB, instances
    (16, 64, 400, 10),
    (32, 128, 800, 16),
    (64, 256, 1600, 24),
)


def digest(*parts: str) -> str:
    """A stable, realistic-looking content digest for a name."""
    return "sha256:" + hashlib.sha256("/".join(("secondbox", *parts)).encode()).hexdigest()


def runtime_digest(architecture: str) -> str:
    return digest("runtime", architecture, "2026.01")


def toolchain_digest(toolchain: str, architecture: str) -> str:
    return digest("toolchain", toolchain, architecture)


@dataclass(frozen=True)
class PoolPlan:
    name: str
    share: float
    architecture_of: Callable[[int], str]


POOLS = (
    PoolPlan("general", 0.5, lambda i: ARM if i % 3 == 2 else X86),
    PoolPlan("batch", 0.3, lambda i: ARM if i % 4 == 3 else X86),
    PoolPlan("edge", 0.2, lambda i: X86 if i % 2 == 1 else ARM),
)


@dataclass(frozen=True)
class RunnerPlan:
    """One runner of the fleet, as registered and as it heartbeats."""

    runner_id: str
    pool_name: str
    backend_kind: str
    architecture: str
    capabilities: tuple[str, ...]
    allocatable: Capacity
    guest_protocol_maximum: int
    egress_contexts: tuple[str, ...]
    artifact_digests: tuple[str, ...]
    materializations: tuple[MaterializationSnapshot, ...]
    rollout: tuple[MaterializationSnapshot, ...]  # materializations it gains mid-run


@dataclass(frozen=True)
class ProfileTemplate:
    name: str
    weight: int
    vcpu: int
    memory_gib: int
    disk_gib: int
    toolchain: str | None  # None: a client-selected image, no materialization needed
    guest_protocol: int = 2
    egress: str | None = None


PROFILE_TEMPLATES = (
    ProfileTemplate("standard", 12, 2, 4, 20, "python"),
    ProfileTemplate("large", 4, 8, 32, 160, "node"),
    ProfileTemplate("egress", 4, 2, 8, 20, "python", egress=EGRESS_CORP),
    ProfileTemplate("byo-image", 2, 4, 8, 40, None, guest_protocol=3),
    ProfileTemplate("sovereign", 1, 2, 4, 20, "python", egress=EGRESS_NOWHERE),
)


@dataclass(frozen=True)
class ProfileRevision:
    """An immutable ProfileRevision: its id and its placement requirements."""

    revision_id: str
    template: ProfileTemplate
    requirements: Requirements


def _materialization(backend: str, architecture: str, toolchain: str) -> MaterializationSnapshot:
    runtime = runtime_digest(architecture)
    tools = toolchain_digest(toolchain, architecture)
    return MaterializationSnapshot(
        backend_kind=backend,
        architecture=architecture,
        runtime_digest=runtime,
        toolchain_digest=tools,
        digest=digest("materialization", backend, runtime, tools),
    )


def pool_sizes(runners: int) -> list[int]:
    """Runners per pool (general, batch, edge): about 50/30/20 %, at least one each."""
    batch = max(1, round(runners * POOLS[1].share))
    edge = max(1, round(runners * POOLS[2].share))
    return [runners - batch - edge, batch, edge]


def plan_fleet(runners: int, prefix: str = "") -> list[RunnerPlan]:
    """A mixed fleet: most runners fully capable, a few lacking something.

    The first two runners of every pool are always fully capable. Past them, by the
    runner's global number ``j``: every 13th lacks ``cleanup``, every 17th lacks
    ``compute``, every 5th speaks guest protocol 2 at most; some advertise egress
    contexts, physical storage admission or client-selected images, some cache fewer
    artifacts (lower locality), and about a third gain the ``node`` toolchain
    materialization only in the mid-run rollout.
    """
    plans: list[RunnerPlan] = []
    j = 0
    for pool, size in zip(POOLS, pool_sizes(runners), strict=True):
        for i in range(size):
            architecture = pool.architecture_of(i)
            backend = BACKENDS[1] if j % 8 == 7 else BACKENDS[0]
            capabilities = set(FULL_CAPABILITIES)
            protocol_max = 3
            if i >= 2:
                if j % 13 == 10:
                    capabilities.discard("cleanup")
                if j % 17 == 5:
                    capabilities.discard("compute")
                if j % 5 == 2:
                    protocol_max = 2
            if j % 4 == 1:
                capabilities.add(CAP_PHYSICAL_STORAGE)
            if i % 3 == 1 or i == 0:
                capabilities.add(CAP_CLIENT_IMAGE)
            egress: tuple[str, ...] = ()
            if i % 3 == 0:
                egress = (EGRESS_CORP, EGRESS_PARTNER) if j % 2 == 0 else (EGRESS_CORP,)
            has_node = i < 2 or i % 3 != 2
            materializations = [_materialization(backend, architecture, "python")]
            rollout = [_materialization(backend, architecture, "node")]
            if has_node:
                materializations += rollout
                rollout = []
            cached = [runtime_digest(architecture)]
            if j % 6 != 3:
                cached.append(toolchain_digest("python", architecture))
            if j % 2 == 0:
                cached.append(toolchain_digest("node", architecture))
            vcpu, memory, disk, instances = SIZES[j % len(SIZES)]
            plans.append(
                RunnerPlan(
                    runner_id=f"{prefix}{pool.name}-{i + 1:02d}",
                    pool_name=f"{prefix}{pool.name}",
                    backend_kind=backend,
                    architecture=architecture,
                    capabilities=tuple(sorted(capabilities)),
                    allocatable=Capacity(
                        vcpu_count=vcpu,
                        memory_bytes=memory * GIB,
                        disk_bytes=disk * GIB,
                        instances=instances,
                        operations=64,
                    ),
                    guest_protocol_maximum=protocol_max,
                    egress_contexts=egress,
                    artifact_digests=tuple(cached),
                    materializations=tuple(materializations),
                    rollout=tuple(rollout),
                )
            )
            j += 1
    return plans


def plan_profiles(prefix: str = "") -> dict[tuple[str, str], list[ProfileRevision]]:
    """The profile revisions of every (pool, architecture)."""
    profiles: dict[tuple[str, str], list[ProfileRevision]] = {}
    for number, pool in enumerate(POOLS):
        pool_name = f"{prefix}{pool.name}"
        for architecture in (X86, ARM):
            revisions = []
            for template in PROFILE_TEMPLATES:
                preferred: tuple[str, ...] = ()
                capabilities: frozenset[str] = frozenset()
                if template.toolchain is None:  # the client brings its image: the two
                    # digests name it (no runner caches them, so locality ranks as before)
                    capabilities = frozenset({CAP_CLIENT_IMAGE})
                    preferred = (
                        digest("client-runtime", template.name, architecture),
                        digest("client-image", template.name, architecture),
                    )
                else:
                    preferred = (
                        runtime_digest(architecture),
                        toolchain_digest(template.toolchain, architecture),
                    )
                revision = 1 + (number + len(template.name)) % 4
                revisions.append(
                    ProfileRevision(
                        revision_id=f"{pool_name}/{template.name}-{architecture}@r{revision}",
                        template=template,
                        requirements=Requirements(
                            pool_name=pool_name,
                            architecture=architecture,
                            required_capabilities=capabilities,
                            capacity=Capacity(
                                vcpu_count=template.vcpu,
                                memory_bytes=template.memory_gib * GIB,
                                disk_bytes=template.disk_gib * GIB,
                                instances=1,
                                operations=1,
                            ),
                            guest_protocol_generation=template.guest_protocol,
                            preferred_artifact_digests=preferred,
                            egress_context=template.egress,
                        ),
                    )
                )
            profiles[(pool_name, architecture)] = revisions
    return profiles
