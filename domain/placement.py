"""Placement policy of SPEC section 3: pure functions, no I/O, no clock.

A chain of small feasibility checks, each with one job and a stable reason code
(Nomad's feasibility checkers, kube-scheduler's Filter plugins), then one ranking
key. Every check runs for every runner, so a decision can later be explained by
every rule a runner failed, not only the first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from domain.errors import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
)
from domain.values import (
    DRAIN_PHASE_ACTIVE,
    Capacity,
    Requirements,
    RunnerSnapshot,
    require_aware,
)

# Reason codes, in the order the checks run.
POOL = "pool"
ARCHITECTURE = "architecture"
DRAINING = "draining"
HEARTBEAT_STALE = "heartbeat_stale"
BACKEND = "backend"
MATERIALIZATION = "materialization"
GUEST_PROTOCOL = "guest_protocol"
CAPABILITY = "capability"
PREREQUISITE = "prerequisite"
CAPACITY = "capacity"
EGRESS = "egress"

CAPABILITY_COMPUTE = "compute"
CAPABILITY_CLIENT_SELECTED_IMAGE = "client-selected-image"
CAPABILITY_PHYSICAL_STORAGE_ADMISSION = "physical-storage-admission"
PREREQUISITE_CAPABILITIES = ("network-policy", "storage", "cleanup", "local-workspace")


@dataclass(frozen=True)
class RuleFailure:
    """One rule a runner failed: its reason code and a human detail.

    ``shortfall`` is set for ``capacity``: per dimension, how much is missing.
    """

    code: str
    detail: str
    shortfall: Mapping[str, int] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"code": self.code, "detail": self.detail}
        if self.shortfall:
            record["shortfall"] = dict(self.shortfall)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RuleFailure:
        return cls(record["code"], record["detail"], dict(record.get("shortfall", {})))


@dataclass(frozen=True)
class RunnerEvaluation:
    """Every rule one runner failed for one set of requirements (empty: compatible)."""

    runner_id: str
    failures: tuple[RuleFailure, ...]

    @property
    def compatible(self) -> bool:
        return not self.failures

    @property
    def reason_codes(self) -> tuple[str, ...]:
        return tuple(failure.code for failure in self.failures)

    @property
    def failed_only_egress(self) -> bool:
        return self.reason_codes == (EGRESS,)

    def to_record(self) -> dict[str, Any]:
        return {
            "runner_id": self.runner_id,
            "failures": [failure.to_record() for failure in self.failures],
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RunnerEvaluation:
        return cls(
            record["runner_id"],
            tuple(RuleFailure.from_record(f) for f in record["failures"]),
        )


@dataclass(frozen=True)
class _Context:
    requirements: Requirements
    stale_before: datetime
    preferred: frozenset[str]


Check = Callable[[_Context, RunnerSnapshot], RuleFailure | None]


def _check_pool(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    if runner.pool_name == ctx.requirements.pool_name:
        return None
    return RuleFailure(POOL, f"pool {runner.pool_name!r} is not {ctx.requirements.pool_name!r}")


def _check_architecture(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    if runner.architecture == ctx.requirements.architecture:
        return None
    return RuleFailure(
        ARCHITECTURE,
        f"architecture {runner.architecture!r} is not {ctx.requirements.architecture!r}",
    )


def _check_draining(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    if runner.drain_phase == DRAIN_PHASE_ACTIVE:
        return None
    return RuleFailure(DRAINING, f"drain phase is {runner.drain_phase!r}")


def _check_heartbeat(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    seen = runner.last_heartbeat_at
    if seen is not None and seen >= ctx.stale_before:
        return None
    last = "never" if seen is None else seen.isoformat()
    return RuleFailure(
        HEARTBEAT_STALE, f"last heartbeat {last} is before {ctx.stale_before.isoformat()}"
    )


def _check_backend(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    if runner.backend_kind and CAPABILITY_COMPUTE in runner.capabilities:
        return None
    if not runner.backend_kind:
        return RuleFailure(BACKEND, "backend kind is empty")
    return RuleFailure(BACKEND, f"missing capability {CAPABILITY_COMPUTE!r}")


def _check_materialization(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    requirements = ctx.requirements
    if CAPABILITY_CLIENT_SELECTED_IMAGE in requirements.required_capabilities:
        return None
    digests = requirements.preferred_artifact_digests
    if len(digests) != 2:
        return RuleFailure(
            MATERIALIZATION,
            f"preferred artifact digests must be exactly [runtime, toolchain], got {len(digests)}",
        )
    runtime, toolchain = digests
    for item in runner.materializations:
        if (
            item.backend_kind == runner.backend_kind
            and item.architecture == runner.architecture
            and item.runtime_digest == runtime
            and item.toolchain_digest == toolchain
            and item.digest
        ):
            return None
    return RuleFailure(
        MATERIALIZATION,
        f"no {runner.backend_kind}/{runner.architecture} materialization of "
        f"runtime {runtime!r} and toolchain {toolchain!r}",
    )


def _check_guest_protocol(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    generation = ctx.requirements.guest_protocol_generation
    low, high = runner.guest_protocol_minimum, runner.guest_protocol_maximum
    if generation >= 1 and low <= generation <= high:
        return None
    return RuleFailure(GUEST_PROTOCOL, f"guest protocol {generation} is outside [{low}, {high}]")


def _check_capabilities(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    missing = ctx.requirements.required_capabilities - runner.capabilities
    if not missing:
        return None
    return RuleFailure(CAPABILITY, f"missing capabilities {sorted(missing)}")


def _check_prerequisites(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    missing = [name for name in PREREQUISITE_CAPABILITIES if name not in runner.capabilities]
    if not missing:
        return None
    return RuleFailure(PREREQUISITE, f"missing prerequisite capabilities {missing}")


def checked_dimensions(capabilities: Iterable[str]) -> tuple[str, ...]:
    """Capacity dimensions a runner enforces; disk is unchecked with physical admission."""
    if CAPABILITY_PHYSICAL_STORAGE_ADMISSION in capabilities:
        return tuple(dim for dim in Capacity.DIMENSIONS if dim != "disk_bytes")
    return Capacity.DIMENSIONS


def capacity_shortfall(
    allocatable: Mapping[str, int],
    reserved: Mapping[str, int],
    requested: Mapping[str, int],
    dimensions: Iterable[str],
) -> dict[str, int]:
    """Per checked dimension, how much of ``requested`` does not fit (empty: fits)."""
    shortfall: dict[str, int] = {}
    for dim in dimensions:
        missing = requested[dim] - (allocatable[dim] - reserved[dim])
        if missing > 0:
            shortfall[dim] = missing
    return shortfall


def _check_capacity(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    shortfall = capacity_shortfall(
        runner.allocatable.as_dict(),
        runner.reserved.as_dict(),
        ctx.requirements.capacity.as_dict(),
        checked_dimensions(runner.capabilities),
    )
    if not shortfall:
        return None
    detail = ", ".join(f"{dim} short by {amount}" for dim, amount in shortfall.items())
    return RuleFailure(CAPACITY, f"insufficient capacity: {detail}", shortfall)


def _check_egress(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    wanted = ctx.requirements.egress_context
    if wanted is None or wanted in runner.supported_egress_contexts:
        return None
    return RuleFailure(EGRESS, f"egress context {wanted!r} is not supported")


CHECKS: tuple[tuple[str, Check], ...] = (
    (POOL, _check_pool),
    (ARCHITECTURE, _check_architecture),
    (DRAINING, _check_draining),
    (HEARTBEAT_STALE, _check_heartbeat),
    (BACKEND, _check_backend),
    (MATERIALIZATION, _check_materialization),
    (GUEST_PROTOCOL, _check_guest_protocol),
    (CAPABILITY, _check_capabilities),
    (PREREQUISITE, _check_prerequisites),
    (CAPACITY, _check_capacity),
    (EGRESS, _check_egress),
)
REASON_CODES: tuple[str, ...] = tuple(code for code, _ in CHECKS)


def _context(requirements: Requirements, now: datetime, heartbeat_timeout: timedelta) -> _Context:
    now = require_aware("now", now)
    if not isinstance(heartbeat_timeout, timedelta):
        raise InvalidRequestError("heartbeat_timeout", "must be a timedelta", heartbeat_timeout)
    return _Context(
        requirements=requirements,
        stale_before=now - heartbeat_timeout,
        preferred=frozenset(requirements.preferred_artifact_digests),
    )


def evaluate_runner(
    requirements: Requirements,
    runner: RunnerSnapshot,
    now: datetime,
    heartbeat_timeout: timedelta,
) -> RunnerEvaluation:
    """Every rule of SPEC section 3 that ``runner`` fails (none: compatible)."""
    return _evaluate(_context(requirements, now, heartbeat_timeout), runner)


def _evaluate(ctx: _Context, runner: RunnerSnapshot) -> RunnerEvaluation:
    failures = tuple(failure for _, check in CHECKS if (failure := check(ctx, runner)) is not None)
    return RunnerEvaluation(runner.id, failures)


def rank_key(requirements: Requirements, runner: RunnerSnapshot) -> tuple[int, int, int, int, str]:
    """Sort key of a compatible runner: smaller is better (SPEC section 3 ranking)."""
    preferred = frozenset(requirements.preferred_artifact_digests)
    return _rank_key(preferred, runner)


def _rank_key(preferred: frozenset[str], runner: RunnerSnapshot) -> tuple[int, int, int, int, str]:
    locality = sum(1 for digest in runner.artifact_digests if digest in preferred)
    a, r = runner.allocatable, runner.reserved
    return (
        -locality,
        -(a.instances - r.instances),
        -(a.vcpu_count - r.vcpu_count),
        -(a.memory_bytes - r.memory_bytes),
        runner.id,
    )


@dataclass(frozen=True)
class PlacementDecision:
    """The outcome of one selection and the evidence it was made on."""

    chosen: RunnerSnapshot | None
    evaluations: tuple[RunnerEvaluation, ...]

    @property
    def compatible_count(self) -> int:
        return sum(1 for evaluation in self.evaluations if evaluation.compatible)

    def summary(self) -> str:
        return summarize_refusals(self.evaluations)


def decide(
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime,
    heartbeat_timeout: timedelta,
) -> PlacementDecision:
    """Evaluate every runner and pick the best compatible one, without raising."""
    ctx = _context(requirements, now, heartbeat_timeout)
    evaluations = tuple(_evaluate(ctx, runner) for runner in runners)
    compatible = [
        runner
        for runner, evaluation in zip(runners, evaluations, strict=True)
        if evaluation.compatible
    ]
    chosen = min(compatible, key=lambda r: _rank_key(ctx.preferred, r)) if compatible else None
    return PlacementDecision(chosen, evaluations)


def _refuse(
    decision: PlacementDecision,
    error: type[NoCompatibleRunnerError] | type[HomeRunnerUnavailableError],
    detail: str = "",
) -> NoCompatibleRunnerError | HomeRunnerUnavailableError | EgressContextUnavailableError:
    if any(evaluation.failed_only_egress for evaluation in decision.evaluations):
        return EgressContextUnavailableError(decision.evaluations, detail)
    return error(decision.evaluations, detail)


def select_runner(
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime,
    heartbeat_timeout: timedelta,
) -> RunnerSnapshot:
    """Hard compatibility first, then locality and stable identity ordering."""
    decision = decide(requirements, runners, now, heartbeat_timeout)
    if decision.chosen is None:
        raise _refuse(decision, NoCompatibleRunnerError)
    return decision.chosen


def decide_home(
    home_runner_id: str,
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime,
    heartbeat_timeout: timedelta,
) -> PlacementDecision:
    """Like :func:`decide`, but every runner except the home runner is invisible."""
    home = [runner for runner in runners if home_runner_id and runner.id == home_runner_id]
    return decide(requirements, home[:1], now, heartbeat_timeout)


def select_home_runner(
    home_runner_id: str,
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime,
    heartbeat_timeout: timedelta,
) -> RunnerSnapshot:
    """Admit only the current authoritative home runner."""
    if not home_runner_id:
        raise HomeRunnerUnavailableError((), "sandbox has no home runner")
    decision = decide_home(home_runner_id, requirements, runners, now, heartbeat_timeout)
    if not decision.evaluations:
        raise HomeRunnerUnavailableError((), f"home runner {home_runner_id!r} is absent")
    if decision.chosen is None:
        raise _refuse(decision, HomeRunnerUnavailableError, f"home runner {home_runner_id!r}")
    return decision.chosen


_LABELS = {
    POOL: "in another pool",
    ARCHITECTURE: "of another architecture",
    DRAINING: "draining",
    HEARTBEAT_STALE: "heartbeat stale",
    BACKEND: "without compute backend",
    MATERIALIZATION: "without the materialization",
    GUEST_PROTOCOL: "guest protocol unsupported",
    CAPABILITY: "missing a required capability",
    PREREQUISITE: "missing a prerequisite capability",
    EGRESS: "egress context unsupported",
}


def refusal_counts(evaluations: Iterable[RunnerEvaluation]) -> Counter[str]:
    """How many runners each reason refused; capacity is split per dimension."""
    counts: Counter[str] = Counter()
    for evaluation in evaluations:
        for failure in evaluation.failures:
            if failure.code == CAPACITY:
                counts.update(f"insufficient {dim}" for dim in failure.shortfall)
            else:
                counts[_LABELS[failure.code]] += 1
    return counts


def summarize_refusals(evaluations: Sequence[RunnerEvaluation]) -> str:
    """kube-scheduler style: '0/12 runners are available: 5 insufficient memory_bytes, ...'."""
    if not evaluations:
        return ""
    available = sum(1 for evaluation in evaluations if evaluation.compatible)
    counts = refusal_counts(evaluations)
    head = f"{available}/{len(evaluations)} runners are available"
    if not counts:
        return head
    parts = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return head + ": " + ", ".join(f"{count} {label}" for label, count in parts)
