"""Placement policy of docs/spec.md (section 3): pure functions, no I/O, no clock.

A chain of small feasibility checks, each with one job and a stable reason code
(Nomad's feasibility checkers, kube-scheduler's Filter plugins), then one ranking
key. Every check runs for every runner, so a decision can later be explained by
every rule a runner failed, not only the first. The evidence a decision produces (reason
codes, evaluations, summaries, decision records) is :mod:`.evidence`; the SQL twin of the
rules that plain columns decide, which prefilters a pool, is
``projections/candidates.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from secondbox_scheduler.domain.errors import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    PlacementError,
)
from secondbox_scheduler.domain.limits import MAX_RESERVED_TOTAL
from secondbox_scheduler.domain.placement.evidence import (
    ARCHITECTURE,
    BACKEND,
    CAPABILITY,
    CAPACITY,
    DRAINING,
    EGRESS,
    GUEST_PROTOCOL,
    HEARTBEAT_STALE,
    MATERIALIZATION,
    POOL,
    PREREQUISITE,
    REASON_CODES,
    HomeDecisionRecord,
    RankKey,
    RuleFailure,
    RunnerEvaluation,
    Unlisted,
    bounded_evidence,
    decision_record,
    ranked_candidates,
    summarize_refusals,
)
from secondbox_scheduler.domain.placement.ranking import RankingPolicy, rank_key_for
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    require_aware,
)

CAPABILITY_COMPUTE = "compute"
CAPABILITY_CLIENT_SELECTED_IMAGE = "client-selected-image"
CAPABILITY_PHYSICAL_STORAGE_ADMISSION = "physical-storage-admission"
PREREQUISITE_CAPABILITIES = ("network-policy", "storage", "cleanup", "local-workspace")
RULES_VERSION = 2  # 1: release 0.1 (see evaluate_runner); recorded with every placement


@dataclass(frozen=True)
class _Context:
    requirements: Requirements
    stale_before: datetime
    preferred: frozenset[str]
    rules_version: int = RULES_VERSION


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
    digests = requirements.preferred_artifact_digests
    client_selected = CAPABILITY_CLIENT_SELECTED_IMAGE in requirements.required_capabilities
    if client_selected and ctx.rules_version < 2:  # release 0.1 skipped the whole rule
        return None
    if len(digests) != 2:  # always, also when the client selects the image
        return RuleFailure(
            MATERIALIZATION,
            f"preferred artifact digests must be exactly [runtime, toolchain], got {len(digests)}",
        )
    if client_selected:
        return None
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


def reserved_total_overflow(
    reserved: Mapping[str, int], requested: Mapping[str, int]
) -> dict[str, int]:
    """Per dimension, checked or not, how far ``reserved + requested`` would pass
    ``MAX_RESERVED_TOTAL`` (empty: within it). On a checked dimension allocatable is at
    most that, so only an unchecked one (disk with "physical-storage-admission") can."""
    return {
        dim: reserved[dim] + amount - MAX_RESERVED_TOTAL
        for dim, amount in requested.items()
        if reserved[dim] + amount > MAX_RESERVED_TOTAL
    }


def _check_capacity(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    reserved, requested = runner.reserved.as_dict(), ctx.requirements.capacity.as_dict()
    shortfall = capacity_shortfall(
        runner.allocatable.as_dict(), reserved, requested, checked_dimensions(runner.capabilities)
    )
    overflow = reserved_total_overflow(reserved, requested)
    if overflow:  # an unchecked dimension past the reserved-total limit is short too
        shortfall = {**overflow, **shortfall}
    if not shortfall:
        return None
    detail = ", ".join(f"{dim} short by {amount}" for dim, amount in shortfall.items())
    return RuleFailure(CAPACITY, f"insufficient capacity: {detail}", shortfall)


def _check_egress(ctx: _Context, runner: RunnerSnapshot) -> RuleFailure | None:
    wanted = ctx.requirements.egress_context
    if wanted is None or wanted in runner.supported_egress_contexts:
        return None
    return RuleFailure(EGRESS, f"egress context {wanted!r} is not supported")


_CHECK_OF: dict[str, Check] = {
    POOL: _check_pool,
    ARCHITECTURE: _check_architecture,
    DRAINING: _check_draining,
    HEARTBEAT_STALE: _check_heartbeat,
    BACKEND: _check_backend,
    MATERIALIZATION: _check_materialization,
    GUEST_PROTOCOL: _check_guest_protocol,
    CAPABILITY: _check_capabilities,
    PREREQUISITE: _check_prerequisites,
    CAPACITY: _check_capacity,
    EGRESS: _check_egress,
}
# Every rule, in the order of its reason code (evidence.REASON_CODES).
CHECKS: tuple[tuple[str, Check], ...] = tuple((code, _CHECK_OF[code]) for code in REASON_CODES)


def _stale_before(now: datetime, heartbeat_timeout: timedelta) -> datetime:
    """The time before which a heartbeat is stale (refusing a naive ``now`` and a
    timeout that is not a timedelta or reaches before the first representable time)."""
    now = require_aware("now", now)
    if not isinstance(heartbeat_timeout, timedelta):
        raise InvalidRequestError("heartbeat_timeout", "must be a timedelta", heartbeat_timeout)
    try:
        return now - heartbeat_timeout
    except OverflowError:
        raise InvalidRequestError(
            "heartbeat_timeout", "reaches before the first representable time"
        ) from None


def _context(
    requirements: Requirements,
    now: datetime,
    heartbeat_timeout: timedelta,
    rules_version: int = RULES_VERSION,
) -> _Context:
    return _Context(
        requirements=requirements,
        stale_before=_stale_before(now, heartbeat_timeout),
        preferred=frozenset(requirements.preferred_artifact_digests),
        rules_version=rules_version,
    )


def evaluate_runner(
    requirements: Requirements,
    runner: RunnerSnapshot,
    now: datetime,
    heartbeat_timeout: timedelta,
    *,
    rules_version: int = RULES_VERSION,
) -> RunnerEvaluation:
    """Every rule of docs/spec.md (section 3) that ``runner`` fails (none: compatible).

    ``rules_version``: the rules a recorded decision was made by (audit replays); 1 is
    release 0.1's, where ``client-selected-image`` skipped the whole materialization
    rule, the preferred digests' count included."""
    return _evaluate(_context(requirements, now, heartbeat_timeout, rules_version), runner)


