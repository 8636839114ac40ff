"""A deterministic fleet simulation on a real store: the engine of ``simulate``.

:func:`run_simulation` registers a seeded fleet, creates sandboxes from a few profile
revisions per pool and drives them through start/stop cycles with seeded random
arrivals, all on a simulated clock, through the public commands of
:class:`~infrastructure.application.SchedulerApplication`. Part-way through, one
runner is drained (and the drain later cancelled) and another stops heartbeating,
so that restarts of the sandboxes homed there are refused with the ``draining`` and
``heartbeat_stale`` reason codes. It returns a :class:`SimulationResult`; the same
seed and sizes give the same result, except the wall time.

Timeline (one tick is 5 simulated seconds): every live runner heartbeats every tick
(the application records a plain renewal at most every 10 s, so about half are
coalesced); sandboxes arrive during the first six minutes; each sandbox is started
``cycles`` times. A started sandbox runs 1-6 minutes, is released with proof,
advances its generation and idles 30 s - 3 min before its next start; after its last
start it stays running, so the final utilisation shows a loaded fleet. A refused
start is retried a minute later, at most three attempts per cycle. The run ends when
every sandbox has made its last start attempt.

Assignment lifecycle and reconciliation: a start must be reported running within its
operation deadline (a minute). During the first 35 % of the start attempts a few placed
starts are never reported running, and no start on a runner that stopped heartbeating
is. A :class:`SimulationReconciler` ("simulator-reconciler") makes a pass every
simulated minute: it fails unreported starts with ``deadline_exceeded``, which
redelivers them while retries remain (some are then reported running) and fails them
terminally past the retry limit; the stale runner's assignments become ``uncertain``
and keep their reservations (a running sandbox there cannot report its stop). An
operator (the simulation) releases failed and uncertain assignments by hand with proof
one pass after noticing them, and the sandbox moves on to its next generation. Half-way
through, a scripted peer reconciler ("simulator-peer") wins the claim race for a few
due assignments (held by others, for the simulator's reconciler) and once pauses past
its claim's expiry, so that its late commit is refused (a lost claim). Whatever is
still unreported, failed or uncertain at the end keeps its reservation; the ledger
check covers it.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from secondbox_scheduler.domain.assignment import (
    STATE_ASSIGNED,
    STATE_FAILED,
    STATE_RELEASED,
    STATE_UNCERTAIN,
    STATES,
)
from secondbox_scheduler.domain.errors import (
    PlacementError,
    ReconcileClaimError,
    RunnerNotFoundError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.evidence import REASON_CODES, reason_keys
from secondbox_scheduler.domain.reconcile import (
    ACTION_DEADLINE_EXCEEDED,
    ACTIONS,
    ReconcileDecision,
    decide_reconcile,
)
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.reconciler import Reconciler, ReconcileReport
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    DEFAULT_SQLITE_URL,
    READ_MODELS,
    settings_from_url,
)

GIB = 2**30
SIM_START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
TICK = timedelta(seconds=5)
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
ARRIVAL_TICKS = 72  # sandboxes arrive during the first 6 minutes
RUN_TICKS = (12, 72)  # a start runs 1-6 minutes
IDLE_TICKS = (6, 36)  # and idles 30 s - 3 min before the next start
RETRY_TICKS = 12  # a refused start is retried a minute later
ATTEMPTS_PER_CYCLE = 3
SERIALIZATION_RETRY_LIMIT = 8
ASSIGNMENT_RETRY_LIMIT = 3
REPLAY_PROBABILITY = 0.08  # the start command is delivered twice
TRANSIENT_FAILURE_PROBABILITY = 0.05  # the runner reports a transport failure once
LATE_FENCE_PROBABILITY = 0.10  # a late message of the previous generation arrives
OPERATION_DEADLINE = timedelta(minutes=1)  # a start must be reported running by then
UNREPORTED_START_PROBABILITY = 0.08  # the runner never reports a start running
RECOVERY_PROBABILITY = 0.35  # a redelivered unreported start is then reported running

# Reconciliation: one pass a simulated minute, by one reconciler (and a scripted peer).
RECONCILE_TICKS = 12
RECONCILE_INTERVAL = timedelta(seconds=60)
RECONCILE_CLAIM_TTL = timedelta(seconds=60)
RECONCILER_OWNER = "simulator-reconciler"
PEER_OWNER = "simulator-peer"
PEER_RACES = 3  # due assignments the peer claims just before the reconciler does
OPERATOR = "simulator"  # who releases failed and uncertain assignments by hand

# When, by the share of start attempts made, the scripted incidents happen.
DRAIN_AT = 0.25
STALE_AT = 0.40
ROLLOUT_AT = 0.55
CANCEL_DRAIN_AT = 0.75
PEER_AT = 0.50
UNREPORTED_UNTIL = 0.35  # later starts are all reported, or they would outlast the run

BACKENDS = ("firecracker", "cloud-hypervisor")
X86, ARM = "x86_64", "aarch64"
FULL_CAPABILITIES = ("compute", "network-policy", "storage", "cleanup", "local-workspace")
CAP_CLIENT_IMAGE = "client-selected-image"
CAP_PHYSICAL_STORAGE = "physical-storage-admission"
EGRESS_CORP = "corp-proxy"
EGRESS_PARTNER = "partner-vpn"
EGRESS_NOWHERE = "eu-sovereign"  # advertised by no runner: creations are refused
TOOLCHAINS = ("python", "node")
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


# -- configuration, clock and plans -------------------------------------------------


@dataclass(frozen=True)
class SimulationConfig:
    """What to simulate and where to write it."""

    database_url: str = DEFAULT_SQLITE_URL
    seed: int = 7
    runners: int = 36
    sandboxes: int = 200
    cycles: int = 3
    fresh: bool = True

    def __post_init__(self) -> None:
        if self.runners < 3:
            raise ValueError("runners must be at least 3 (one per pool)")
        if self.sandboxes < 1:
            raise ValueError("sandboxes must be at least 1")
        if self.cycles < 1:
            raise ValueError("cycles must be at least 1")


class SimulatedClock:
    """The application's clock: a current time that only the simulation moves."""

    def __init__(self, start: datetime = SIM_START) -> None:
        self.current = start

    def __call__(self) -> datetime:
        return self.current

    def advance(self, delta: timedelta) -> datetime:
        self.current += delta
        return self.current


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
                if template.toolchain is None:
                    capabilities = frozenset({CAP_CLIENT_IMAGE})
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


