"""A home decision when no runner of the pool can match: refused without reading the pool.

``home_candidates`` (:mod:`.candidates`) reads the pool best first until the rest
provably rank lower. When nothing is compatible nothing ranks, so it read, parsed and
evaluated every runner that passes the SQL prefilter: 14 to 18 s for a toolchain digest
that none of 50,000 runners has. Before it, :func:`unmatched_candidates`:

1. **May any runner match?** (:func:`may_match`) One look-up for a runner of the pool
   that passes the prefilter and whose JSON lists may pass the rules the prefilter leaves
   to Python: an item of the requested runtime and toolchain digests in its
   materializations (jsonb containment through a GIN index on PostgreSQL, the digests'
   JSON strings on SQLite), every required and prerequisite capability and the egress
   context as JSON strings in their lists. Each test is necessary for its rule (a
   superset test), so when no runner passes them all, none is compatible. On SQLite a
   digest pair no runner has is found first in a side table of the materializations'
   digests (``materialized_nowhere``): one index look-up instead of a scan.
2. **The refusal's evidence, as a full scan records it** (:func:`refusal_candidates`).
   The refusal of a full scan records the first :data:`EVIDENCE_PER_REASON` runners (in
   candidate order) of every combination of failed rules and counts the others
   (``Unlisted``). The rules left to Python read only a row's backend, architecture,
   capabilities, materializations and egress contexts, and (capacity) per dimension
   whether its disk is short and whether the request would pass the reserved-total limit;
   the prefilter's rules pass exactly on the rows that pass it. So runners alike in those
   columns fail the same rules. One statement, grouped by the prefilter's failed-rule
   bitmask only, gives the prefilter's counts (as ``first_candidates``) and, over the
   rows that pass it, one id and each ALIKE column's least and greatest value
   (:meth:`_Sql.alike_survey`): when they are equal, every passing runner is alike, and a
   second statement reads the first :data:`PREFIX` of them in candidate order (beside the
   first where the store serves two reads at once: ``parallel_reads``). Where an index
   of the pool's registered runners by the ALIKE columns has equal first and last
   entries (``alike_in_pool``), the survey leaves the texts out (they cost it most of its
   time); on SQLite the first rows are then read in the survey's snapshot, without the
   prefilter's test when every runner passes it and without the locality term when all
   share their artifact digests (:func:`_alike`). Otherwise
   one statement gives the counts again and, among the passing rows, each group of alike
   runners' size and one id, and the first :data:`PREFIX` ids in candidate order
   (:meth:`_Sql.survey`). Only those
   runners are read and evaluated; per combination of failed rules the first
   :data:`EVIDENCE_PER_REASON` of them are the runners a full scan keeps, and the groups'
   sizes give the counts of the others. The candidates returned are exactly the runners
   a full scan's refusal keeps, and the counts exactly its ``Unlisted``: the refusal is
   the same, evidence included (``tests/test_unmatched.py`` compares them).

Either step gives up (``None``: the caller pages as before) when a runner may match, a
fetched runner is compatible after all (a row changed meanwhile), alike runners fail
different rules, or the pool has more than :data:`MAX_GROUPS` groups of alike runners.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.limits import MAX_RESERVED_TOTAL
from secondbox_scheduler.domain.placement.evidence import (
    EVIDENCE_PER_REASON,
    RankKey,
    RunnerEvaluation,
    Unlisted,
    reason_keys,
)
from secondbox_scheduler.domain.placement.rules import (
    CAPABILITY_CLIENT_SELECTED_IMAGE,
    PREREQUISITE_CAPABILITIES,
    decide,
)
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot
from secondbox_scheduler.projections.candidates import (
    DIMENSIONS,
    PoolCounts,
    locality_bound,
    pool_counts,
    prefilter_rules,
    rank_bound,
)
from secondbox_scheduler.projections.runner_snapshots import RunnerSnapshotsView, row_to_snapshot

MAX_GROUPS = 64  # groups of alike runners beyond which the caller pages instead
PREFIX = 2 * EVIDENCE_PER_REASON  # passing runners read best first with the survey
MAX_SEARCHED = 4  # combinations whose first runners the prefix lacks, read each apart
FREE_ORDER = ("instances", "vcpu_count", "memory_bytes")  # candidate order after locality
# The columns the rules left to Python read (besides the capacity bits).
ALIKE = RunnerSnapshotsView.ALIKE


def unmatched_candidates(
    view: RunnerSnapshotsView,
    requirements: Requirements,
    now: datetime,
    heartbeat_timeout: timedelta,
) -> tuple[list[RunnerSnapshot], Unlisted] | None:
    """The candidates and counts of the refusal a full scan would give, when no runner
    of the pool may match; ``None`` when one may (or the shortcut gives up)."""
    if may_match(view, requirements, now - heartbeat_timeout):
        return None
    return refusal_candidates(view, requirements, now, heartbeat_timeout)


def may_match(
    view: RunnerSnapshotsView, requirements: Requirements, stale_before: datetime
) -> bool:
    """Whether a runner of the pool passes the prefilter and the superset tests of the
    rules left to Python (materialization, capability, prerequisite, egress)."""
    digests = requirements.preferred_artifact_digests
    if len(digests) != 2:  # the materialization rule refuses every runner
        return False
    # the superset tests first: the one a refused request fails is then, on SQLite
    # (which keeps the order), the only one a row pays for
    where = ["pool_name = %s", "deregistered = 0"]
    params: list[Any] = [requirements.pool_name]
    if CAPABILITY_CLIENT_SELECTED_IMAGE not in requirements.required_capabilities:
        if view.materialized_nowhere(*digests):  # SQLite: one look-up in a side table
            return False
        test, test_params = view.materialization_test(*digests)
        where.append(f"({test})")
        params += test_params
    wanted = {
        "capabilities": sorted(requirements.required_capabilities | {*PREREQUISITE_CAPABILITIES})
    }
    if requirements.egress_context is not None:
        wanted["supported_egress_contexts"] = [requirements.egress_context]
    for column, names in wanted.items():
        for name in names:
            where.append(view.contains.format(column=column))
            params.append(json.dumps(name))
    for _, condition, condition_params in prefilter_rules(
        requirements, stale_before, view.contains
    ):
        where.append(f"NOT {condition}")
        params += condition_params
    rows = view.query(
        f"SELECT 1 AS found FROM {{table}} WHERE {' AND '.join(where)} LIMIT 1", params
    )
    return bool(rows)


def _capacity_bits(requirements: Requirements) -> tuple[str, list[Any]]:
    """SQL of the capacity rule's parts the prefilter leaves to Python, as bits: 1 when
    the disk is short (checked unless the runner has "physical-storage-admission", which
    the prefilter tests only as a substring), 2 << i when the request would take
    dimension i's reserved total past ``MAX_RESERVED_TOTAL``."""
    requested = requirements.capacity.as_dict()
    terms = ["CASE WHEN allocatable_disk_bytes - reserved_disk_bytes < %s THEN 1 ELSE 0 END"]
    params: list[Any] = [requested["disk_bytes"]]
    for index, dim in enumerate(DIMENSIONS):
        terms.append(f"CASE WHEN reserved_{dim} > %s THEN {2 << index} ELSE 0 END")
        params.append(MAX_RESERVED_TOTAL - requested[dim])
    return " + ".join(terms), params


