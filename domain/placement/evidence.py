"""Placement's evidence vocabulary: what a decision records and how it is summarised.

Reason codes and their labels, one rule's failure, one runner's evaluation, the counts of
runners without a record of their own, bounded evidence, refusal summaries in
kube-scheduler's manner, and the decision records that events carry (docs/events.md
section 7). The rules themselves, which produce this evidence, are in
:mod:`secondbox_scheduler.domain.placement.rules`; the audit fold and ``audit explain`` read it
back. This module imports only the value types, and only for their names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal, NotRequired, TypedDict

from secondbox_scheduler.domain.records import RunnerSnapshotRecord

# Reason codes of the placement rules (docs/spec.md, section 3), in the order the rules run.
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
REASON_CODES: tuple[str, ...] = (
    POOL,
    ARCHITECTURE,
    DRAINING,
    HEARTBEAT_STALE,
    BACKEND,
    MATERIALIZATION,
    GUEST_PROTOCOL,
    CAPABILITY,
    PREREQUISITE,
    CAPACITY,
    EGRESS,
)

# The ranking key of a compatible runner, smaller is better (docs/spec.md, section 3):
# (-artifact locality, -free instances, -free vcpu, -free memory, runner id).
RankKey = tuple[int, int, int, int, str]
RankField = Literal["artifact_locality", "free_instances", "free_vcpu_count", "free_memory_bytes"]
# How decision records name the first four parts (as the positive amounts they are).
RANK_FIELDS: tuple[RankField, ...] = (
    "artifact_locality",
    "free_instances",
    "free_vcpu_count",
    "free_memory_bytes",
)


class RankRecord(TypedDict, total=False):
    """The ``rank`` of a candidate record: the ranking key's first four parts by name
    (:data:`RANK_FIELDS`). :func:`rank_record` writes all four; a reader counts a
    missing amount as 0 (:func:`rank_key_from_record`)."""

    artifact_locality: int
    free_instances: int
    free_vcpu_count: int
    free_memory_bytes: int


def rank_record(key: RankKey) -> RankRecord:
    """The ``rank`` of a candidate record: the ranking key's amounts by name."""
    return {
        "artifact_locality": -key[0],
        "free_instances": -key[1],
        "free_vcpu_count": -key[2],
        "free_memory_bytes": -key[3],
    }


def rank_key_from_record(runner_id: str, rank: RankRecord | None) -> tuple[int | str, ...]:
    """The ranking key a candidate record states (missing amounts count as 0)."""
    stated: RankRecord = rank or {}
    # the four of RANK_FIELDS, in its order (no generator: the audit ranks every home
    # decision's candidates)
    return (
        -int(stated.get("artifact_locality", 0)),
        -int(stated.get("free_instances", 0)),
        -int(stated.get("free_vcpu_count", 0)),
        -int(stated.get("free_memory_bytes", 0)),
        runner_id,
    )


class RuleFailureRecord(TypedDict):
    """One rule a runner failed, as decision records carry it (:meth:`RuleFailure.to_record`)."""

    code: str
    detail: str
    shortfall: NotRequired[dict[str, int]]  # capacity only: per dimension, how much is missing


class CandidateRecord(TypedDict):
    """One runner's evaluation as decision records carry it (:meth:`RunnerEvaluation.to_record`;
    ``failures`` empty: compatible), with its ``rank`` when the decision ranked it (a
    compatible runner of a home decision: :func:`ranked_candidates`)."""

    runner_id: str
    failures: list[RuleFailureRecord]
    rank: NotRequired[RankRecord]


class UnlistedRecord(TypedDict, total=False):
    """:meth:`Unlisted.to_record`: the counts of a decision's runners without a candidate
    record. Written with every key; a reader counts a missing one as 0 (or empty)
    (:meth:`Unlisted.from_record`)."""

    refused: int
    compatible: int
    not_evaluated: int
    reasons: dict[str, int]  # by reason key (a code, or capacity:<dimension>)


@dataclass(frozen=True)
class RuleFailure:
    """One rule a runner failed: its reason code and a human detail.

    ``shortfall`` is set for ``capacity``: per dimension, how much is missing.
    """

    code: str
    detail: str
    shortfall: Mapping[str, int] = field(default_factory=dict)

    def to_record(self) -> RuleFailureRecord:
        record: RuleFailureRecord = {"code": self.code, "detail": self.detail}
        if self.shortfall:
            record["shortfall"] = dict(self.shortfall)
        return record

    @classmethod
    def from_record(cls, record: RuleFailureRecord) -> RuleFailure:
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

    def to_record(self) -> CandidateRecord:
        return {
            "runner_id": self.runner_id,
            "failures": [failure.to_record() for failure in self.failures],
        }

    @classmethod
    def from_record(cls, record: CandidateRecord) -> RunnerEvaluation:
        return cls(
            record["runner_id"],
            tuple(RuleFailure.from_record(f) for f in record["failures"]),
        )


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

    def to_record(self) -> UnlistedRecord:
        return {
            "refused": self.refused,
            "compatible": self.compatible,
            "not_evaluated": self.not_evaluated,
            "reasons": {key: count for key, count in sorted(self.reasons.items()) if count},
        }

    @classmethod
    def from_record(cls, record: UnlistedRecord | None) -> Unlisted:
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


class DecisionRecord(TypedDict):
    """The common part of a placement's evidence (:func:`decision_record`)."""

    decided_at: datetime
    heartbeat_timeout_seconds: float
    chosen_runner_id: str
    candidates: list[CandidateRecord]


class HomeDecisionRecord(DecisionRecord):
    """A home decision's evidence (docs/events.md 7.3; ``Sandbox.Created.home_decision``):
    bounded candidate records and the counts of the pool's other runners."""

    unlisted: NotRequired[UnlistedRecord]  # absent before bounded evidence (all listed)


class PlacementRecord(DecisionRecord):
    """A fence's evidence (docs/events.md 7.4; ``Sandbox.AssignmentFenced.placement``): the
    home runner as the placement read it, the versions of its streams it read, what it
    reserved, and the rules it was judged by."""

    home_runner_id: str
    runner: RunnerSnapshotRecord  # the runner as it was read
    runner_version: int
    lease_version: int
    requested: dict[str, int]  # Capacity.as_dict()
    attempt: int
    clock: NotRequired[datetime]  # the application's clock at the decision (since 0.2)
    # the placement rules' version (since 0.2; absent from 0.1's stored events, whose
    # upcast sets 1; read with that default)
    rules_version: NotRequired[int]


def decision_record(
    now: datetime,
    heartbeat_timeout: timedelta,
    chosen: str,
    candidates: list[CandidateRecord] | None = None,
) -> DecisionRecord:
    """The common part of a placement's evidence: when, with which heartbeat timeout,
    which runner, and the candidate records."""
    return {
        "decided_at": now,
        "heartbeat_timeout_seconds": heartbeat_timeout.total_seconds(),
        "chosen_runner_id": chosen,
        "candidates": candidates or [],
    }


def ranked_candidates(
    evaluations: Sequence[RunnerEvaluation], ranks: Sequence[RankKey | None]
) -> list[CandidateRecord]:
    """Candidate records; compatible ones carry the ranking keys they were ordered by."""
    records = []
    for evaluation, key in zip(evaluations, ranks, strict=True):
        record = evaluation.to_record()
        if evaluation.compatible and key is not None:
            record["rank"] = rank_record(key)
        records.append(record)
    return records
