"""The candidates of a home decision: the SQL twin of the placement rules, and paging.

``create_sandbox`` chooses a sandbox's home runner over the whole pool. Reading every
runner of a large pool would make each creation cost the pool's size, so the runner
snapshots projection is asked instead for

1. the runners that pass the rules plain columns can decide (the SQL twin below: each
   clause names the Python rule of :mod:`secondbox_scheduler.domain.placement.rules` it
   mirrors; a clause may let through a runner the rule refuses, never the reverse),
2. best first by an upper bound of the ranking key (:func:`rank_bound`), a page at a
   time, until a page's last bound ranks below the best compatible runner found
   (:func:`home_candidates`, the page/stop rule).

Every runner not fetched then either fails a prefilter rule or ranks below the chosen
one, so the choice equals ``select_runner``'s over the whole pool; the runners not
fetched are counted in the decision's evidence (``Unlisted``). docs/architecture.md,
"Selection without reading the pool", gives the argument.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.placement.evidence import (
    ARCHITECTURE,
    BACKEND,
    CAPACITY,
    DRAINING,
    GUEST_PROTOCOL,
    HEARTBEAT_STALE,
    RankKey,
    Unlisted,
)
from secondbox_scheduler.domain.placement.ranking import rank_key
from secondbox_scheduler.domain.placement.rules import (
    CAPABILITY_COMPUTE,
    CAPABILITY_PHYSICAL_STORAGE_ADMISSION,
    PlacementDecision,
    decide,
)
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    Capacity,
    Requirements,
    RunnerSnapshot,
)
from secondbox_scheduler.projections.runner_snapshots import RunnerSnapshotsView, row_to_snapshot
from secondbox_scheduler.projections.sql_view import time_text

DIMENSIONS = Capacity.DIMENSIONS
FIRST_PAGE = 16  # candidates fetched first; each next page doubles


def home_candidates(
    view: RunnerSnapshotsView,
    requirements: Requirements,
    now: datetime,
    heartbeat_timeout: timedelta,
) -> tuple[list[RunnerSnapshot], Unlisted, RankKey | None, PlacementDecision | None]:
    """The runners to evaluate for a home decision, counts of the pool's others, the
    floor of the runners not fetched, and the placement rules' decision over exactly
    those runners when the page/stop rule made one (``decide`` without ``unlisted``;
    None when the rows ran out first), so that the home check need not make it again.

    The pool's runners that pass the SQL prefilter, best first by an upper bound of the
    ranking key, a page at a time until the page's last bound ranks below the best
    compatible runner found (or the rows run out). A lagging read model can only make
    the home choice worse, never unsafe: ``schedule`` decides against the aggregates.
    The floor: the bound of the last row fetched when the search stopped on a full
    page, so that every passing runner not fetched ranks at or below it by its row;
    None when the rows ran out (every passing runner was fetched).
    """
    stale_before = now - heartbeat_timeout
    counts, page = first_candidates(view, requirements, stale_before, FIRST_PAGE)
    candidates: list[RunnerSnapshot] = []
    offset, limit = 0, FIRST_PAGE
    floor: RankKey | None = None
    decision: PlacementDecision | None = None
    while True:
        if offset:
            page = candidate_page(view, requirements, stale_before, offset, limit)
        candidates.extend(snapshot for _, snapshot in page)
        if len(page) < limit:
            floor, decision = None, None
            break
        floor = page[-1][0]
        decision = decide(requirements, candidates, now, heartbeat_timeout)
        chosen = decision.chosen
        if chosen is not None and floor > rank_key(requirements, chosen):
            break
        offset, limit = offset + limit, limit * 2
    unlisted = Unlisted(
        refused=counts.excluded,
        not_evaluated=max(0, counts.passed - len(candidates)),
        reasons=counts.reasons,
    )
    return candidates, unlisted, floor, decision


def first_candidates(
    view: RunnerSnapshotsView, requirements: Requirements, stale_before: datetime, limit: int
) -> tuple[PoolCounts, list[tuple[RankKey, RunnerSnapshot]]]:
    """The pool's counts (its registered runners, how many pass the prefilter, per
    reason key how many fail that rule) and ``candidate_page(offset=0)``, in one scan of
    the pool: a narrow CTE of (id, failed-rule bitmask, bound keys) feeds both the counts
    per bitmask and the first ``limit`` passing ids; then those rows by primary key."""
    rules = prefilter_rules(requirements, stale_before, view.contains)
    flags = " + ".join(
        f"CASE WHEN {condition} THEN {1 << index} ELSE 0 END"
        for index, (_, condition, _) in enumerate(rules)
    )
    params: list[Any] = [p for _, _, condition_params in rules for p in condition_params]
    locality, locality_params = locality_bound(requirements, view.contains)
    params += [*locality_params, requirements.pool_name, limit]
    free = {dim: f"(allocatable_{dim} - reserved_{dim})" for dim in DIMENSIONS}
    rows = view.query(
        f"WITH pool AS (SELECT runner_id, ({flags}) AS flags, {locality} AS lb, "
        f"{free['instances']} AS fi, {free['vcpu_count']} AS fv, "
        f"{free['memory_bytes']} AS fm FROM {{table}} "
        "WHERE pool_name = %s AND deregistered = 0) "
        "SELECT flags, COUNT(*) AS n, NULL AS runner_id FROM pool GROUP BY flags "
        "UNION ALL SELECT * FROM (SELECT -1 AS flags, 0 AS n, runner_id FROM pool "
        f"WHERE flags = 0 ORDER BY lb DESC, fi DESC, fv DESC, fm DESC, {view.id_order} "
        "LIMIT %s) AS page",
        params,
    )
    ids = [row["runner_id"] for row in rows if row["flags"] < 0]
    counts = pool_counts([row for row in rows if row["flags"] >= 0], rules)
    page = []
    if ids:
        placeholders = ", ".join("%s" for _ in ids)
        found = view.query(
            f"SELECT *, {locality} AS locality_bound FROM {{table}} "
            f"WHERE runner_id IN ({placeholders}) AND deregistered = 0",
            [*locality_params, *ids],
        )
        page = sorted((rank_bound(row), row_to_snapshot(row)) for row in found)
    return counts, page


def candidate_page(
    view: RunnerSnapshotsView,
    requirements: Requirements,
    stale_before: datetime,
    offset: int,
    limit: int,
) -> list[tuple[RankKey, RunnerSnapshot]]:
    """Runners of the pool that pass the prefilter, best first by an upper bound of
    their ranking key (:func:`rank_bound`): artifact locality bounded
    by occurrences of each preferred digest in the JSON text, then free instances,
    vcpu, memory (descending) and id."""
    rules = prefilter_rules(requirements, stale_before, view.contains)
    where = ["pool_name = %s", "deregistered = 0"]
    params: list[Any] = [requirements.pool_name]
    for _, condition, condition_params in rules:
        where.append(f"NOT {condition}")
        params.extend(condition_params)
    locality, locality_params = locality_bound(requirements, view.contains)
    free = {dim: f"(allocatable_{dim} - reserved_{dim})" for dim in DIMENSIONS}
    rows = view.query(
        f"SELECT *, {locality} AS locality_bound FROM {{table}} "
        f"WHERE {' AND '.join(where)} ORDER BY locality_bound DESC, "
        f"{free['instances']} DESC, {free['vcpu_count']} DESC, "
        f"{free['memory_bytes']} DESC, {view.id_order} LIMIT %s OFFSET %s",
        [*locality_params, *params, limit, offset],
    )
    return [(rank_bound(row), row_to_snapshot(row)) for row in rows]


@dataclass(frozen=True)
class PoolCounts:
    """The prefilter's counts over one pool (see :func:`first_candidates`)."""

    pool_runners: int
    excluded: int
    reasons: dict[str, int]

    @property
    def passed(self) -> int:
        return self.pool_runners - self.excluded


