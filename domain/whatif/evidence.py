"""What "reproduced" means for one replayed decision, and how a decision is shown.

A recorded decision states a bounded amount of evidence (docs/events.md 7.3 and 7.4):
a home decision lists the chosen runner, a few compatible runners and a few runners per
combination of failed rules, and only counts the others (``unlisted``), some of them
per prefilter rule only. The replay evaluates every runner, so it can check exactly
what the record states and nothing it does not. The functions here return ``None``
when the replayed evidence agrees with the record, else the first disagreement in
words. docs/audit.md ("What reproduced means") states the same rules.

Views (:class:`DecisionView`) show one side of a decision in ``audit explain``'s
manner: outcome, summary, and the candidate lines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.placement.evidence import (
    ARCHITECTURE,
    BACKEND,
    CAPACITY,
    DRAINING,
    GUEST_PROTOCOL,
    HEARTBEAT_STALE,
    PREREQUISITE,
    CandidateRecord,
    RankKey,
    RunnerEvaluation,
    Unlisted,
    bounded_evidence,
    rank_record,
    reason_keys,
    summarize_refusals,
)
from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot

# Reason keys of the rules a store's SQL prefilter decides on plain columns
# (projections/candidates.py): a runner failing one of them is counted per these keys only.
PLAIN_KEYS = frozenset(
    {ARCHITECTURE, DRAINING, HEARTBEAT_STALE, BACKEND, GUEST_PROTOCOL}
    | {f"{CAPACITY}:{dim}" for dim in Capacity.DIMENSIONS}
)
# Codes that depend on the runner alone (and the heartbeat timeout), not on requirements.
RUNNER_CODES = frozenset({DRAINING, HEARTBEAT_STALE, BACKEND, PREREQUISITE})


def recorded_keys(evaluation: RunnerEvaluation) -> list[str]:
    """The reason keys a home decision's evidence counts for one refused runner: only its
    prefilter keys when it fails one (the store never evaluated its other rules), else
    every key (docs/events.md 7.3)."""
    keys = reason_keys(evaluation)
    plain = [key for key in keys if key in PLAIN_KEYS]
    return plain or keys


def _failures(record: CandidateRecord) -> list[tuple[str, dict[str, int]]]:
    return [
        (failure["code"], {k: int(v) for k, v in dict(failure.get("shortfall") or {}).items()})
        for failure in record["failures"]
    ]


def _evaluated(evaluation: RunnerEvaluation) -> list[tuple[str, dict[str, int]]]:
    return [(failure.code, dict(failure.shortfall)) for failure in evaluation.failures]


Lookup = Callable[[str], "tuple[RunnerEvaluation, RankKey | None] | None"]


def compare_candidates(candidates: Sequence[CandidateRecord], lookup: Lookup) -> str | None:
    """Every listed candidate is a runner the replay evaluated (``lookup``: its
    evaluation and rank, None for a runner not in the pool), with the same reason codes
    and capacity shortfalls and, when the record ranks it, the same ranking amounts."""
    seen: set[str] = set()
    for candidate in candidates:
        runner_id = candidate["runner_id"]
        if runner_id in seen:
            return f"candidate {runner_id!r} is listed twice"
        seen.add(runner_id)
        found = lookup(runner_id)
        if found is None:
            return f"candidate {runner_id!r} is not a runner of the pool in the replay"
        evaluation, key = found
        if _failures(candidate) != _evaluated(evaluation):
            recorded = [code for code, _ in _failures(candidate)] or "compatible"
            replayed = list(evaluation.reason_codes) or "compatible"
            return f"runner {runner_id!r}: recorded {recorded}, replayed {replayed}"
        stated = candidate.get("rank")
        if stated is not None and key is not None and dict(stated) != rank_record(key):
            replayed_rank = rank_record(key)
            return f"runner {runner_id!r}: recorded rank {dict(stated)}, replayed {replayed_rank}"
    return None


@dataclass(frozen=True)
class PoolCounts:
    """What the replay found over every runner of a pool: how many runners, how many
    fail each reason key (all of them, and those failing no prefilter key), how many
    are compatible."""

    size: int
    keys: Mapping[str, int]
    passing: Mapping[str, int]
    compatible: int


def compare_home_evidence(
    candidates: Sequence[CandidateRecord],
    unlisted: Unlisted,
    pool: PoolCounts,
    lookup: Lookup,
) -> str | None:
    """A home decision's evidence (docs/events.md 7.3) against the replay's evaluation of
    every runner of the pool. Checked: the listed candidates (:func:`compare_candidates`);
    listed plus unlisted is the pool; per prefilter key (:data:`PLAIN_KEYS`) the listed
    and unlisted counts are the replay's exactly; per other key the unlisted count lies
    between what the replay allows for a store that prefilters (at most
    ``not_evaluated`` fewer than the unlisted runners that pass the prefilter) and for
    one that evaluates the whole pool (all unlisted runners); the unlisted compatible and
    refused counts are at most the replay's (the rest are ``not_evaluated``)."""
    difference = compare_candidates(candidates, lookup)
    if difference:
        return difference
    if len(candidates) + unlisted.total != pool.size:
        return (
            f"the record counts {len(candidates) + unlisted.total} runners in the pool, "
            f"the replay {pool.size}"
        )
    listed: Counter[str] = Counter()
    listed_passing: Counter[str] = Counter()
    listed_compatible = 0
    for candidate in candidates:
        keys = reason_keys(RunnerEvaluation.from_record(candidate))
        listed.update(keys)
        if not keys:
            listed_compatible += 1
        elif not any(key in PLAIN_KEYS for key in keys):
            listed_passing.update(keys)
    skipped = unlisted.not_evaluated
    for key in sorted(set(pool.keys) | set(unlisted.reasons)):
        stated = unlisted.reasons.get(key, 0)
        everywhere = pool.keys.get(key, 0)
        if key in PLAIN_KEYS:
            if listed[key] + stated != everywhere:
                return (
                    f"{key}: the record counts {listed[key] + stated} runners, "
                    f"the replay {everywhere}"
                )
            continue
        anywhere = everywhere - listed[key]
        passing = pool.passing.get(key, 0) - listed_passing[key]
        if not (passing - skipped <= stated <= passing or stated == anywhere):
            return f"{key}: the record counts {stated} unlisted runners, the replay {anywhere}"
    compatible = pool.compatible - listed_compatible
    refused = pool.size - len(candidates) - compatible
    if unlisted.compatible > compatible or unlisted.refused > refused:
        return (
            f"unlisted: the record counts {unlisted.compatible} compatible and "
            f"{unlisted.refused} refused, the replay {compatible} and {refused}"
        )
    return None


