"""A home runner that a placement not yet in the read model ranks lower is judged again
among the candidates, not over the folded pool, when no runner left unfetched can rank
above it (``infrastructure/home_check.py``; docs/spec.md, section 8.1).

Concurrent ``create_sandbox`` and ``schedule`` calls race in exactly this way: the read
model is caught up, another caller's placement lands on the best runner, and its
aggregates then rank it lower than its row. Folding the whole pool for every such race
made a new sandbox cost the pool's size.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.placement.evidence import RankKey, Unlisted
from secondbox_scheduler.domain.placement.ranking import rank_key
from secondbox_scheduler.domain.placement.rules import decide
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.home_check import checked_home_decision
from secondbox_scheduler.testing.builders import compatible_runner
from tests.conftest import Clock, Store
from tests.factories import (
    HEARTBEAT_TIMEOUT,
    capacity,
    create_sandbox,
    register,
    schedule_request,
)
from tests.factories import (
    requirements as profile,
)

BIG = capacity(instances=8, vcpu_count=16, memory_bytes=32 * 2**30)


def external_app(store: Store, clock: Clock) -> SchedulerApplication:
    """The read model not caught up by the application's own calls."""
    app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    store.opened.append(app)
    return app


def place(app: SchedulerApplication, sandbox_id: str, clock: Clock) -> str:
    home = create_sandbox(app, sandbox_id)
    assert app.schedule(schedule_request(sandbox_id, clock()))[1]
    return home


def counting_pool_folds(app: SchedulerApplication, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    folds: list[Any] = []
    fold = app.queries.fold_runner_snapshots

    def counted(pool_name: str | None = None) -> Any:
        folds.append(pool_name)
        return fold(pool_name)

    monkeypatch.setattr(app.queries, "fold_runner_snapshots", counted)
    return folds


def chosen_runner(app: SchedulerApplication, sandbox_id: str) -> str:
    first = next(iter(app.events.get(sandbox_uuid(sandbox_id))))
    assert isinstance(first, Sandbox.Created)
    return str(first.home_decision["chosen_runner_id"])


def test_every_runner_fetched_a_placement_not_applied_reranks_without_a_fold(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = external_app(store, clock)
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    assert app.read_models is not None
    app.read_models.catch_up()
    assert place(app, "s0", clock) == "r1"  # equal rows: the id decides
    folds = counting_pool_folds(app, monkeypatch)
    # the row still says r1 has four free; its aggregates say three: r2 ranks first
    assert create_sandbox(app, "s1") == "r2"
    assert chosen_runner(app, "s1") == "r2"
    assert folds == []


def test_a_runner_still_above_the_floor_of_the_unfetched_stays_chosen_without_a_fold(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 runners: a page of 16 is fetched, so runners are left unfetched; the big one
    ranks above all of them even after a placement the read model has not applied."""
    app = external_app(store, clock)
    register(app, "r00", at=clock(), allocatable=BIG)
    for index in range(1, 20):
        register(app, f"r{index:02d}", at=clock())
    assert app.read_models is not None
    app.read_models.catch_up()
    assert place(app, "s0", clock) == "r00"
    folds = counting_pool_folds(app, monkeypatch)
    assert create_sandbox(app, "s1") == "r00"  # seven free by its aggregates, four elsewhere
    assert folds == []


def test_equal_runners_a_placement_not_applied_moves_the_choice_to_the_next_fetched(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 equal runners, 16 fetched: after a placement not applied the first ranks below
    every other, and the next fetched (r02) still ranks above the unfetched (r17-r20,
    equal rows after it by id)."""
    app = external_app(store, clock)
    for index in range(1, 21):
        register(app, f"r{index:02d}", at=clock())
    assert app.read_models is not None
    app.read_models.catch_up()
    assert place(app, "s0", clock) == "r01"
    folds = counting_pool_folds(app, monkeypatch)
    assert create_sandbox(app, "s1") == "r02"
    assert folds == []


# -- the rule itself, on snapshots: the floor decides whether the pool is folded -----

REQUIREMENTS = profile()
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def snapshot(runner_id: str, reserved_instances: int = 0) -> RunnerSnapshot:
    reserved = Capacity(instances=reserved_instances)
    return compatible_runner(REQUIREMENTS, runner_id, now=NOW, reserved=reserved)


def check(
    rows: list[RunnerSnapshot], aggregates: dict[str, RunnerSnapshot], floor: RankKey | None
) -> tuple[list[str], list[str]]:
    """The candidates checked_home_decision settles on, and the pools it folded."""
    folds: list[str] = []

    def fold_pool(pool_name: str) -> list[RunnerSnapshot]:
        folds.append(pool_name)
        return list(aggregates.values())

    runners, _, _ = checked_home_decision(
        REQUIREMENTS, rows, Unlisted(), NOW, HEARTBEAT_TIMEOUT,
        fold_runner=aggregates.__getitem__, fold_pool=fold_pool, floor=floor,
    )  # fmt: skip
    chosen = decide(REQUIREMENTS, runners, NOW, HEARTBEAT_TIMEOUT).chosen
    assert chosen is not None
    return [chosen.id, *(r.id for r in runners if r.id != chosen.id)], folds


def test_the_runner_chosen_again_must_rank_above_the_floor_or_the_pool_is_folded() -> None:
    a, b = snapshot("a"), snapshot("b")
    aggregates = {"a": snapshot("a", reserved_instances=2), "b": b, "c": snapshot("c")}
    # a row ranks c (not fetched) at b's level: b is no longer above the floor
    floor = rank_key(REQUIREMENTS, snapshot("b"))
    chosen, folds = check([a, b], aggregates, floor)
    assert folds == [REQUIREMENTS.pool_name]
    # a floor below b: b is chosen from the candidates, nothing folded
    chosen, folds = check([a, b], aggregates, rank_key(REQUIREMENTS, snapshot("c", 1)))
    assert (chosen[0], folds) == ("b", [])
    # every runner fetched (no floor): the same
    chosen, folds = check([a, b], aggregates, None)
    assert (chosen[0], folds) == ("b", [])