Group = tuple[Any, ...]  # the ALIKE columns' values and the capacity bits


def _group(row: dict[str, Any]) -> Group:
    return (*(row[column] for column in ALIKE), row["cb"])


class _Sql:
    """The statements of :func:`refusal_candidates` for one request."""

    def __init__(
        self, view: RunnerSnapshotsView, requirements: Requirements, stale_before: datetime
    ) -> None:
        self.rules = prefilter_rules(requirements, stale_before, view.contains)
        self.id_order = view.id_order
        self.flags = " + ".join(
            f"CASE WHEN {condition} THEN {1 << index} ELSE 0 END"
            for index, (_, condition, _) in enumerate(self.rules)
        )
        self.rule_params = [p for _, _, condition_params in self.rules for p in condition_params]
        self.passing = " AND ".join(f"NOT {condition}" for _, condition, _ in self.rules)
        self.locality, self.locality_params = locality_bound(requirements, view.contains)
        self.bits, self.bits_params = _capacity_bits(requirements)
        self.pool_name = requirements.pool_name
        free = [f"(allocatable_{dim} - reserved_{dim}) DESC" for dim in FREE_ORDER]
        # (no preferred digest: no locality term, which SQLite would read as a column number)
        locality = [] if self.locality == "0" else [f"{self.locality} DESC"]
        self.order = ", ".join([*locality, *free, view.id_order])
        self.free_order = ", ".join([*free, view.id_order])
        self.fence = view.subquery_fence

    def _best_passing(
        self, extra: str, extra_params: list[Any], limit: int
    ) -> tuple[str, list[Any]]:
        """The ids of the first ``limit`` rows passing the prefilter (and ``extra``), in
        candidate order (``candidate_page``'s)."""
        return (
            "SELECT runner_id FROM {table} WHERE pool_name = %s AND deregistered = 0 AND "
            f"{self.passing}{extra} ORDER BY {self.order} LIMIT %s",
            [self.pool_name, *self.rule_params, *extra_params, *self.locality_params, limit],
        )

    def survey(self, limit: int) -> tuple[str, list[Any]]:
        """Per failed-rule bitmask (and, for the rows passing the prefilter, per group of
        alike runners) the runners and one id; then the ids of the first ``limit``
        passing rows in candidate order, with ``flags`` -1."""
        grouped = ", ".join(
            f"CASE WHEN flags = 0 THEN {column} END AS {column}" for column in (*ALIKE, "cb")
        )
        columns = ", ".join(ALIKE)
        best, best_params = self._best_passing("", [], limit)
        nulls = ", ".join("NULL" for _ in (*ALIKE, "cb"))
        return (
            f"SELECT flags, COUNT(*) AS n, MIN(runner_id) AS runner_id, {grouped} FROM ("
            f"SELECT ({self.flags}) AS flags, runner_id, {columns}, ({self.bits}) AS cb "
            "FROM {table} WHERE pool_name = %s AND deregistered = 0) AS pool "
            f"GROUP BY {', '.join(str(i) for i in (1, *range(4, 5 + len(ALIKE))))} "
            f"UNION ALL SELECT -1, 0, runner_id, {nulls} FROM ({best}) AS best",
            [*self.rule_params, *self.bits_params, self.pool_name, *best_params],
        )

    def alike_survey(self, collate: str, *, texts: bool = True) -> tuple[str, list[Any]]:
        """Per failed-rule bitmask the runners, one id, and the least and the greatest
        value of each ALIKE column and of the capacity bits (texts compared byte by byte:
        ``collate``). Least equal to greatest on every column of bitmask 0 (the rows that
        pass the prefilter): every passing runner is alike. Grouped by the bitmask only:
        a few groups, whatever the texts. Without ``texts``: the capacity bits' only (the
        ALIKE columns known equal on every runner of the pool)."""
        columns = ALIKE if texts else ()
        bounds = "".join(
            f"MIN({column}{collate}) AS lo_{column}, MAX({column}{collate}) AS hi_{column}, "
            for column in columns
        )
        return (
            f"SELECT flags, COUNT(*) AS n, MIN(runner_id) AS runner_id, {bounds}"
            "MIN(cb) AS lo_cb, MAX(cb) AS hi_cb "
            f"FROM (SELECT ({self.flags}) AS flags, runner_id, "
            + "".join(f"{column}, " for column in columns)
            + f"({self.bits}) AS cb FROM {{table}} WHERE pool_name = %s AND deregistered = 0"
            f"{self.fence}) AS pool GROUP BY flags",
            [*self.rule_params, *self.bits_params, self.pool_name],
        )

    def best(
        self, limit: int, *, everyone_passes: bool = False, one_locality: bool = False
    ) -> tuple[str, list[Any]]:
        """The ids of the first ``limit`` passing rows in candidate order. In a snapshot
        where every runner of the pool passes the prefilter (``everyone_passes``), the
        same without testing it; where all share their artifact digests
        (``one_locality``: the same locality bound), ordered without that term."""
        if not (everyone_passes or one_locality):
            return self._best_passing("", [], limit)
        passing = "" if everyone_passes else f" AND {self.passing}"
        order = self.free_order if one_locality else self.order
        return (
            "SELECT runner_id FROM {table} WHERE pool_name = %s AND deregistered = 0"
            f"{passing} ORDER BY {order} LIMIT %s",
            [
                self.pool_name,
                *([] if everyone_passes else self.rule_params),
                *([] if one_locality else self.locality_params),
                limit,
            ],
        )

    def first_of(self, groups: list[Group], limit: int) -> tuple[str, list[Any]]:
        """The ids of the first ``limit`` passing rows of these groups, in candidate order."""
        alike = " AND ".join([*(f"{column} = %s" for column in ALIKE), f"({self.bits}) = %s"])
        extra = " AND (" + " OR ".join(f"({alike})" for _ in groups) + ")"
        params: list[Any] = []
        for group in groups:
            params += [*group[:-1], *self.bits_params, group[-1]]
        return self._best_passing(extra, params, limit)

    def rows(self, ids: list[str]) -> tuple[str, list[Any]]:
        placeholders = ", ".join("%s" for _ in ids)
        return (
            f"SELECT *, {self.locality} AS locality_bound, ({self.bits}) AS cb FROM {{table}} "
            f"WHERE runner_id IN ({placeholders}) AND deregistered = 0",
            [*self.locality_params, *self.bits_params, *ids],
        )