def compare_runner_codes(
    candidates: Sequence[CandidateRecord],
    unlisted: Unlisted,
    snapshots: Mapping[str, RunnerSnapshot],
    runner_codes: Mapping[str, Iterable[str]],
) -> str | None:
    """What a refusal recorded without its requirements can still be checked against: the
    listed runners are runners of one pool and, with the unlisted ones, all of it; the
    codes that depend on the runner alone (:data:`RUNNER_CODES`) agree for every listed
    runner, and the prefilter counts of those codes agree for the pool. When no runner
    is listed (all were excluded by the prefilter), some pool must agree."""
    missing = [c["runner_id"] for c in candidates if c["runner_id"] not in snapshots]
    if missing:
        return f"candidate {missing[0]!r} is not a runner in the replay"
    pools = {snapshots[c["runner_id"]].pool_name for c in candidates}
    if len(pools) > 1:
        return f"the candidates belong to several pools {sorted(pools)}"
    if not pools:
        if not unlisted:
            return None  # an empty pool
        every = sorted({snapshot.pool_name for snapshot in snapshots.values()})
        found = [_pool_codes(p, candidates, unlisted, snapshots, runner_codes) for p in every]
        return None if None in found else "no pool of the replay has the counted runners"
    return _pool_codes(pools.pop(), candidates, unlisted, snapshots, runner_codes)


def _pool_codes(
    pool: str,
    candidates: Sequence[CandidateRecord],
    unlisted: Unlisted,
    snapshots: Mapping[str, RunnerSnapshot],
    runner_codes: Mapping[str, Iterable[str]],
) -> str | None:
    members = [runner_id for runner_id, s in snapshots.items() if s.pool_name == pool]
    if len(candidates) + unlisted.total != len(members):
        return (
            f"the record counts {len(candidates) + unlisted.total} runners in pool {pool!r}, "
            f"the replay {len(members)}"
        )
    counted: Counter[str] = Counter()
    for runner_id in members:
        counted.update(set(runner_codes[runner_id]) & (RUNNER_CODES & PLAIN_KEYS))
    for candidate in candidates:
        recorded = {code for code, _ in _failures(candidate)} & RUNNER_CODES
        replayed = set(runner_codes[candidate["runner_id"]]) & RUNNER_CODES
        if recorded != replayed:
            return (
                f"runner {candidate['runner_id']!r}: recorded {sorted(recorded)}, "
                f"replayed {sorted(replayed)}"
            )
        for code in recorded & PLAIN_KEYS:
            counted[code] -= 1
    for code in sorted(RUNNER_CODES & PLAIN_KEYS):
        if unlisted.reasons.get(code, 0) != counted[code]:
            return (
                f"{code}: the record counts {unlisted.reasons.get(code, 0)} unlisted runners, "
                f"the replay {counted[code]}"
            )
    return None


