"""A home runner chosen on the read model is checked against the aggregates before
``create_sandbox`` records it (docs/spec.md, section 8.1).

The runner snapshots read model is a cache: a lagging catch-up, or a row rewritten
behind the application's back, can make a drained, silent or full runner look like the
best one. So the runner the placement rules choose among the read model's candidates is
folded from its Runner and RunnerLease aggregates (``queries.fold_runner``) and judged
again on that snapshot:

- the same snapshot: the choice stands;
- compatible and ranked no worse by the aggregates (a heartbeat the read model has not
  applied yet, say): its snapshot replaces the read model's among the candidates and the
  rules choose again (the candidates not fetched rank below its read-model rank, so below
  it still); a different runner chosen then is checked the same way;
- compatible and ranked worse, but still above the floor of the runners not fetched (a
  placement the read model has not applied yet, say: a concurrent ``schedule`` on it):
  the same, since every runner not fetched ranks below it too (by its row, as every
  candidate but the checked ones is judged);
- refused by the aggregates, ranked worse and not above that floor (a runner the
  candidate search did not fetch may then rank above it), gone, or still unsettled
  after :data:`MAX_CHECKS` runners:
  the candidates are the pool folded from the aggregates (``fold_runner_snapshots``),
  as without read models.

Whichever way, the runner ``Sandbox.create`` records as the home, and its candidate
record in the evidence, are the aggregates' at the decision. The other candidates'
records keep the read model's values (in the fallback, every record is the aggregates').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from secondbox_scheduler.domain.errors import RunnerNotFoundError
from secondbox_scheduler.domain.placement.evidence import RankKey, Unlisted
from secondbox_scheduler.domain.placement.ranking import rank_key
from secondbox_scheduler.domain.placement.rules import decide
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot

MAX_CHECKS = 4  # runners folded before the pool is folded instead


def checked_home_candidates(
    requirements: Requirements,
    candidates: Sequence[RunnerSnapshot],
    unlisted: Unlisted,
    now: datetime,
    heartbeat_timeout: timedelta,
    *,
    fold_runner: Callable[[str], RunnerSnapshot],
    fold_pool: Callable[[str], list[RunnerSnapshot]],
    floor: RankKey | None,
) -> tuple[list[RunnerSnapshot], Unlisted]:
    """Candidates (and counts of the pool's others) on which the placement rules choose
    a runner whose snapshot is its aggregates' (``fold_runner``; it raises
    ``RunnerNotFoundError`` for a runner gone), or choose nothing because no candidate
    is compatible. The read model's candidates with checked snapshots, or the pool
    folded from the aggregates (``fold_pool``). ``floor``: every passing runner not
    among ``candidates`` ranks at or below it by its row (None: every one is among
    them; ``projections.candidates.home_candidates``)."""
    runners = list(candidates)
    checked: set[str] = set()
    for _ in range(MAX_CHECKS):
        chosen = decide(requirements, runners, now, heartbeat_timeout, unlisted).chosen
        if chosen is None or chosen.id in checked:
            return runners, unlisted
        try:
            folded = fold_runner(chosen.id)
        except RunnerNotFoundError:
            break
        checked.add(chosen.id)
        if folded.to_record() == chosen.to_record():
            return runners, unlisted
        if decide(requirements, [folded], now, heartbeat_timeout).chosen is None:
            break  # the aggregates refuse it
        key = rank_key(requirements, folded)
        if key > rank_key(requirements, chosen) and floor is not None and key >= floor:
            break  # ranked worse, not above the floor: a runner not fetched may rank above it
        runners = [folded if runner.id == chosen.id else runner for runner in runners]
    return fold_pool(requirements.pool_name), Unlisted()