@dataclass(frozen=True)
class Member:
    """A runner read by :func:`refusal_candidates`, evaluated."""

    rank: RankKey  # its rank bound: candidate order
    snapshot: RunnerSnapshot
    group: Group
    evaluation: RunnerEvaluation

    @property
    def reason_keys(self) -> tuple[str, ...]:
        return tuple(reason_keys(self.evaluation))


def _members(
    view: RunnerSnapshotsView,
    sql: _Sql,
    ids: list[str],
    requirements: Requirements,
    now: datetime,
    heartbeat_timeout: timedelta,
) -> dict[str, Member] | None:
    """These runners, read and evaluated; ``None`` when one is gone or compatible (the
    read model changed since the survey)."""
    unique = sorted(set(ids))
    rows = view.query(*sql.rows(unique)) if unique else []
    if len(rows) != len(unique):
        return None
    snapshots = [row_to_snapshot(row) for row in rows]
    decision = decide(requirements, snapshots, now, heartbeat_timeout)
    if decision.chosen is not None:
        return None
    return {
        snapshot.id: Member(rank_bound(row), snapshot, _group(row), evaluation)
        for row, snapshot, evaluation in zip(rows, snapshots, decision.evaluations, strict=True)
    }


def refusal_candidates(
    view: RunnerSnapshotsView,
    requirements: Requirements,
    now: datetime,
    heartbeat_timeout: timedelta,
) -> tuple[list[RunnerSnapshot], Unlisted] | None:
    """The runners a full scan's refusal keeps as evidence, in candidate order, and the
    counts of the others; ``None`` when a runner is compatible, the groups of alike
    runners are too many or fail different rules, or the read model changed meanwhile."""
    sql = _Sql(view, requirements, now - heartbeat_timeout)
    with ThreadPoolExecutor(max_workers=1) as beside:
        # where the store serves two reads at once (PostgreSQL: a connection each), the
        # first passing rows are read beside the alike survey, which needs them (the
        # grouped survey reads its own: then they are dropped)
        best = beside.submit(view.query, *sql.best(PREFIX)) if view.parallel_reads else None
        surveyed = _alike(view, sql)
        if surveyed is None:  # passing runners of several kinds: group them
            rows = view.query(*sql.survey(PREFIX))
            counts = pool_counts([row for row in rows if row["flags"] >= 0], sql.rules)
            sizes = {_group(row): row["n"] for row in rows if row["flags"] == 0}
            if len(sizes) > MAX_GROUPS:
                return None
            prefix = [row["runner_id"] for row in rows if row["flags"] < 0]
            one_each = [row["runner_id"] for row in rows if row["flags"] == 0]
        else:
            counts, sizes, one_each, first_ids = surveyed
            found = best.result() if best is not None else None
            if found is not None:
                first_ids = [row["runner_id"] for row in found]
            prefix = first_ids if sizes else []
    members = _members(view, sql, prefix + one_each, requirements, now, heartbeat_timeout)
    if members is None:
        return None
    keys_of: dict[Group, tuple[str, ...]] = {}  # each group's reason keys
    codes_of: dict[Group, tuple[str, ...]] = {}  # and its combination of failed rules
    for member in members.values():
        if keys_of.setdefault(member.group, member.reason_keys) != member.reason_keys:
            return None  # alike runners fail different rules: not alike after all
        codes_of[member.group] = member.evaluation.reason_codes
    if keys_of.keys() != sizes.keys():
        return None  # the read model changed since the survey
    kept: list[Member] = []
    searched = 0
    for combination in sorted(set(codes_of.values())):
        groups = [group for group, codes in codes_of.items() if codes == combination]
        first = sorted((members[i] for i in prefix if members[i].group in groups), key=_rank)
        if len(first) < EVIDENCE_PER_REASON and len(first) < sum(sizes[g] for g in groups):
            searched += 1  # the prefix holds too few of them: read their first ones
            if searched > MAX_SEARCHED:
                return None
            found = view.query(*sql.first_of(groups, EVIDENCE_PER_REASON))
            more = _members(
                view, sql, [row["runner_id"] for row in found], requirements, now, heartbeat_timeout
            )
            if more is None or any(keys_of.get(m.group) != m.reason_keys for m in more.values()):
                return None
            first = sorted(more.values(), key=_rank)
        kept += first[:EVIDENCE_PER_REASON]
    kept.sort(key=_rank)
    refused = 0
    reasons: Counter[str] = Counter()
    for group, size in sizes.items():
        left = size - sum(1 for member in kept if member.group == group)
        if left:
            refused += left
            reasons.update(dict.fromkeys(keys_of[group], left))
    prefiltered = Unlisted(refused=counts.excluded, reasons=counts.reasons)
    elided = Unlisted(refused=refused, reasons=dict(reasons))
    return [member.snapshot for member in kept], prefiltered.merged(elided)