# -- results ---------------------------------------------------------------------------

UTILISATION_DIMENSIONS = ("vcpu_count", "memory_bytes", "instances")


@dataclass(frozen=True)
class DimensionUse:
    """One capacity dimension: reserved and allocatable at the end, peak reserved."""

    reserved: int
    allocatable: int
    peak: int

    @property
    def percent(self) -> float:
        return 100.0 * self.reserved / self.allocatable if self.allocatable else 0.0

    @property
    def peak_percent(self) -> float:
        return 100.0 * self.peak / self.allocatable if self.allocatable else 0.0


@dataclass(frozen=True)
class RunnerUse:
    runner_id: str
    pool_name: str
    architecture: str
    drain_phase: str
    heartbeat: str  # "live" or "stale" at the end
    vcpu_count: DimensionUse
    memory_bytes: DimensionUse
    instances: DimensionUse


@dataclass(frozen=True)
class PoolUse:
    pool_name: str
    runners: int
    vcpu_count: DimensionUse
    memory_bytes: DimensionUse
    instances: DimensionUse


@dataclass(frozen=True)
class ReconcileUse:
    """What the reconcilers did, both of them together unless named."""

    interval_seconds: float  # simulated time between rounds (and between two looks)
    operation_deadline_seconds: float
    rounds: int  # reconcile rounds, each of passes until nothing is due
    passes: int  # the reconciler's passes (due reads)
    due: int  # due assignments found, pass after pass (one may be found again)
    reconciled: int  # results committed
    reconciled_by: dict[str, int]  # owner -> results committed
    actions: dict[str, int]  # none, deadline_exceeded, uncertain
    redeliveries: int  # deadline_exceeded with retries left: assigned again, fresh window
    terminal_failures: int  # deadline_exceeded past the retry limit: failed
    held_by_others: int  # claims refused because another owner held one
    claims_lost: int  # results refused because the claim was no longer current
    no_longer_due: int
    stale: int