def pool_counts(
    rows: Iterable[Mapping[str, Any]], rules: Sequence[tuple[str, str, list[Any]]]
) -> PoolCounts:
    """The counts of rows of (failed-rule bitmask ``flags``, runners ``n``) over
    ``rules`` (:func:`prefilter_rules`; bit ``i`` is rule ``i``)."""
    pool_runners = excluded = 0
    reasons = dict.fromkeys((key for key, _, _ in rules), 0)
    for row in rows:
        pool_runners += row["n"]
        if row["flags"]:
            excluded += row["n"]
        for index, (key, _, _) in enumerate(rules):
            if row["flags"] & (1 << index):
                reasons[key] += row["n"]
    return PoolCounts(pool_runners, excluded, reasons)


def locality_bound(requirements: Requirements, contains: str) -> tuple[str, list[Any]]:
    """SQL of an upper bound of the artifact locality: per distinct preferred digest,
    the non-overlapping occurrences of its JSON string in the ``artifact_digests`` text
    (every element equal to it is one; docs/architecture.md)."""
    terms, params = [], []
    for digest in sorted(set(requirements.preferred_artifact_digests)):
        pattern = json.dumps(digest)
        terms.append(
            f"CASE WHEN {contains.format(column='artifact_digests')} THEN "
            "(LENGTH(artifact_digests) - LENGTH(REPLACE(artifact_digests, %s, ''))) / %s ELSE 0 END"
        )
        params.extend([pattern, pattern, len(pattern)])
    return " + ".join(terms) or "0", params


