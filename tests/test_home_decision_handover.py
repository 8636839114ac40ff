"""The home check hands its last decision to the creation batch, and takes the paging's
as its first (``infrastructure/home_check.py``): each is the decision ``decide`` makes
over the very runners and counts a creation then decides on, so nothing recorded
changes (docs/spec.md, sections 3 and 8.1)."""

from __future__ import annotations

from typing import Any

import pytest

from secondbox_scheduler.domain.placement.evidence import RankKey, Unlisted
from secondbox_scheduler.domain.placement.ranking import rank_key
from secondbox_scheduler.domain.placement.rules import decide
from secondbox_scheduler.domain.values import RunnerSnapshot
from secondbox_scheduler.infrastructure import home_check
from secondbox_scheduler.infrastructure.home_check import checked_home_decision
from secondbox_scheduler.projections import candidates
from tests.conftest import Clock, Store
from tests.factories import HEARTBEAT_TIMEOUT, create_sandbox, register
from tests.test_home_check_floor import NOW, REQUIREMENTS, external_app, place, snapshot

COUNTS = Unlisted(refused=3, not_evaluated=5, reasons={"architecture": 3})


def settle(
    rows: list[RunnerSnapshot],
    aggregates: dict[str, RunnerSnapshot],
    floor: RankKey | None,
    *,
    handed: bool,
) -> tuple[list[RunnerSnapshot], Unlisted, Any]:
    decided = decide(REQUIREMENTS, rows, NOW, HEARTBEAT_TIMEOUT) if handed else None
    return checked_home_decision(
        REQUIREMENTS, rows, COUNTS, NOW, HEARTBEAT_TIMEOUT,
        fold_runner=aggregates.__getitem__, fold_pool=lambda _: list(aggregates.values()),
        floor=floor, decided=decided,
    )  # fmt: skip


CASES = [
    # the rows agree with the aggregates: the first decision stands
    ([snapshot("a"), snapshot("b")], {"a": snapshot("a"), "b": snapshot("b")}, None),
    # a placement not applied on a: b chosen again over the candidates
    ([snapshot("a"), snapshot("b")], {"a": snapshot("a", 2), "b": snapshot("b")}, None),
    # ... with a floor that b no longer ranks above: the pool is folded
    (
        [snapshot("a"), snapshot("b")],
        {"a": snapshot("a", 2), "b": snapshot("b"), "c": snapshot("c")},
        rank_key(REQUIREMENTS, snapshot("b")),
    ),
    # ... with a floor below b: b from the candidates
    (
        [snapshot("a"), snapshot("b")],
        {"a": snapshot("a", 2), "b": snapshot("b")},
        rank_key(REQUIREMENTS, snapshot("c", 1)),
    ),
    # no candidate: nothing chosen
    ([], {}, None),
]


@pytest.mark.parametrize(("rows", "aggregates", "floor"), CASES)
def test_the_decision_handed_over_is_decides_over_what_the_check_settles_on(
    rows: list[RunnerSnapshot], aggregates: dict[str, RunnerSnapshot], floor: RankKey | None
) -> None:
    for handed in (False, True):
        runners, unlisted, decision = settle(rows, aggregates, floor, handed=handed)
        assert (runners, unlisted) == settle(rows, aggregates, floor, handed=not handed)[:2]
        if decision is None:  # the pool folded: the batch decides itself
            assert unlisted == Unlisted()
            continue
        assert decision == decide(REQUIREMENTS, runners, NOW, HEARTBEAT_TIMEOUT, unlisted)
        assert decision.unlisted == COUNTS


def test_a_creation_decides_once_per_search_on_the_read_model(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 runners (a full first page), a placement the read model has not applied: the
    batch records the home the rules choose over the checked candidates, and the rules
    ran once for the paging and once after the fold of the runner chosen first."""
    app = external_app(store, clock)
    for index in range(1, 21):
        register(app, f"r{index:02d}", at=clock())
    assert app.read_models is not None
    app.read_models.catch_up()
    assert place(app, "s0", clock) == "r01"
    seen: list[Any] = []
    home_decision = app.queries.home_decision

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, home_decision(*args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(app.queries, "home_decision", recorded)
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return decide(*args, **kwargs)

    monkeypatch.setattr(candidates, "decide", counted)
    monkeypatch.setattr(home_check, "decide", counted)
    assert create_sandbox(app, "s1") == "r02"
    ((args, (runners, unlisted, decision)),) = seen
    requirements, now, timeout = args
    assert decision == decide(requirements, runners, now, timeout, unlisted)
    # the paging's decision, the fold of r01 (a decision over it alone), then the
    # decision over the candidates with r01 folded; none by the batch again
    assert calls[0] == 3