@dataclass(frozen=True)
class SimulationResult:
    """What one simulation did; every field but ``wall_seconds`` depends only on the inputs."""

    seed: int
    runners: int
    sandboxes: int
    cycles: int
    database_url: str
    simulated_seconds: float
    sandboxes_created: int
    start_attempts: int
    placements: int
    replays: int
    releases: int
    generations_advanced: int
    transient_failures: int
    late_fences_rejected: int
    cycles_abandoned: int
    running_at_end: int
    starts_unreported: int  # placed starts the runner never reported running
    redelivered_starts_running: int  # of those, reported running after a redelivery
    manual_releases: int  # released by hand by the operator, with proof
    manual_releases_by_state: dict[str, int]  # the state they were released from
    assignment_states: dict[str, int]  # every assignment of the run by its final state
    reconcile: ReconcileUse
    refusals: dict[str, dict[str, int]]  # operation -> error type -> count
    refusal_reasons: dict[str, dict[str, int]]  # operation -> reason code -> count
    drained_runner: str
    drain_cancelled: bool
    stale_runner: str
    contention_retries: int
    contention_errors: int
    heartbeats: dict[str, int]  # sent, recorded, coalesced and every outcome
    events_written: int
    events_in_store: int
    ledger_matches_store: bool  # reserved = what the run placed minus what it released
    # = the capacity of every unreleased assignment, on every runner
    pools: list[PoolUse]
    runner_use: list[RunnerUse]
    wall_seconds: float

    @property
    def refusals_total(self) -> int:
        return sum(sum(by_type.values()) for by_type in self.refusals.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def counts(self) -> dict[str, Any]:
        """Everything but the wall time: equal for equal inputs."""
        data = self.to_dict()
        del data["wall_seconds"]
        return data


# -- the simulation --------------------------------------------------------------------


def sqlite_path(database_url: str) -> Path | None:
    """The file a sqlite URL names (None for other stores and in-memory databases)."""
    settings = settings_from_url(database_url)
    name = settings.get("SQLITE_DBNAME")
    if not name or name.startswith("file:"):
        return None
    return Path(name)


def delete_sqlite_database(path: Path) -> None:
    """Remove a SQLite database and its journal files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@dataclass
class _Sandbox:
    """The simulation's view of one sandbox and its next step."""

    sandbox_id: str
    workspace_id: str
    profile: ProfileRevision
    starts_left: int
    home: str = ""
    generation: int = 1
    # arriving, starting, running, idle, done, refused; and waiting for the reconciler
    # and the operator: unreported (placed, never reported running) or lost (running
    # on a runner that stopped heartbeating, so its stop cannot be reported)
    phase: str = "arriving"
    attempts: int = 0
    next_tick: int = 0
    running_token: bytes = b""  # the current generation's fencing token once placed
    previous_token: bytes = b""
    retries_seen: int = 0  # the assignment's retry_count when last looked at
    noticed: str = ""  # the failed or uncertain state the operator has seen


@dataclass
class _Ledger:
    """Reservations as the simulation saw them placed and released, with peaks."""

    pool_of: dict[str, str]
    reserved: dict[str, Counter[str]] = field(default_factory=dict)
    peak: dict[str, Counter[str]] = field(default_factory=dict)
    pool_reserved: dict[str, Counter[str]] = field(default_factory=dict)
    pool_peak: dict[str, Counter[str]] = field(default_factory=dict)

    def change(self, runner_id: str, capacity: Capacity, sign: int) -> None:
        pool = self.pool_of[runner_id]
        for dim, amount in capacity.as_dict().items():
            for used, peak, key in (
                (self.reserved, self.peak, runner_id),
                (self.pool_reserved, self.pool_peak, pool),
            ):
                now = used.setdefault(key, Counter())
                now[dim] += sign * amount
                top = peak.setdefault(key, Counter())
                top[dim] = max(top[dim], now[dim])

    def matches(self, snapshots: Iterable[RunnerSnapshot]) -> bool:
        for snapshot in snapshots:
            held = self.reserved.get(snapshot.id, Counter())
            if any(held[dim] != amount for dim, amount in snapshot.reserved.as_dict().items()):
                return False
        return True


class SimulationReconciler(Reconciler):
    """The simulation's :class:`Reconciler`: the same passes on simulated time, but

    - it sees only the run's own sandboxes (ids starting with ``prefix``), so a run
      appended to a store never reconciles another run's assignments;
    - it tells a ``deadline_exceeded`` redelivery from a terminal failure;
    - ``before_claim`` (when set) runs between reading the due list and claiming each
      due assignment: where another reconciler process could get in first.
    """

    def __init__(self, app: SchedulerApplication, owner: str, prefix: str = "") -> None:
        super().__init__(
            app,
            owner,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            claim_ttl=RECONCILE_CLAIM_TTL,
            interval=RECONCILE_INTERVAL,
        )
        self.prefix = prefix
        self.redeliveries = 0
        self.terminal_failures = 0
        self.before_claim: Callable[[DurableAssignment], None] | None = None

    def run_once(self) -> tuple[int, int]:
        if not self.prefix:
            return super().run_once()
        read_models = self.app.current_read_models()
        assert read_models is not None
        found = read_models.assignments.due_for_reconcile(self.app.now(), limit=2**31)
        due = [a for a in found if a.sandbox_id.startswith(self.prefix)][: self.batch]
        self.report.passes += 1
        self.report.due += len(due)
        done = sum(self._reconcile(assignment) for assignment in due)
        return len(due), done

    def reconcile(self, due: DurableAssignment) -> int:
        """Claim, decide, commit and release one assignment: 1 if a result was committed."""
        return self._reconcile(due)

    def _reconcile(self, due: DurableAssignment) -> int:
        if self.before_claim is not None:
            self.before_claim(due)
        exceeded = self.report.actions[ACTION_DEADLINE_EXCEEDED]
        done = super()._reconcile(due)
        if self.report.actions[ACTION_DEADLINE_EXCEEDED] > exceeded:
            current = self.app.get_assignment(due.sandbox_id, due.generation)
            if current is not None and current.state == STATE_FAILED:
                self.terminal_failures += 1
            else:
                self.redeliveries += 1
        return done


def _no_sleep(_: float) -> None:
    """Reconcile passes take no simulated time."""


@dataclass
class _PausedClaim:
    due: DurableAssignment
    decision: ReconcileDecision
    until: datetime


class FleetSimulation:
    """One run of the simulation against one application (see :func:`run_simulation`)."""

    def __init__(
        self,
        app: SchedulerApplication,
        clock: SimulatedClock,
        config: SimulationConfig,
        *,
        prefix: str = "",
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.app = app
        self.clock = clock
        self.config = config
        self.prefix = prefix
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.fleet = plan_fleet(config.runners, prefix)
        self.runner_plans = {plan.runner_id: plan for plan in self.fleet}
        self.profiles = plan_profiles(prefix)
        self.ledger = _Ledger({plan.runner_id: plan.pool_name for plan in self.fleet})
        self.silent: set[str] = set()  # runners that stopped heartbeating
        self.rolled_out = False
        self.drained_runner = ""
        self.drain_cancelled = False
        self.stale_runner = ""
        self.tick = 0
        self.calendar: dict[int, list[str]] = {}
        self.sandboxes: dict[str, _Sandbox] = {}
        self.total_starts = config.sandboxes * config.cycles
        self.starts_done = 0
        operations = ("create_sandbox", "schedule")
        self.refusals: dict[str, Counter[str]] = {op: Counter() for op in operations}
        self.reasons: dict[str, Counter[str]] = {op: Counter() for op in operations}
        self.counts: Counter[str] = Counter()
        self.manual_releases: Counter[str] = Counter()  # by the state released from
        self.reconciler = SimulationReconciler(app, RECONCILER_OWNER, prefix)
        self.reconciler.before_claim = self.peer_before_claim
        self.peer = SimulationReconciler(app, PEER_OWNER, prefix)
        self.peer_started = False
        self.peer_races_left = 0
        self.peer_pauses_left = 0
        self.peer_won: list[DurableAssignment] = []
        self.peer_paused: list[_PausedClaim] = []

    # -- set-up ----------------------------------------------------------------

    def register_fleet(self) -> None:
        for plan in self.fleet:
            self.app.register_runner(
                runner_id=plan.runner_id,
                pool_name=plan.pool_name,
                backend_kind=plan.backend_kind,
                architecture=plan.architecture,
                capabilities=plan.capabilities,
                allocatable=plan.allocatable,
                guest_protocol_minimum=1,
                guest_protocol_maximum=plan.guest_protocol_maximum,
                supported_egress_contexts=plan.egress_contexts,
            )
        self.heartbeat_all()

    def plan_sandboxes(self) -> None:
        pools = list(POOLS)
        weights = [pool.share for pool in pools]
        by_pool: dict[str, list[RunnerPlan]] = {}
        for plan in self.fleet:
            by_pool.setdefault(plan.pool_name, []).append(plan)
        for number in range(1, self.config.sandboxes + 1):
            pool = self.rng.choices(pools, weights)[0]
            pool_name = f"{self.prefix}{pool.name}"
            architecture = self.rng.choice(by_pool[pool_name]).architecture
            revisions = self.profiles[(pool_name, architecture)]
            profile = self.rng.choices(revisions, [r.template.weight for r in revisions])[0]
            workspace = self.rng.randrange(1, 2 + number // 4)
            sandbox = _Sandbox(
                sandbox_id=f"{self.prefix}sbx-{number:04d}",
                workspace_id=f"{self.prefix}ws-{workspace:04d}",
                profile=profile,
                starts_left=self.config.cycles,
            )
            self.sandboxes[sandbox.sandbox_id] = sandbox
            self.at(self.rng.randrange(1, ARRIVAL_TICKS + 1), sandbox)

    # -- time ------------------------------------------------------------------

    def at(self, tick: int, sandbox: _Sandbox) -> None:
        sandbox.next_tick = tick
        self.calendar.setdefault(tick, []).append(sandbox.sandbox_id)

    def now(self) -> datetime:
        return self.clock()

    def heartbeat_all(self) -> None:
        now = self.now()
        for plan in self.fleet:
            if plan.runner_id in self.silent:
                continue
            materializations = plan.materializations
            if self.rolled_out:
                materializations += plan.rollout
            self.app.record_heartbeat(
                runner_id=plan.runner_id,
                at=now,
                artifact_digests=plan.artifact_digests,
                materializations=materializations,
            )
            self.counts["heartbeats_sent"] += 1

    def finish_start(self, amount: int = 1) -> None:
        self.starts_done += amount
        if self.progress is not None:
            self.progress(self.starts_done, self.total_starts)

    @property
    def share_done(self) -> float:
        return self.starts_done / self.total_starts

    # -- incidents -------------------------------------------------------------

    def future_starts(self, runner_id: str, not_before: int) -> int:
        """Start attempts still to come on ``runner_id`` at or after tick ``not_before``."""
        total = 0
        for sandbox in self.sandboxes.values():
            if sandbox.home != runner_id:
                continue
            if sandbox.phase in ("running", "unreported", "lost"):
                total += sandbox.starts_left  # the next start follows a full run and idle
            elif sandbox.phase in ("idle", "starting"):
                soon = sandbox.next_tick < not_before
                total += sandbox.starts_left - (1 if soon else 0)
        return total

    def pick_victim(self, not_before: int, exclude: str) -> str:
        """The runner whose refusal will be seen most often: most future starts homed there."""
        candidates = [plan.runner_id for plan in self.fleet if plan.runner_id != exclude]
        return max(candidates, key=lambda rid: (self.future_starts(rid, not_before), rid))

    def incidents(self) -> None:
        share = self.share_done
        if not self.drained_runner and share >= DRAIN_AT:
            self.drained_runner = self.pick_victim(self.tick, exclude=self.stale_runner)
            self.app.start_drain(self.drained_runner)
        if not self.stale_runner and share >= STALE_AT:
            # Placements see it stale once HEARTBEAT_TIMEOUT has passed since its last beat.
            not_before = self.tick + HEARTBEAT_TIMEOUT // TICK + 1
            self.stale_runner = self.pick_victim(not_before, exclude=self.drained_runner)
            self.silent.add(self.stale_runner)
        if not self.rolled_out and share >= ROLLOUT_AT:
            self.rolled_out = True  # the next heartbeats carry new evidence
        if (
            self.drained_runner
            and not self.drain_cancelled
            and share >= CANCEL_DRAIN_AT
            and self.reasons["schedule"]["draining"] > 0
        ):
            self.app.cancel_drain(self.drained_runner)
            self.drain_cancelled = True
        if not self.peer_started and share >= PEER_AT:
            self.peer_started = True  # a second reconciler process joins, for a while
            self.peer_races_left = PEER_RACES
            self.peer_pauses_left = 1

    # -- reconciliation and the operator ---------------------------------------

    def reconcile(self) -> None:
        """One reconcile round (passes until nothing is due), the peer's part, the operator's."""
        self.counts["reconcile_rounds"] += 1
        self.reconciler.drain(sleep=_no_sleep)
        for due in self.peer_won:  # the peer finishes what it claimed first
            self.peer.reconcile(due)
        self.peer_won.clear()
        self.peer_wake()
        self.operate()

    def peer_before_claim(self, due: DurableAssignment) -> None:
        """Between the reconciler's due read and its claim, the scripted peer may claim first:
        a few times to win the race (it commits after the pass), once to pause with the
        claim past its expiry (see :meth:`peer_wake`), on a sandbox that will not move."""
        sandbox = self.sandboxes.get(due.sandbox_id)
        if self.peer_races_left > 0:
            self.peer_races_left -= 1
            self.peer_claim(due)
            self.peer_won.append(due)
        elif (
            self.peer_pauses_left > 0
            and sandbox is not None
            and sandbox.phase == "running"
            and sandbox.starts_left == 0
            and sandbox.home not in self.silent
        ):
            self.peer_pauses_left -= 1
            until = self.peer_claim(due)
            current = self.app.get_assignment(due.sandbox_id, due.generation)
            assert current is not None
            try:
                home: RunnerSnapshot | None = self.app.fold_runner(current.runner_id)
            except RunnerNotFoundError:
                home = None
            decision = decide_reconcile(
                current, home, self.now(), HEARTBEAT_TIMEOUT, RECONCILE_INTERVAL
            )
            self.peer_paused.append(_PausedClaim(due, decision, until))

    def peer_claim(self, due: DurableAssignment) -> datetime:
        until = self.now() + RECONCILE_CLAIM_TTL
        claimed = self.app.claim_reconcile(due.sandbox_id, due.generation, PEER_OWNER, until)
        assert claimed, f"{due.sandbox_id} was claimed by someone else"
        return until

    def peer_wake(self) -> None:
        """The paused peer wakes after its claim expired (and the reconciler took the
        assignment over) and tries to commit its old decision: refused."""
        now = self.now()
        for paused in [p for p in self.peer_paused if p.until <= now]:
            self.peer_paused.remove(paused)
            sandbox_id, generation = paused.due.sandbox_id, paused.due.generation
            try:
                self.app.record_reconcile(sandbox_id, generation, PEER_OWNER, paused.decision)
                self.peer.report.actions[paused.decision.action] += 1
            except ReconcileClaimError:
                self.peer.report.claims_lost += 1
            except StaleFenceError:
                self.peer.report.stale += 1
            finally:
                with contextlib.suppress(SchedulerError):
                    self.app.release_reconcile_claim(sandbox_id, generation, PEER_OWNER)

    def operate(self) -> None:
        """The operator's round: look at every assignment that waits on the reconciler."""
        for sandbox in self.sandboxes.values():
            lost = sandbox.phase == "running" and sandbox.home in self.silent
            if lost or sandbox.phase in ("unreported", "lost"):
                self.look_at(sandbox)

    def look_at(self, sandbox: _Sandbox) -> None:
        """Release a failed or uncertain assignment by hand one round after noticing it;
        a redelivered unreported start may now be reported running."""
        assignment = self.app.get_assignment(sandbox.sandbox_id, sandbox.generation)
        assert assignment is not None
        if assignment.state in (STATE_FAILED, STATE_UNCERTAIN):
            if sandbox.noticed == assignment.state:
                self.release_by_hand(sandbox, assignment)
            else:
                sandbox.noticed = assignment.state
        elif (
            sandbox.phase == "unreported"
            and assignment.state == STATE_ASSIGNED
            and assignment.retry_count > sandbox.retries_seen
        ):
            sandbox.retries_seen = assignment.retry_count  # the reconciler redelivered it
            if sandbox.home not in self.silent and self.rng.random() < RECOVERY_PROBABILITY:
                self.counts["redelivered_starts_running"] += 1
                self.report_running(sandbox)

    def release_by_hand(self, sandbox: _Sandbox, assignment: DurableAssignment) -> None:
        reason = {
            STATE_FAILED: "start never reported running; the runner holds no compute for it",
            STATE_UNCERTAIN: "home runner stopped heartbeating; the host was confirmed gone",
        }[assignment.state]
        proof = {"operator": OPERATOR, "reason": reason, "released_at": self.now().isoformat()}
        released = self.app.release(
            sandbox.sandbox_id, sandbox.generation, assignment.fencing_token, proof
        )
        assert released
        self.manual_releases[assignment.state] += 1
        self.ledger.change(assignment.runner_id, assignment.capacity, -1)
        self.next_generation(sandbox)

    # -- refusals --------------------------------------------------------------

    def refused(self, operation: str, error: SchedulerError) -> None:
        self.refusals[operation][type(error).__name__] += 1
        if isinstance(error, PlacementError):
            for evaluation in error.evaluations:  # keys as the unlisted counts name them
                self.reasons[operation].update(reason_keys(evaluation))
            for key, count in error.unlisted.reasons.items():  # refused without a record
                if count:
                    self.reasons[operation][key] += count

    # -- sandbox steps ---------------------------------------------------------

    def arrive(self, sandbox: _Sandbox) -> None:
        try:
            sandbox.home = self.app.create_sandbox(
                sandbox_id=sandbox.sandbox_id,
                workspace_id=sandbox.workspace_id,
                profile_revision_id=sandbox.profile.revision_id,
                requirements=sandbox.profile.requirements,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
            )
        except SchedulerError as error:
            self.refused("create_sandbox", error)
            sandbox.phase = "refused"
            self.finish_start(sandbox.starts_left)
            return
        self.counts["sandboxes_created"] += 1
        sandbox.phase = "starting"
        self.start(sandbox)

    def request(self, sandbox: _Sandbox, token: bytes) -> ScheduleRequest:
        now = self.now()
        generation = sandbox.generation
        key = f"{sandbox.sandbox_id}/g{generation}"
        requirements = sandbox.profile.requirements
        artifacts = dict(
            zip(("runtime", "toolchain"), requirements.preferred_artifact_digests, strict=False)
        )
        return ScheduleRequest(
            assignment_id=f"asg-{key}",
            assignment_command_id=f"cmd-{key}",
            instance_id=f"inst-{key}",
            sandbox_id=sandbox.sandbox_id,
            workspace_id=sandbox.workspace_id,
            start_mutation_id=f"start-{key}",
            profile_revision_id=sandbox.profile.revision_id,
            requirements=requirements,
            assignment_command={
                "kind": "start",
                "sandbox": sandbox.sandbox_id,
                "generation": str(generation),
            },
            fencing_token=token,
            resolved_artifacts=artifacts,
            claim_expires_at=now + timedelta(seconds=30),
            operation_deadline=now + OPERATION_DEADLINE,
            retry_limit=ASSIGNMENT_RETRY_LIMIT,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            now=now,
            effect_started_at=now,
            plan_ready_at=now + timedelta(milliseconds=200),
        )

    def start(self, sandbox: _Sandbox) -> None:
        sandbox.attempts += 1
        self.counts["start_attempts"] += 1
        request = self.request(sandbox, self.rng.randbytes(32))
        try:
            assignment, created = self.app.schedule(request)
        except SchedulerError as error:
            self.refused("schedule", error)
            if sandbox.attempts < ATTEMPTS_PER_CYCLE:
                self.at(self.tick + RETRY_TICKS, sandbox)
                return
            self.counts["cycles_abandoned"] += 1
            self.end_cycle(sandbox)
            self.idle(sandbox)
            return
        assert created, f"{sandbox.sandbox_id} generation {sandbox.generation} was already placed"
        self.ledger.change(assignment.runner_id, assignment.capacity, +1)
        if self.rng.random() < REPLAY_PROBABILITY:
            again, created = self.app.schedule(request)  # duplicate delivery: a replay
            assert not created
            assert again.id == assignment.id
        self.run(sandbox, assignment)

    def run(self, sandbox: _Sandbox, assignment: DurableAssignment) -> None:
        token = assignment.fencing_token
        sandbox.running_token = token
        sandbox.retries_seen = 0
        self.end_cycle(sandbox)
        unreported = self.share_done < UNREPORTED_UNTIL and (
            self.rng.random() < UNREPORTED_START_PROBABILITY
        )
        if sandbox.home in self.silent or unreported:
            sandbox.phase = "unreported"  # left to the reconciler's operation deadline
            self.counts["starts_unreported"] += 1
            return
        if self.rng.random() < TRANSIENT_FAILURE_PROBABILITY:
            self.app.fail(sandbox.sandbox_id, sandbox.generation, token, "transport")
            self.counts["transient_failures"] += 1
        self.report_running(sandbox)

    def report_running(self, sandbox: _Sandbox) -> None:
        self.app.mark_running(sandbox.sandbox_id, sandbox.generation, sandbox.running_token)
        if sandbox.previous_token and self.rng.random() < LATE_FENCE_PROBABILITY:
            try:  # a late message of the previous generation is fenced out
                self.app.mark_running(
                    sandbox.sandbox_id, sandbox.generation - 1, sandbox.previous_token
                )
            except StaleFenceError:
                self.counts["late_fences_rejected"] += 1
        sandbox.phase = "running"
        if sandbox.starts_left > 0:  # after its last start a sandbox stays running
            self.at(self.tick + self.rng.randint(*RUN_TICKS), sandbox)

    def end_cycle(self, sandbox: _Sandbox) -> None:
        sandbox.starts_left -= 1
        sandbox.attempts = 0
        self.finish_start()

    def idle(self, sandbox: _Sandbox) -> None:
        if sandbox.starts_left <= 0:
            sandbox.phase = "done"
            return
        sandbox.phase = "idle"
        self.at(self.tick + self.rng.randint(*IDLE_TICKS), sandbox)

    def stop(self, sandbox: _Sandbox) -> None:
        now = self.now()
        assignment = self.app.get_assignment(sandbox.sandbox_id, sandbox.generation)
        assert assignment is not None
        proof = {
            "runner_id": assignment.runner_id,
            "stopped_at": now.isoformat(),
            "exit": "clean",
        }
        released = self.app.release(
            sandbox.sandbox_id, sandbox.generation, sandbox.running_token, proof
        )
        assert released
        self.counts["releases"] += 1
        self.ledger.change(assignment.runner_id, assignment.capacity, -1)
        self.next_generation(sandbox)

    def next_generation(self, sandbox: _Sandbox) -> None:
        sandbox.generation = self.app.advance_generation(sandbox.sandbox_id, sandbox.generation)
        self.counts["generations_advanced"] += 1
        sandbox.previous_token = sandbox.running_token
        sandbox.running_token = b""
        sandbox.retries_seen = 0
        sandbox.noticed = ""
        self.idle(sandbox)

    def step(self, sandbox: _Sandbox) -> None:
        if sandbox.phase == "arriving":
            self.arrive(sandbox)
        elif sandbox.phase == "running":
            if sandbox.home in self.silent:
                sandbox.phase = "lost"  # its runner cannot report the stop
            else:
                self.stop(sandbox)
        elif sandbox.phase in ("idle", "starting"):
            sandbox.phase = "starting"
            self.start(sandbox)

    def pending(self) -> bool:
        return self.starts_done < self.total_starts

    def run_all(self) -> None:
        self.register_fleet()
        self.plan_sandboxes()
        order = {"running": 0, "idle": 1, "starting": 1, "arriving": 2}
        while self.pending():
            self.tick += 1
            self.clock.advance(TICK)
            self.incidents()
            self.heartbeat_all()
            if self.tick % RECONCILE_TICKS == 0:
                self.reconcile()
            # an entry is stale once the operator released a lost sandbox before its stop
            entries = self.calendar.pop(self.tick, [])
            due = {s for s in entries if self.sandboxes[s].next_tick == self.tick}
            for sandbox_id in sorted(due, key=lambda s: (order.get(self.sandboxes[s].phase, 3), s)):
                self.step(self.sandboxes[sandbox_id])


def run_simulation(
    config: SimulationConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> SimulationResult:
    """Run the simulation on ``config.database_url`` and summarise it.

    With ``config.fresh`` a SQLite database file is deleted first, so reruns are
    reproducible. On a store that already holds events, every id (runners, pools,
    sandboxes, profile revisions) is prefixed with ``run<position>-`` so the run
    never collides with what is there. ``progress(done, total)`` is called after
    every start attempt cycle.
    """
    started = time.perf_counter()
    path = sqlite_path(config.database_url)
    if config.fresh and path is not None:
        delete_sqlite_database(path)
    clock = SimulatedClock()
    app = SchedulerApplication(
        # the reconciler reads the read models; caught up inline, so runs stay reproducible
        env={**(env or {}), DATABASE_URL: config.database_url, READ_MODELS: "on"},
        now=clock,
        rng=random.Random(config.seed),
    )
    try:
        before = app.event_count()
        prefix = f"run{before}-" if before else ""
        simulation = FleetSimulation(app, clock, config, prefix=prefix, progress=progress)
        simulation.run_all()
        return summarise(simulation, before, time.perf_counter() - started)
    finally:
        app.close()


def summarise(simulation: FleetSimulation, events_before: int, elapsed: float) -> SimulationResult:
    app = simulation.app
    names = {plan.runner_id for plan in simulation.fleet}
    snapshots = [s for s in app.runner_snapshots() if s.id in names]
    stale_before = simulation.now() - HEARTBEAT_TIMEOUT
    ledger = simulation.ledger
    runner_use = []
    pool_totals: dict[str, Counter[str]] = {}
    pool_counts: Counter[str] = Counter()
    for snapshot in snapshots:
        peak = ledger.peak.get(snapshot.id, Counter())
        seen = snapshot.last_heartbeat_at
        runner_use.append(
            RunnerUse(
                runner_id=snapshot.id,
                pool_name=snapshot.pool_name,
                architecture=snapshot.architecture,
                drain_phase=snapshot.drain_phase,
                heartbeat="live" if seen is not None and seen >= stale_before else "stale",
                vcpu_count=_use(snapshot, "vcpu_count", peak),
                memory_bytes=_use(snapshot, "memory_bytes", peak),
                instances=_use(snapshot, "instances", peak),
            )
        )
        totals = pool_totals.setdefault(snapshot.pool_name, Counter())
        totals.update({dim: snapshot.allocatable.as_dict()[dim] for dim in UTILISATION_DIMENSIONS})
        pool_counts[snapshot.pool_name] += 1
    pools = []
    for pool_name in sorted(pool_totals):
        used = ledger.pool_reserved.get(pool_name, Counter())
        top = ledger.pool_peak.get(pool_name, Counter())
        pools.append(
            PoolUse(
                pool_name=pool_name,
                runners=pool_counts[pool_name],
                vcpu_count=_pool_use(used, pool_totals[pool_name], top, "vcpu_count"),
                memory_bytes=_pool_use(used, pool_totals[pool_name], top, "memory_bytes"),
                instances=_pool_use(used, pool_totals[pool_name], top, "instances"),
            )
        )
    outcomes = dict(sorted(app.metrics.heartbeats.items()))
    heartbeats = {
        "sent": simulation.counts["heartbeats_sent"],
        "recorded": outcomes.get("renewed", 0) + outcomes.get("evidence", 0),
        "coalesced": outcomes.get("coalesced", 0),
        **outcomes,
    }
    states, unreleased_match = _assignment_states(app, snapshots)
    events = app.event_count()
    counts = simulation.counts
    return SimulationResult(
        seed=simulation.config.seed,
        runners=simulation.config.runners,
        sandboxes=simulation.config.sandboxes,
        cycles=simulation.config.cycles,
        database_url=simulation.config.database_url,
        simulated_seconds=(simulation.now() - SIM_START).total_seconds(),
        sandboxes_created=counts["sandboxes_created"],
        start_attempts=counts["start_attempts"],
        placements=app.metrics.placements,
        replays=app.metrics.replays,
        releases=counts["releases"],
        generations_advanced=counts["generations_advanced"],
        transient_failures=counts["transient_failures"],
        late_fences_rejected=counts["late_fences_rejected"],
        cycles_abandoned=counts["cycles_abandoned"],
        running_at_end=sum(1 for s in simulation.sandboxes.values() if s.phase == "running"),
        starts_unreported=counts["starts_unreported"],
        redelivered_starts_running=counts["redelivered_starts_running"],
        manual_releases=sum(simulation.manual_releases.values()),
        manual_releases_by_state={
            state: simulation.manual_releases[state] for state in (STATE_FAILED, STATE_UNCERTAIN)
        },
        assignment_states=states,
        reconcile=_reconcile_use(
            counts["reconcile_rounds"], simulation.reconciler, simulation.peer
        ),
        refusals={op: _sorted_counts(c) for op, c in simulation.refusals.items()},
        refusal_reasons={op: _reason_counts(c) for op, c in simulation.reasons.items()},
        drained_runner=simulation.drained_runner,
        drain_cancelled=simulation.drain_cancelled,
        stale_runner=simulation.stale_runner,
        contention_retries=app.metrics.contention_retries,
        contention_errors=app.metrics.contention_errors,
        heartbeats=heartbeats,
        events_written=events - events_before,
        events_in_store=events,
        ledger_matches_store=ledger.matches(snapshots) and unreleased_match,
        pools=pools,
        runner_use=runner_use,
        wall_seconds=round(elapsed, 3),
    )


def _assignment_states(
    app: SchedulerApplication, snapshots: list[RunnerSnapshot]
) -> tuple[dict[str, int], bool]:
    """Every assignment on the run's runners by state, and whether each runner's reserved
    capacity equals the sum over its unreleased assignments (failed and uncertain too)."""
    read_models = app.current_read_models()
    assert read_models is not None
    states: Counter[str] = Counter()
    matches = True
    for snapshot in snapshots:
        held: Counter[str] = Counter()
        for assignment in read_models.assignments.by_runner(snapshot.id, holding=False):
            states[assignment.state] += 1
            if assignment.state != STATE_RELEASED:
                held.update(assignment.capacity.as_dict())
        if any(held[dim] != amount for dim, amount in snapshot.reserved.as_dict().items()):
            matches = False
    ordered = {state: states[state] for state in STATES}
    ordered.update({state: n for state, n in sorted(states.items()) if state not in ordered})
    return ordered, matches


def _reconcile_use(rounds: int, *reconcilers: SimulationReconciler) -> ReconcileUse:
    total = ReconcileReport()
    for reconciler in reconcilers:
        report = reconciler.report
        total.passes += report.passes
        total.due += report.due
        total.held_by_others += report.held_by_others
        total.claims_lost += report.claims_lost
        total.no_longer_due += report.no_longer_due
        total.stale += report.stale
        total.actions.update(report.actions)
    return ReconcileUse(
        interval_seconds=(RECONCILE_TICKS * TICK).total_seconds(),
        operation_deadline_seconds=OPERATION_DEADLINE.total_seconds(),
        rounds=rounds,
        passes=total.passes,
        due=total.due,
        reconciled=sum(total.actions.values()),
        reconciled_by={r.owner: sum(r.report.actions.values()) for r in reconcilers},
        actions={action: total.actions[action] for action in ACTIONS},
        redeliveries=sum(r.redeliveries for r in reconcilers),
        terminal_failures=sum(r.terminal_failures for r in reconcilers),
        held_by_others=total.held_by_others,
        claims_lost=total.claims_lost,
        no_longer_due=total.no_longer_due,
        stale=total.stale,
    )


def _use(snapshot: RunnerSnapshot, dim: str, peak: Counter[str]) -> DimensionUse:
    return DimensionUse(
        snapshot.reserved.as_dict()[dim], snapshot.allocatable.as_dict()[dim], peak[dim]
    )


def _pool_use(
    used: Counter[str], allocatable: Counter[str], peak: Counter[str], dim: str
) -> DimensionUse:
    return DimensionUse(used[dim], allocatable[dim], peak[dim])


def _sorted_counts(counts: Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _reason_counts(counts: Counter[str]) -> dict[str, int]:
    """Reason codes in the order the placement checks run; unknown codes last."""
    ordered = {code: counts[code] for code in REASON_CODES if counts[code]}
    ordered.update({code: n for code, n in sorted(counts.items()) if code not in ordered})
    return ordered
