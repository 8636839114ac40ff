"""A home runner chosen on the read model is checked against the aggregates before
``create_sandbox`` records it (docs/spec.md, section 8.1).

The runner snapshots read model is a cache: a lagging catch-up, or a row rewritten
behind the application's back, can make a drained, silent or full runner look like the
best one. So the runner the placement rules choose among the read model's candidates is
folded from its Runner and RunnerLease aggregates (``queries.fold_runner``) and judged
again on that snapshot:

- the same snapshot: the choice stands;
- compatible by the aggregates (ranked no worse: a heartbeat the read model has not
  applied yet; or worse: a placement it has not applied yet, a concurrent ``schedule``
  on it, say): its snapshot replaces the read model's among the candidates and the
  rules choose again; the runner chosen then is checked the same way, provided it ranks
  above the floor of the runners the candidate search did not fetch (by their rows,
  as every candidate but the checked ones is judged), so that none of those can rank
  above it;
- refused by the aggregates, gone, a runner chosen that does not rank above that floor
  (one not fetched may rank above it), or still unsettled after :data:`MAX_CHECKS`
  runners:
  the candidates are the pool folded from the aggregates (``fold_runner_snapshots``),
  as without read models.

Whichever way, the runner ``Sandbox.create`` records as the home, and its candidate
record in the evidence, are the aggregates' at the decision. The other candidates'
records keep the read model's values (in the fallback, every record is the aggregates').

The check's last decision over the read model's candidates is the one a creation makes
over the candidates it settles on (``decide`` is a pure function of its arguments):
:func:`checked_home_decision` hands it over, so that a creation batch does not decide
again; and the paging's decision over the same candidates (``decided``) is taken as
the check's first instead of being made twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from secondbox_scheduler.domain.errors import RunnerNotFoundError
from secondbox_scheduler.domain.placement.evidence import RankKey, Unlisted
from secondbox_scheduler.domain.placement.ranking import rank_key
from secondbox_scheduler.domain.placement.rules import PlacementDecision, decide, with_unlisted
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot

MAX_CHECKS = 4  # runners folded before the pool is folded instead


def checked_home_decision(
    requirements: Requirements,
    candidates: Sequence[RunnerSnapshot],
    unlisted: Unlisted,
    now: datetime,
    heartbeat_timeout: timedelta,
    *,
    fold_runner: Callable[[str], RunnerSnapshot],
    fold_pool: Callable[[str], list[RunnerSnapshot]],
    floor: RankKey | None,
    decided: PlacementDecision | None = None,
) -> tuple[list[RunnerSnapshot], Unlisted, PlacementDecision | None]:
    """Candidates (and counts of the pool's others) on which the placement rules choose
    a runner whose snapshot is its aggregates' (``fold_runner``; it raises
    ``RunnerNotFoundError`` for a runner gone), or choose nothing because no candidate
    is compatible. The read model's candidates with checked snapshots, or the pool
    folded from the aggregates (``fold_pool``). ``floor``: every passing runner not
    among ``candidates`` ranks at or below it by its row (None: every one is among
    them; ``projections.candidates.home_candidates``). ``decided``: the decision of
    ``decide`` over ``candidates`` (without ``unlisted``), when the caller made it.

    Also returns the decision ``decide(requirements, runners, now, heartbeat_timeout,
    unlisted)`` over the candidates and counts returned, when the check made it (None
    after the fallback to the folded pool)."""
    runners = list(candidates)
    checked: set[str] = set()
    while True:
        if decided is not None:  # the paging's, over these very runners
            decision, decided = with_unlisted(decided, unlisted), None
        else:
            decision = decide(requirements, runners, now, heartbeat_timeout, unlisted)
        chosen = decision.chosen
        if chosen is None:
            return runners, unlisted, decision
        if floor is not None and rank_key(requirements, chosen) >= floor:
            break  # not above the floor: a runner not fetched may rank above it
        if chosen.id in checked:
            return runners, unlisted, decision
        if len(checked) == MAX_CHECKS:
            break
        try:
            folded = fold_runner(chosen.id)
        except RunnerNotFoundError:
            break
        checked.add(chosen.id)
        if folded.to_record() == chosen.to_record():
            return runners, unlisted, decision
        if decide(requirements, [folded], now, heartbeat_timeout).chosen is None:
            break  # the aggregates refuse it
        runners = [folded if runner.id == chosen.id else runner for runner in runners]
    return fold_pool(requirements.pool_name), Unlisted(), None
