"""A home runner that a placement not yet in the read model ranks lower is judged again
among the candidates, not over the folded pool, when no runner left unfetched can rank
above it (``infrastructure/home_check.py``; docs/spec.md, section 8.1).

Concurrent ``create_sandbox`` and ``schedule`` calls race in exactly this way: the read
model is caught up, another caller's placement lands on the best runner, and its
aggregates then rank it lower than its row. Folding the whole pool for every such race
made a new sandbox cost the pool's size.
"""

from __future__ import annotations

from typing import Any

import pytest

from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock, Store
from tests.factories import capacity, create_sandbox, register, schedule_request

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


def test_a_runner_fallen_to_the_floor_of_the_unfetched_folds_the_pool(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 equal runners: after a placement not applied, the first ranks below the last
    one fetched, so a runner never fetched might rank above it: the pool is folded."""
    app = external_app(store, clock)
    for index in range(1, 21):
        register(app, f"r{index:02d}", at=clock())
    assert app.read_models is not None
    app.read_models.catch_up()
    assert place(app, "s0", clock) == "r01"
    folds = counting_pool_folds(app, monkeypatch)
    assert create_sandbox(app, "s1") == "r02"
    assert folds == ["pool-a"]