def passes_every_rule(
    requirements: Requirements,
    runner: RunnerSnapshot,
    now: datetime,
    heartbeat_timeout: timedelta,
    *,
    rules_version: int = RULES_VERSION,
) -> bool:
    """True only when :func:`evaluate_runner` finds no failure: every rule's condition
    of passing, as its check states it, tested in one go without building a failure
    (an audit replay re-checks every placement, and placements pass). False may still
    be a compatible runner (the cheap test of one rule did not settle it): call
    :func:`evaluate_runner` then, which names each failure. Raises what
    :func:`evaluate_runner` raises for ``now`` and ``heartbeat_timeout``.
    ``tests/test_rules_in_one_go.py`` holds it to :func:`evaluate_runner`."""
    return passes_on_fields(
        requirements, now, heartbeat_timeout, rules_version,
        runner.pool_name, runner.architecture, runner.drain_phase, runner.last_heartbeat_at,
        runner.backend_kind, runner.capabilities, runner.guest_protocol_minimum,
        runner.guest_protocol_maximum, runner.supported_egress_contexts,
        runner.materializations, runner.allocatable.as_dict(), runner.reserved.as_dict(),
    )  # fmt: skip


def passes_on_fields(
    requirements: Requirements,
    now: datetime,
    heartbeat_timeout: timedelta,
    rules_version: int,
    pool_name: str,
    architecture: str,
    drain_phase: str,
    seen: datetime | None,
    backend_kind: str,
    capabilities: frozenset[str],
    guest_protocol_minimum: int,
    guest_protocol_maximum: int,
    supported_egress_contexts: Sequence[str],
    materializations: Sequence[MaterializationSnapshot],
    a: Mapping[str, int],
    r: Mapping[str, int],
) -> bool:
    """:func:`passes_every_rule` on a runner given field by field, its allocatable and
    reserved capacity ``a`` and ``r`` as dimension mappings (``Capacity.as_dict()``):
    what the audit fold calls with its own state when a placement's evidence is
    exactly that state (``domain/audit/evidence.py``), without a snapshot built."""
    stale_before = _stale_before(now, heartbeat_timeout)
    wanted = requirements
    if not (
        pool_name == wanted.pool_name  # pool
        and architecture == wanted.architecture  # architecture
        and drain_phase == DRAIN_PHASE_ACTIVE  # draining
        and seen is not None
        and seen >= stale_before  # heartbeat_stale
        and backend_kind
        and CAPABILITY_COMPUTE in capabilities  # backend
        and wanted.guest_protocol_generation >= 1  # guest_protocol
        and guest_protocol_minimum
        <= wanted.guest_protocol_generation
        <= guest_protocol_maximum
        and wanted.required_capabilities <= capabilities  # capability
        and capabilities.issuperset(PREREQUISITE_CAPABILITIES)  # prerequisite
        and (wanted.egress_context is None  # egress
             or wanted.egress_context in supported_egress_contexts)
    ):  # fmt: skip
        return False
    # materialization, in the order its check reads
    digests = wanted.preferred_artifact_digests
    client_selected = CAPABILITY_CLIENT_SELECTED_IMAGE in wanted.required_capabilities
    if not (client_selected and rules_version < 2):
        if len(digests) != 2:
            return False
        if not client_selected:
            runtime, toolchain = digests
            for item in materializations:
                if (
                    item.backend_kind == backend_kind
                    and item.architecture == architecture
                    and item.runtime_digest == runtime
                    and item.toolchain_digest == toolchain
                    and item.digest
                ):
                    break
            else:
                return False
    # capacity, read as _check_capacity reads it, one dimension of Capacity.DIMENSIONS
    # after the other (spelled out: no loop; the test checks the five): it fits on every
    # checked dimension (disk is not checked with physical-storage admission), and the
    # reserved total stays within the limit on every one
    q = wanted.capacity
    av, am, ad, ai, ao = (a["vcpu_count"], a["memory_bytes"], a["disk_bytes"],
                          a["instances"], a["operations"])  # fmt: skip
    rv, rm, rd, ri, ro = (r["vcpu_count"], r["memory_bytes"], r["disk_bytes"],
                          r["instances"], r["operations"])  # fmt: skip
    return not (
        q.vcpu_count > av - rv
        or q.memory_bytes > am - rm
        or (q.disk_bytes > ad - rd
            and CAPABILITY_PHYSICAL_STORAGE_ADMISSION not in capabilities)
        or q.instances > ai - ri
        or q.operations > ao - ro
        or rv + q.vcpu_count > MAX_RESERVED_TOTAL
        or rm + q.memory_bytes > MAX_RESERVED_TOTAL
        or rd + q.disk_bytes > MAX_RESERVED_TOTAL
        or ri + q.instances > MAX_RESERVED_TOTAL
        or ro + q.operations > MAX_RESERVED_TOTAL
    )  # fmt: skip