def rank_bound(row: dict[str, Any]) -> RankKey:
    """An upper bound of a row's ranking key (``placement.rank_key``): the locality is
    bounded above by :func:`locality_bound`, the other parts are exact."""
    return (
        -int(row["locality_bound"]),
        -(row["allocatable_instances"] - row["reserved_instances"]),
        -(row["allocatable_vcpu_count"] - row["reserved_vcpu_count"]),
        -(row["allocatable_memory_bytes"] - row["reserved_memory_bytes"]),
        row["runner_id"],
    )


def _has_name(contains: str, column: str, name: str) -> tuple[str, list[Any]]:
    """True when the JSON list text of ``column`` contains ``"name"`` as a substring:
    case-sensitive on both databases, true whenever the list holds ``name`` (a superset
    test, so that excluding on its negation is safe)."""
    return contains.format(column=column), [json.dumps(name)]


def prefilter_rules(
    requirements: Requirements, stale_before: datetime, contains: str
) -> list[tuple[str, str, list[Any]]]:
    """(reason key, SQL condition true when the runner fails, params) for the rules of
    :mod:`secondbox_scheduler.domain.placement.rules` that plain columns decide. Each
    condition implies that the runner fails that rule, so excluding on it never hides a
    compatible runner; the other rules (pool is the WHERE clause; materialization,
    capability, prerequisite and egress need the JSON lists) are left to the Python rules,
    which evaluate every runner fetched. ``tests/test_selection.py`` checks that the
    twin chooses what ``select_runner`` chooses."""
    requested = requirements.capacity.as_dict()
    compute, compute_params = _has_name(contains, "capabilities", CAPABILITY_COMPUTE)
    admission, admission_params = _has_name(
        contains, "capabilities", CAPABILITY_PHYSICAL_STORAGE_ADMISSION
    )
    generation = requirements.guest_protocol_generation
    rules: list[tuple[str, str, list[Any]]] = [
        # placement._check_architecture: runner.architecture == requirements.architecture
        (ARCHITECTURE, "architecture <> %s", [requirements.architecture]),
        # placement._check_draining: runner.drain_phase == "active"
        (DRAINING, "drain_phase <> %s", [DRAIN_PHASE_ACTIVE]),
        # placement._check_heartbeat: last_heartbeat_at >= now - heartbeat_timeout (ISO
        # text of UTC times in one format compares as the times do)
        (
            HEARTBEAT_STALE,
            "(last_heartbeat_at IS NULL OR last_heartbeat_at < %s)",
            [time_text(stale_before)],
        ),
        # placement._check_backend: backend kind not empty and capability "compute"
        # (the substring test is a superset test: it may pass a runner the rule refuses)
        (BACKEND, f"(backend_kind = '' OR NOT {compute})", compute_params),
        # placement._check_guest_protocol: generation >= 1 and within [minimum, maximum]
        (
            GUEST_PROTOCOL,
            "(%s < 1 OR guest_protocol_minimum > %s OR guest_protocol_maximum < %s)",
            [generation, generation, generation],
        ),
    ]
    # placement._check_capacity: free >= requested on every checked dimension; disk is
    # unchecked with "physical-storage-admission" (placement.checked_dimensions); the
    # reserved-total limit of an unchecked dimension (placement.reserved_total_overflow)
    # is left to the Python rule
    for dim in DIMENSIONS:
        shortfall = f"allocatable_{dim} - reserved_{dim} < %s"
        if dim == "disk_bytes":
            rules.append(
                (
                    f"{CAPACITY}:{dim}",
                    f"({shortfall} AND NOT {admission})",
                    [requested[dim], *admission_params],
                )
            )
        else:
            rules.append((f"{CAPACITY}:{dim}", shortfall, [requested[dim]]))
    return rules