def _alike(
    view: RunnerSnapshotsView, sql: _Sql
) -> tuple[PoolCounts, dict[Group, int], list[str], list[str]] | None:
    """The prefilter's counts, the one group of the runners that pass it (none when none
    pass) with its size and one runner, from :meth:`_Sql.alike_survey`, and the ids of
    the first :data:`PREFIX` passing runners in candidate order (none where they are
    read beside: ``parallel_reads``); ``None`` when the passing runners are not all
    alike.

    Where indexes answer it (SQLite), in one snapshot: when the first and the last
    registered runners of the pool are alike (``alike_in_pool``), the survey compares
    the capacity bits only (the texts would cost it most of its time); the first
    passing runners are read without the prefilter's test when every runner passes it,
    and without the locality term when all share their artifact digests
    (``one_locality_in_pool``)."""
    with view.reading() as query:
        known = view.alike_in_pool(sql.pool_name, query)
        rows = query(*sql.alike_survey(view.byte_collation, texts=known is None))
        counts = pool_counts(rows, sql.rules)
        passing = [row for row in rows if row["flags"] == 0]
        if not passing:
            return counts, {}, [], []
        (row,) = passing
        if known is not None:
            row = {
                **row,
                **{
                    f"{end}_{column}": value
                    for column, value in zip(ALIKE, known, strict=True)
                    for end in ("lo", "hi")
                },
            }
        columns = (*ALIKE, "cb")
        if any(row[f"lo_{column}"] != row[f"hi_{column}"] for column in columns):
            return None
        first: list[str] = []
        if not view.parallel_reads:
            statement = sql.best(
                PREFIX,
                everyone_passes=row["n"] == counts.pool_runners,
                one_locality=view.one_locality_in_pool(sql.pool_name, query),
            )
            first = [found["runner_id"] for found in query(*statement)]
    group = tuple(row[f"lo_{column}"] for column in columns)
    return counts, {group: row["n"]}, [row["runner_id"]], first


def _rank(member: Member) -> RankKey:
    return member.rank
