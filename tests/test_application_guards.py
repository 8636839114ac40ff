"""The aggregates' guards seen through ``SchedulerApplication``, on SQLite and PostgreSQL.

The same refusals as ``test_runner_guards.py`` and ``test_sandbox_guards.py``, each with
its documented error, and each writing nothing (a placement refusal writes only its
refusal evidence): each capacity dimension, disk with and without
physical-storage-admission, draining, deregistered, a second release, release without
proof, advance from every state but released, and stale tokens of every earlier
generation (including their reuse for a new generation).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from secondbox_scheduler.domain import (
    Capacity,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    StaleFenceError,
)
from secondbox_scheduler.domain.errors import (
    CapacityExceededError,
    ConflictError,
    InvalidTransitionError,
    ReleaseProofError,
    RunnerNotFoundError,
)
from secondbox_scheduler.domain.reconcile import ACTION_UNCERTAIN, ReconcileDecision
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock
from tests.factories import (
    CAPABILITIES,
    capacity,
    create_sandbox,
    only_refusals_since,
    register,
    requirements,
    schedule_request,
    token,
)

PROOF = {"stopped": "yes"}
MINUTE = timedelta(minutes=1)
REQUESTED = requirements().capacity.as_dict()
STATES_BUT_RELEASED = ("assigned", "running", "failed", "uncertain")


def writes_nothing(app: SchedulerApplication, call: Callable[..., object], *args: object) -> object:
    """``call(*args)``, asserting that it appended no event (also when it raises)."""
    before = app.head_position()
    try:
        return call(*args)
    finally:
        assert app.head_position() == before, "a refused command wrote an event"


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
def test_each_dimension_alone_refuses_a_placement_past_allocatable(
    app: SchedulerApplication, clock: Clock, dim: str
) -> None:
    register(app, "r1", at=clock(), allocatable=capacity(**{dim: REQUESTED[dim]}))
    create_sandbox(app, "s1")
    create_sandbox(app, "s2")
    app.schedule(schedule_request("s1", clock()))
    before = app.head_position()
    with pytest.raises(HomeRunnerUnavailableError, match=f"insufficient {dim}"):
        app.schedule(schedule_request("s2", clock()))
    assert only_refusals_since(app, before)
    assert app.get_runner("r1").reserved.as_dict() == REQUESTED
    assert app.get_assignment("s2") is None


def test_disk_is_unchecked_on_a_runner_with_physical_storage_admission(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock(), allocatable=capacity(disk_bytes=REQUESTED["disk_bytes"]),
             capabilities=(*CAPABILITIES, "physical-storage-admission"))  # fmt: skip
    for sandbox_id in ("s1", "s2"):
        create_sandbox(app, sandbox_id)
    for sandbox_id in ("s1", "s2"):
        app.schedule(schedule_request(sandbox_id, clock()))
    assert app.get_runner("r1").reserved.disk_bytes == 2 * REQUESTED["disk_bytes"]
    # the same runner without the capability: disk is checked
    register(app, "r2", at=clock(), allocatable=capacity(disk_bytes=REQUESTED["disk_bytes"]))
    app.start_drain("r1")
    for sandbox_id in ("s3", "s4"):
        create_sandbox(app, sandbox_id)
        assert app.sandbox_home(sandbox_id) == "r2"
    app.schedule(schedule_request("s3", clock()))
    with pytest.raises(HomeRunnerUnavailableError, match="insufficient disk_bytes"):
        app.schedule(schedule_request("s4", clock()))


def test_a_draining_runner_takes_no_placement_until_the_drain_is_cancelled(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.start_drain("r1")
    before = app.head_position()
    with pytest.raises(HomeRunnerUnavailableError, match="draining"):
        app.schedule(schedule_request("s1", clock()))
    assert only_refusals_since(app, before)
    app.cancel_drain("r1")
    assignment, created = app.schedule(schedule_request("s1", clock()))
    assert created
    assert assignment.runner_id == "r1"


def test_a_deregistered_home_runner_takes_no_placement(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.deregister_runner("r1")
    before = app.head_position()
    with pytest.raises(HomeRunnerUnavailableError, match="not registered"):
        app.schedule(schedule_request("s1", clock()))
    assert app.head_position() == before
    with pytest.raises(RunnerNotFoundError, match="deregistered"):
        writes_nothing(app, lambda: app.deregister_runner("r1"))


def placed(app: SchedulerApplication, clock: Clock) -> bytes:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    fencing_token = token()
    app.schedule(schedule_request("s1", clock(), fencing_token=fencing_token, retry_limit=1))
    return fencing_token


def test_a_busy_runner_refuses_deregistration_and_allocatable_below_reserved(
    app: SchedulerApplication, clock: Clock
) -> None:
    placed(app, clock)
    with pytest.raises(ConflictError):
        writes_nothing(app, lambda: app.deregister_runner("r1"))
    for dim in Capacity.DIMENSIONS:
        below = capacity(**{dim: REQUESTED[dim] - 1})
        with pytest.raises(CapacityExceededError):
            writes_nothing(app, app.change_allocatable, "r1", below)
    assert app.get_runner("r1").allocatable == capacity()


def test_a_second_release_is_a_no_op_and_another_proof_is_refused(
    app: SchedulerApplication, clock: Clock
) -> None:
    fencing_token = placed(app, clock)
    assert app.release("s1", 1, fencing_token, PROOF) is True
    assert writes_nothing(app, lambda: app.release("s1", 1, fencing_token, dict(PROOF))) is False
    with pytest.raises(ReleaseProofError):
        writes_nothing(app, lambda: app.release("s1", 1, fencing_token, {"other": "proof"}))
    assert app.get_runner("r1").reserved == Capacity()


@pytest.mark.parametrize("released", [False, True])
def test_release_without_proof_is_refused(
    app: SchedulerApplication, clock: Clock, released: bool
) -> None:
    fencing_token = placed(app, clock)
    if released:
        app.release("s1", 1, fencing_token, PROOF)
    with pytest.raises(InvalidRequestError) as raised:
        writes_nothing(app, lambda: app.release("s1", 1, fencing_token, {}))
    assert raised.value.field == "release_proof"


def bring_to(app: SchedulerApplication, clock: Clock, state: str, fencing_token: bytes) -> None:
    if state == "running":
        app.mark_running("s1", 1, fencing_token)
    elif state == "failed":
        app.fail("s1", 1, fencing_token, "admission")
    elif state == "uncertain":
        app.claim_reconcile("s1", 1, "rec", clock() + timedelta(minutes=1))
        app.record_reconcile("s1", 1, "rec", ReconcileDecision(ACTION_UNCERTAIN, "silent", None))
    current = app.get_assignment("s1")
    assert current is not None
    assert current.state == state


@pytest.mark.parametrize("state", STATES_BUT_RELEASED)
def test_advance_is_refused_in_every_state_but_released(
    app: SchedulerApplication, clock: Clock, state: str
) -> None:
    fencing_token = placed(app, clock)
    bring_to(app, clock, state, fencing_token)
    with pytest.raises(InvalidTransitionError):
        writes_nothing(app, lambda: app.advance_generation("s1", 1))
    current = app.get_assignment("s1")
    assert current is not None
    assert (current.generation, current.state) == (1, state)


def test_stale_generations_and_tokens_of_every_earlier_generation_are_refused(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    tokens: dict[int, bytes] = {}
    for generation in (1, 2, 3):
        tokens[generation] = token()
        app.schedule(schedule_request("s1", clock(), fencing_token=tokens[generation]))
        if generation < 3:
            app.release("s1", generation, tokens[generation], PROOF)
            app.advance_generation("s1", generation)
    commands: dict[str, Callable[[int, bytes], object]] = {
        "mark_running": lambda g, t: app.mark_running("s1", g, t),
        "release": lambda g, t: app.release("s1", g, t, PROOF),
        "fail": lambda g, t: app.fail("s1", g, t, "transport"),
    }
    for command in commands.values():
        for generation in (1, 2):
            for fence in ((generation, tokens[generation]), (generation, tokens[3]),
                          (3, tokens[generation])):  # fmt: skip
                with pytest.raises(StaleFenceError):
                    writes_nothing(app, command, *fence)
        with pytest.raises(StaleFenceError):
            writes_nothing(app, command, 4, tokens[3])
    for generation in (1, 2, 4):
        with pytest.raises(StaleFenceError):
            writes_nothing(app, app.advance_generation, "s1", generation)
        with pytest.raises(StaleFenceError):
            writes_nothing(app, app.claim_reconcile, "s1", generation, "rec", clock() + MINUTE)
    current = app.get_assignment("s1")
    assert current is not None
    assert (current.generation, current.state, current.fencing_token) == (3, "assigned", tokens[3])
    assert app.get_runner("r1").reserved.as_dict() == REQUESTED


def test_a_token_of_any_earlier_generation_is_refused_for_a_new_generation(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    tokens: list[bytes] = []
    for generation in (1, 2):
        tokens.append(token())
        app.schedule(schedule_request("s1", clock(), fencing_token=tokens[-1]))
        app.release("s1", generation, tokens[-1], PROOF)
        app.advance_generation("s1", generation)
    for reused in tokens:
        with pytest.raises(InvalidRequestError) as raised:
            writes_nothing(app, app.schedule, schedule_request("s1", clock(), fencing_token=reused))
        assert raised.value.field == "fencing_token"
    assert app.get_assignment("s1") is None
    assignment, created = app.schedule(schedule_request("s1", clock(), fencing_token=token()))
    assert created
    assert assignment.generation == 3


def test_an_older_heartbeat_changes_nothing(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock())
    before = app.get_runner("r1").last_heartbeat_at
    outcome = writes_nothing(
        app, lambda: app.record_heartbeat(runner_id="r1", at=clock() - timedelta(seconds=1))
    )
    assert outcome == "stale"
    assert app.get_runner("r1").last_heartbeat_at == before