def _evaluate(ctx: _Context, runner: RunnerSnapshot) -> RunnerEvaluation:
    failures = tuple(failure for _, check in CHECKS if (failure := check(ctx, runner)) is not None)
    return RunnerEvaluation(runner.id, failures)


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
    # per evaluation, the ranking key of a compatible runner (None for a refused one)
    ranks: tuple[RankKey | None, ...] = ()

    @property
    def compatible_count(self) -> int:
        return sum(1 for evaluation in self.evaluations if evaluation.compatible)

    def summary(self) -> str:
        return summarize_refusals(self.evaluations, self.unlisted)


# -- decision records (what events carry; docs/events.md section 7) -------------


def decide(
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime,
    heartbeat_timeout: timedelta,
    unlisted: Unlisted | None = None,
    *,
    policy: RankingPolicy | None = None,
) -> PlacementDecision:
    """Evaluate every runner and pick the best compatible one, without raising.

    ``unlisted``: counts of the pool's runners not passed in (a store's prefilter); they
    are only carried as evidence, never chosen. ``policy``: another order of the
    compatible runners (``domain/placement/ranking.py``); by default that of docs/spec.md
    (section 3). ``ranks`` always holds the section 3 keys (what decision records state).
    """
    ctx = _context(requirements, now, heartbeat_timeout)
    evaluations = tuple(_evaluate(ctx, runner) for runner in runners)
    ranks = tuple(
        rank_key_for(ctx.preferred, runner) if evaluation.compatible else None
        for runner, evaluation in zip(runners, evaluations, strict=True)
    )
    compatible = [(key, index) for index, key in enumerate(ranks) if key is not None]
    chosen = runners[min(compatible)[1]] if compatible else None
    if policy is not None and compatible:
        chosen = runners[min((policy.key(requirements, runners[i]), i) for _, i in compatible)[1]]
    return PlacementDecision(chosen, evaluations, unlisted or Unlisted(), ranks)


def with_unlisted(decision: PlacementDecision, unlisted: Unlisted | None) -> PlacementDecision:
    """``decision`` as :func:`decide` makes it over the same runners with ``unlisted``
    (the counts are only carried: every other field is the same)."""
    return replace(decision, unlisted=unlisted or Unlisted())


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
    *,
    policy: RankingPolicy | None = None,
) -> RunnerSnapshot:
    """Hard compatibility first, then locality and stable identity ordering (or
    ``policy``'s order, ``domain/placement/ranking.py``)."""
    decision = decide(requirements, runners, now, heartbeat_timeout, policy=policy)
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


def home_decision_record(
    decision: PlacementDecision, now: datetime, heartbeat_timeout: timedelta
) -> HomeDecisionRecord:
    """The evidence of a home decision (docs/events.md 7.3): bounded candidate records,
    and ``unlisted`` counts for the pool's runners without a record."""
    assert decision.chosen is not None
    kept, elided = bounded_evidence(decision.evaluations, decision.chosen.id)
    candidates = ranked_candidates(
        [decision.evaluations[i] for i in kept], [decision.ranks[i] for i in kept]
    )
    return {
        **decision_record(now, heartbeat_timeout, decision.chosen.id, candidates),
        "unlisted": decision.unlisted.merged(elided).to_record(),
    }
