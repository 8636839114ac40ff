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

from secondbox_scheduler.domain.errors import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    PlacementError,
)
from secondbox_scheduler.domain.values import (
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
    """The outcome of one selection and the evidence it was made on.

    ``unlisted`` counts the runners of the pool that were decided without an
    evaluation here (see :class:`Unlisted`): excluded by a store's prefilter, or never
    evaluated because they provably rank below ``chosen``.
    """

    chosen: RunnerSnapshot | None
    evaluations: tuple[RunnerEvaluation, ...]
    unlisted: Unlisted = field(default_factory=lambda: Unlisted())

    @property
    def compatible_count(self) -> int:
        return sum(1 for evaluation in self.evaluations if evaluation.compatible)

    def summary(self) -> str:
        return summarize_refusals(self.evaluations, self.unlisted)


def decide(
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime,
    heartbeat_timeout: timedelta,
    unlisted: Unlisted | None = None,
) -> PlacementDecision:
    """Evaluate every runner and pick the best compatible one, without raising.

    ``unlisted``: counts of the pool's runners not passed in (a store's prefilter); they
    are only carried as evidence, never chosen.
    """
    ctx = _context(requirements, now, heartbeat_timeout)
    evaluations = tuple(_evaluate(ctx, runner) for runner in runners)
    compatible = [
        runner
        for runner, evaluation in zip(runners, evaluations, strict=True)
        if evaluation.compatible
    ]
    chosen = min(compatible, key=lambda r: _rank_key(ctx.preferred, r)) if compatible else None
    return PlacementDecision(chosen, evaluations, unlisted or Unlisted())


def _refuse(
    decision: PlacementDecision,
    error: type[NoCompatibleRunnerError] | type[HomeRunnerUnavailableError],
    detail: str = "",
    *,
    bounded: bool = False,
) -> NoCompatibleRunnerError | HomeRunnerUnavailableError | EgressContextUnavailableError:
    evaluations, unlisted = decision.evaluations, decision.unlisted
    egress = any(evaluation.failed_only_egress for evaluation in evaluations)
    if bounded:
        kept, elided = bounded_evidence(evaluations, None)
        evaluations, unlisted = tuple(evaluations[i] for i in kept), unlisted.merged(elided)
    if egress:
        return EgressContextUnavailableError(evaluations, detail, unlisted=unlisted)
    return error(evaluations, detail, unlisted=unlisted)


def refusal(decision: PlacementDecision) -> PlacementError:
    """The typed error of a decision without a chosen runner (``select_runner``'s), its
    evidence bounded: at most :data:`EVIDENCE_PER_REASON` evaluations per combination
    of reasons, counts for the rest."""
    return _refuse(decision, NoCompatibleRunnerError, bounded=True)


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


def reason_label(reason: str) -> str:
    """The summary label of a reason key: a code, or ``capacity:<dimension>``."""
    if reason.startswith(f"{CAPACITY}:"):
        return f"insufficient {reason.split(':', 1)[1]}"
    return _LABELS[reason]


def reason_keys(evaluation: RunnerEvaluation) -> list[str]:
    """Reason keys of one evaluation: codes, capacity split per dimension."""
    keys: list[str] = []
    for failure in evaluation.failures:
        if failure.code == CAPACITY:
            keys.extend(f"{CAPACITY}:{dim}" for dim in failure.shortfall)
        else:
            keys.append(failure.code)
    return keys


@dataclass(frozen=True)
class Unlisted:
    """Runners of a decision that have no evaluation record of their own, as counts.

    ``refused``: runners refused without a record (by the store's prefilter on plain
    columns, or evaluated and elided from bounded evidence); ``reasons`` counts them per
    reason key (a code, or ``capacity:<dimension>``; a runner counts once per reason).
    ``compatible``: compatible runners elided from the evidence. ``not_evaluated``:
    runners that passed the prefilter but were never evaluated because they rank below
    the chosen runner by an upper bound of their ranking key.
    """

    refused: int = 0
    compatible: int = 0
    not_evaluated: int = 0
    reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.refused + self.compatible + self.not_evaluated

    def __bool__(self) -> bool:
        return self.total > 0

    def to_record(self) -> dict[str, Any]:
        return {
            "refused": self.refused,
            "compatible": self.compatible,
            "not_evaluated": self.not_evaluated,
            "reasons": {key: count for key, count in sorted(self.reasons.items()) if count},
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> Unlisted:
        if not record:
            return cls()
        return cls(
            int(record.get("refused", 0)),
            int(record.get("compatible", 0)),
            int(record.get("not_evaluated", 0)),
            {str(k): int(v) for k, v in dict(record.get("reasons", {})).items()},
        )

    def merged(self, other: Unlisted) -> Unlisted:
        reasons = Counter(self.reasons)
        reasons.update(other.reasons)
        return Unlisted(
            self.refused + other.refused,
            self.compatible + other.compatible,
            self.not_evaluated + other.not_evaluated,
            dict(reasons),
        )


EVIDENCE_PER_REASON = 8


def bounded_evidence(
    evaluations: Sequence[RunnerEvaluation],
    chosen_id: str | None,
    per_reason: int = EVIDENCE_PER_REASON,
) -> tuple[list[int], Unlisted]:
    """Which evaluations to record (indexes, in order) and counts for the others.

    Kept: the chosen runner, the first ``per_reason`` other compatible runners, and
    for every combination of reasons the first ``per_reason`` runners refused by it.
    Every reason that refused any runner therefore keeps at least one example.
    """
    kept: list[int] = []
    seen: Counter[tuple[str, ...]] = Counter()
    compatible = refused = 0
    reasons: Counter[str] = Counter()
    for index, evaluation in enumerate(evaluations):
        if evaluation.runner_id == chosen_id and evaluation.compatible:
            kept.append(index)
            continue
        combination = evaluation.reason_codes
        if seen[combination] < per_reason:
            seen[combination] += 1
            kept.append(index)
        elif evaluation.compatible:
            compatible += 1
        else:
            refused += 1
            reasons.update(reason_keys(evaluation))
    return kept, Unlisted(refused=refused, compatible=compatible, reasons=dict(reasons))


def refusal_counts(
    evaluations: Iterable[RunnerEvaluation], unlisted: Unlisted | None = None
) -> Counter[str]:
    """How many runners each reason refused; capacity is split per dimension."""
    counts: Counter[str] = Counter()
    for evaluation in evaluations:
        for key in reason_keys(evaluation):
            counts[reason_label(key)] += 1
    if unlisted is not None:
        for key, count in unlisted.reasons.items():
            if count:
                counts[reason_label(key)] += count
    return counts


def summarize_refusals(
    evaluations: Sequence[RunnerEvaluation], unlisted: Unlisted | None = None
) -> str:
    """kube-scheduler style: '0/12 runners are available: 5 insufficient memory_bytes, ...'.

    With ``unlisted`` counts (runners without a record of their own), the total counts
    them too, and runners never evaluated are named: '3/10000 runners are available
    (9950 not evaluated: ranked below the chosen runner): ...'.
    """
    extra = unlisted or Unlisted()
    if not evaluations and not extra:
        return ""
    available = sum(1 for evaluation in evaluations if evaluation.compatible) + extra.compatible
    counts = refusal_counts(evaluations, extra)
    head = f"{available}/{len(evaluations) + extra.total} runners are available"
    if extra.not_evaluated:
        head += f" ({extra.not_evaluated} not evaluated: ranked below the chosen runner)"
    if not counts:
        return head
    parts = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return head + ": " + ", ".join(f"{count} {label}" for label, count in parts)
