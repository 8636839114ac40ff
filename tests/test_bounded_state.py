"""Aggregate state stays bounded: a sandbox that restarts often does not grow its snapshots.

A Sandbox keeps what its commands and invariants need (the current generation's
assignment); past generations stay in the events and in the assignments read model,
and a fencing token is refused when any earlier generation used it (a per-token index
stream, saved with the fence). A Runner keeps only its active reservations.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from secondbox_scheduler.domain import InvalidRequestError, ScheduleRequest
from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots
from tests.conftest import Clock, Store
from tests.factories import (
    RUNTIME,
    create_sandbox,
    materialization,
    register,
    schedule_request,
    token,
)
from tests.fixtures import make_history_0_1 as fixture
from tests.histories import HISTORY_0_1, copy_history, copy_sqlite


def run_generations(app: SchedulerApplication, clock: Clock, sandbox_id: str, count: int) -> None:
    for _ in range(count):
        clock.advance(seconds=1)
        app.record_heartbeat(
            runner_id="r1", at=clock(), artifact_digests=[RUNTIME],
            materializations=[materialization()],
        )  # fmt: skip
        assignment, _ = app.schedule(schedule_request(sandbox_id, clock()))
        generation, fence = assignment.generation, assignment.fencing_token
        app.mark_running(sandbox_id, generation, fence)
        app.release(sandbox_id, generation, fence, {"exit": "0"})
        app.advance_generation(sandbox_id, generation)


def snapshot_sizes(app: SchedulerApplication, aggregate_id: object) -> list[int]:
    assert app.snapshots is not None
    return [
        len(snapshot.state)
        for snapshot in app.snapshots.recorder.select_events(aggregate_id)  # type: ignore[arg-type]
    ]


def test_snapshots_do_not_grow_with_generations(store: Store, clock: Clock) -> None:
    app = store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    run_generations(app, clock, "s1", 30)
    early = snapshot_sizes(app, sandbox_uuid("s1"))
    early_runner = snapshot_sizes(app, runner_uuid("r1"))
    run_generations(app, clock, "s1", 90)
    late = snapshot_sizes(app, sandbox_uuid("s1"))
    late_runner = snapshot_sizes(app, runner_uuid("r1"))
    assert len(late) > len(early) >= 2
    # the last snapshot after 120 generations is no bigger than the first ones (give or
    # take the digits of a larger version number and generation)
    assert max(late) <= min(early) + 64
    assert max(late_runner) <= min(early_runner) + 64


def test_stored_bytes_grow_linearly_with_generations(tmp_path: Path, clock: Clock) -> None:
    sizes = []
    for count in (20, 60):
        path = tmp_path / f"g{count}.db"
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{path}"}, now=clock)
        register(app, "r1", at=clock())
        create_sandbox(app, "s1")
        run_generations(app, clock, "s1", count)
        app.close()
        sizes.append(path.stat().st_size)
    assert sizes[1] / sizes[0] < 3.6  # three times the generations, about three times the bytes


@pytest.mark.parametrize("read_models", ["on", "off"])
def test_an_old_generation_still_answers(store: Store, clock: Clock, read_models: str) -> None:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": read_models}, now=clock)
    store.opened.append(app)
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    run_generations(app, clock, "s1", 3)
    first = app.get_assignment("s1", 1)
    assert first is not None
    assert (first.generation, first.state, first.release_proof) == (1, "released", {"exit": "0"})
    assert [a.generation for a in app.assignments("s1")] == [1, 2, 3]
    assert app.get_assignment("s1") is None  # generation 4 is not scheduled yet
    assert app.get_assignment("s1", 9) is None


def test_a_token_of_any_earlier_generation_is_refused(store: Store, clock: Clock) -> None:
    app = store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    tokens = []
    for _ in range(3):
        fence = token()
        tokens.append(fence)
        assignment, _ = app.schedule(schedule_request("s1", clock(), fencing_token=fence))
        app.release("s1", assignment.generation, fence, {"exit": "0"})
        app.advance_generation("s1", assignment.generation)
    before = app.event_count()
    for used in tokens:
        with pytest.raises(InvalidRequestError) as refused:
            app.schedule(
                schedule_request("s1", clock(), fencing_token=used, serialization_retry_limit=0)
            )
        assert refused.value.field == "fencing_token"
    assert app.event_count() == before
    assert app.schedule(schedule_request("s1", clock()))[1]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_release_0_1_sandbox_refuses_the_tokens_of_its_past_and_moves_on(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The fixture's corner-sbx-1 went through 14 generations under release 0.1, whose
    Sandbox kept every token in its state (snapshots of class version 1, fences without
    a token index). Its tokens stay refused after the upcasts; new generations work."""
    clock = fixture.Clock(fixture.LATER + timedelta(days=1))
    if kind == "sqlite":
        path = copy_sqlite(HISTORY_0_1, tmp_path)
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{path}"}, now=clock)
    else:
        app = SchedulerApplication(env=request.getfixturevalue("postgres_schema").env(), now=clock)
        copy_history(HISTORY_0_1, app)
    try:
        # the stored row itself (the sealing recorder does not trust a snapshot of the
        # unchained part of a log: the application loads this sandbox from its events)
        recorder = app.snapshots.recorder  # type: ignore[union-attr]
        state = (
            super(SealedSnapshots, recorder)
            .select_events(  # type: ignore[misc]
                sandbox_uuid("corner-sbx-1"), desc=True, limit=1
            )[0]
            .state
        )
        assert "class_version" not in json.loads(state)["state"]  # written by 0.1
        fixture.beat(app, "corner-a", clock)  # the sandbox's home runner, alive again
        old = request_for(15, clock, token_of=3)
        with pytest.raises(InvalidRequestError) as refused:
            app.schedule(old)
        assert refused.value.field == "fencing_token"
        assignment, created = app.schedule(request_for(15, clock))
        assert created
        assert assignment.generation == 15
        assert app.get_assignment("corner-sbx-1", 3) is not None  # the past still answers
    finally:
        app.close()


def request_for(
    generation: int, clock: fixture.Clock, token_of: int | None = None
) -> ScheduleRequest:
    """The fixture's own request for a generation, with a fresh token or the token the
    fixture gave generation ``token_of``."""
    made = fixture.request("corner-sbx-1", generation, clock)
    fence = (
        token()
        if token_of is None
        else fixture.request("corner-sbx-1", token_of, clock).fencing_token
    )
    return made.model_copy(update={"fencing_token": fence})