def _as_time(value: object) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def compare_placement_evidence(record: Mapping[str, Any], snapshot: RunnerSnapshot) -> str | None:
    """A placement's recorded view of its runner (docs/events.md 7.4) against the
    replay's: reserved before the placement, allocatable, drain phase, heartbeat."""
    checks = (
        ("reserved", dict(record.get("reserved", {})), snapshot.reserved.as_dict()),
        ("allocatable", dict(record.get("allocatable", {})), snapshot.allocatable.as_dict()),
        ("drain phase", record.get("drain_phase"), snapshot.drain_phase),
        ("heartbeat", _as_time(record.get("last_heartbeat_at")), snapshot.last_heartbeat_at),
    )
    for name, recorded, replayed in checks:
        if recorded != replayed:
            return f"runner {snapshot.id!r} {name}: recorded {recorded}, replayed {replayed}"
    return None


# -- views ----------------------------------------------------------------------------

OUTCOME_PLACED = "placed"
OUTCOME_REFUSED = "refused"
OUTCOME_SKIPPED = "skipped"  # the sandbox does not exist in the counterfactual
OUTCOME_KEPT = "kept"  # not replayable: carried over as recorded


@dataclass(frozen=True)
class DecisionView:
    """One side of a decision as ``audit explain`` shows it."""

    outcome: str
    runner_id: str | None = None
    error: str | None = None
    summary: str = ""
    candidates: tuple[dict[str, Any], ...] = ()

    @property
    def headline(self) -> str:
        if self.outcome == OUTCOME_PLACED:
            return f"placed on {self.runner_id}"
        if self.outcome == OUTCOME_REFUSED:
            return f"refused ({self.error})"
        if self.outcome == OUTCOME_SKIPPED:
            return "skipped: the sandbox was not created"
        return "kept as recorded"

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "runner_id": self.runner_id,
            "error": self.error,
            "summary": self.summary,
            "candidates": list(self.candidates),
        }


_ORDER = {"chosen": 0, "compatible, ranked lower": 1, "refused": 2}


def _lines(records: Iterable[CandidateRecord], chosen: str | None) -> tuple[dict[str, Any], ...]:
    lines: list[dict[str, Any]] = []
    for record in records:
        failures = [dict(failure) for failure in record["failures"]]
        if record["runner_id"] == chosen and not failures:
            verdict = "chosen"
        elif not failures:
            verdict = "compatible, ranked lower"
        else:
            verdict = "refused"
        lines.append({
            "runner_id": record["runner_id"], "verdict": verdict,
            "reasons": [{k: v for k, v in f.items() if k != "detail"} for f in failures],
            "rank": record.get("rank"),
        })  # fmt: skip
    lines.sort(key=lambda line: (_ORDER[line["verdict"]], line["runner_id"]))
    return tuple(lines)


def recorded_view(
    outcome: str,
    candidates: Sequence[CandidateRecord],
    unlisted: Unlisted,
    *,
    runner_id: str | None = None,
    error: str | None = None,
) -> DecisionView:
    """What the record states."""
    evaluations = [RunnerEvaluation.from_record(c) for c in candidates]
    return DecisionView(
        outcome,
        runner_id,
        error,
        summarize_refusals(evaluations, unlisted),
        _lines(candidates, runner_id),
    )


def replayed_view(
    outcome: str,
    evaluations: Sequence[RunnerEvaluation],
    ranks: Sequence[RankKey | None],
    *,
    runner_id: str | None = None,
    error: str | None = None,
    prefiltered: bool = False,
) -> DecisionView:
    """What the replay decided, its evidence bounded as a store records it: the best
    ranked compatible runners listed first; with ``prefiltered`` (a home decision),
    runners failing a prefilter rule are counted under those rules only, as a store with
    the read model counts them."""
    shown: list[int] = list(range(len(evaluations)))
    extra = Unlisted()
    if prefiltered:
        plain = Counter[str]()
        shown = []
        for index, evaluation in enumerate(evaluations):
            keys = [key for key in reason_keys(evaluation) if key in PLAIN_KEYS]
            if keys:
                plain.update(keys)
            else:
                shown.append(index)
        extra = Unlisted(refused=len(evaluations) - len(shown), reasons=dict(plain))
    ranked = sorted((ranks[i], i) for i in shown if i < len(ranks) and ranks[i] is not None)
    first = {i for _, i in ranked}
    shown = [i for _, i in ranked] + [i for i in shown if i not in first]
    kept, elided = bounded_evidence([evaluations[i] for i in shown], runner_id)
    records = []
    for position in kept:
        index = shown[position]
        record = evaluations[index].to_record()
        key = ranks[index] if index < len(ranks) else None
        if key is not None:
            record["rank"] = rank_record(key)
        records.append(record)
    summary = summarize_refusals([evaluations[shown[i]] for i in kept], extra.merged(elided))
    return DecisionView(outcome, runner_id, error, summary, _lines(records, runner_id))
