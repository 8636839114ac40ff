"""Refusals decided without reading the pool: a requirement no runner of it can meet.

``create_sandbox`` pages through the runners that pass the SQL prefilter until it finds
the best compatible one (:mod:`.candidates`). When nothing is compatible, that reads and
evaluates every one of them: 14 to 18 s on a pool of 50,000 runners asked for a
toolchain none has. Some requirements make every runner of the pool fail one rule,
whatever else it offers; those are asked first, in one statement of index lookups
(PostgreSQL: GIN indexes of the JSON lists as jsonb; SQLite: the pool's rows, a JSON list
each), before anything of the pool is read:

- ``materialization``: the preferred digests are not exactly two (no lookup), or, unless
  ``client-selected-image`` is required, no runner of the pool has a materialization of
  that runtime and toolchain digest (for any backend or architecture: a runner without
  one fails the rule, which needs one of its own backend and architecture too);
- ``architecture``: no runner of the pool has the requested architecture;
- ``capability`` / ``prerequisite``: no runner of the pool has one of the required
  capabilities / one of the prerequisite capabilities.

When any of them holds, every runner fails that rule, so none is compatible and the
refusal is ``select_runner``'s: ``NoCompatibleRunnerError`` (no runner can have failed
only ``egress``). Its evidence counts every registered runner of the pool as refused
(``Unlisted``), under each of those rules, and under ``egress`` when no runner of the
pool supports the requested egress context; each of these counts equals what
``select_runner`` over the whole pool would count for that rule. The runners' other
rules are not evaluated (as for a runner the prefilter excludes) and no runner keeps an
evaluation record. Egress alone never decides: whether a runner failed *only* egress
(``EgressContextUnavailableError``) needs every other rule.
"""

from __future__ import annotations

from typing import Any

from secondbox_scheduler.domain.placement.evidence import (
    ARCHITECTURE,
    CAPABILITY,
    EGRESS,
    MATERIALIZATION,
    PREREQUISITE,
    Unlisted,
)
from secondbox_scheduler.domain.placement.rules import (
    CAPABILITY_CLIENT_SELECTED_IMAGE,
    PREREQUISITE_CAPABILITIES,
)
from secondbox_scheduler.domain.values import Requirements
from secondbox_scheduler.projections.runner_snapshots import RunnerSnapshotsView

# (reason keys, SQL of whether some runner of the pool may pass them, params)
Check = tuple[tuple[str, ...], str, list[Any]]


def unmatched_refusal(view: RunnerSnapshotsView, requirements: Requirements) -> Unlisted | None:
    """The counts of a refusal decided without reading the pool, or None when every
    rule checked here can be met by some runner of the pool (then select as usual)."""
    pool = requirements.pool_name
    reasons = [] if len(requirements.preferred_artifact_digests) == 2 else [MATERIALIZATION]
    checks = pool_checks(view, requirements)
    found = view.query(*lookup_statement(checks))[0]
    for index, (keys, _, _) in enumerate(checks):
        if not found[f"c{index}"]:
            reasons.extend(key for key in keys if key not in reasons)
    if not reasons:
        return None
    counted: list[Check] = []
    egress = requirements.egress_context
    if egress is not None:
        counted.append(((EGRESS,), *view.pool_has_name(pool, "supported_egress_contexts", egress)))
    statement, params = lookup_statement(counted)
    row = view.query(
        f"{statement}, (SELECT COUNT(*) FROM {{table}} "
        "WHERE pool_name = %s AND deregistered = 0) AS runners",
        [*params, pool],
    )[0]
    if egress is not None and not row["c0"]:
        reasons.append(EGRESS)
    runners = int(row["runners"])
    if not runners:
        return Unlisted()  # an empty pool: select_runner's refusal without a summary
    return Unlisted(refused=runners, reasons=dict.fromkeys(reasons, runners))


def pool_checks(view: RunnerSnapshotsView, requirements: Requirements) -> list[Check]:
    """The lookups: per rule that one value absent from the pool refuses for every
    runner, whether some registered runner of the pool has it."""
    pool = requirements.pool_name
    checks: list[Check] = [
        (
            (ARCHITECTURE,),
            "EXISTS (SELECT 1 FROM {table} WHERE pool_name = %s AND architecture = %s "
            "AND deregistered = 0)",
            [pool, requirements.architecture],
        )
    ]
    digests = requirements.preferred_artifact_digests
    required = requirements.required_capabilities
    if len(digests) == 2 and CAPABILITY_CLIENT_SELECTED_IMAGE not in required:
        checks.append(((MATERIALIZATION,), *view.pool_has_materialization_of(pool, *digests)))
    for name in sorted(required | set(PREREQUISITE_CAPABILITIES)):
        keys = (CAPABILITY,) * (name in required) + (PREREQUISITE,) * (
            name in PREREQUISITE_CAPABILITIES
        )
        checks.append((keys, *view.pool_has_name(pool, "capabilities", name)))
    return checks


def lookup_statement(checks: list[Check]) -> tuple[str, list[Any]]:
    """One row: per check, ``c<index>``, whether a registered runner of the pool has
    the value (``EXISTS``: the first one found ends that lookup)."""
    columns = [f"{lookup} AS c{index}" for index, (_, lookup, _) in enumerate(checks)]
    params = [param for _, _, lookup_params in checks for param in lookup_params]
    return f"SELECT {', '.join(columns) or 'NULL AS c0'}", params
