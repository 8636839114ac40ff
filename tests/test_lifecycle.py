"""Assignment commands after schedule: running, release, fail, reconcile claims, fences."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from secondbox_scheduler.domain import (
    Capacity,
    InvalidRequestError,
    ScheduleRequest,
    StaleFenceError,
)
from secondbox_scheduler.domain.errors import (
    AssignmentNotFoundError,
    InvalidTransitionError,
    ReleaseProofError,
    SandboxNotFoundError,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock
from tests.factories import create_sandbox, register, schedule_request, token

PROOF = {"runner": "r1", "stopped_at": "2026-11-29T12:00:00Z"}


def scheduled(app: SchedulerApplication, clock: Clock, **overrides: object) -> ScheduleRequest:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    request = schedule_request("s1", clock(), **overrides)
    app.schedule(request)
    return request


def test_mark_running_then_release(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock)
    clock.advance(seconds=3)
    app.mark_running("s1", 1, request.fencing_token)
    running = app.get_assignment("s1")
    assert running is not None
    assert running.state == "running"
    assert running.revision == 2
    assert running.updated_at == clock()
    before = app.event_count()
    app.mark_running("s1", 1, request.fencing_token)
    assert app.event_count() == before, "an unchanged repeat writes nothing"
    assert app.release("s1", 1, request.fencing_token, PROOF) is True
    released = app.get_assignment("s1")
    assert released is not None
    assert released.state == "released"
    assert released.release_proof == PROOF
    assert released.revision == 3
    assert app.get_runner("r1").reserved == Capacity()
    with pytest.raises(InvalidTransitionError):
        app.mark_running("s1", 1, request.fencing_token)


def test_release_frees_capacity_exactly_once(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock)
    assert app.release("s1", 1, request.fencing_token, PROOF) is True
    before = app.event_count()
    assert app.release("s1", 1, request.fencing_token, dict(PROOF)) is False
    assert app.event_count() == before
    with pytest.raises(ReleaseProofError):
        app.release("s1", 1, request.fencing_token, {"other": "proof"})
    assert app.event_count() == before
    assert app.get_runner("r1").reserved == Capacity()


@pytest.mark.parametrize("proof", [{}, {"a": 1}, "proof", None])
def test_release_needs_proof(app: SchedulerApplication, clock: Clock, proof: object) -> None:
    request = scheduled(app, clock)
    before = app.event_count()
    with pytest.raises(InvalidRequestError) as raised:
        app.release("s1", 1, request.fencing_token, proof)  # type: ignore[arg-type]
    assert raised.value.field == "release_proof"
    assert app.event_count() == before
    assert app.get_runner("r1").reserved == request.requirements.capacity


def test_transient_failures_retry_until_the_limit(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock, retry_limit=2)
    for expected_count in (1, 2):
        failed = app.fail("s1", 1, request.fencing_token, "transport")
        assert failed.state == "assigned", "redelivered while retries remain"
        assert failed.retry_count == expected_count
        assert failed.failure_class == "transport"
    terminal = app.fail("s1", 1, request.fencing_token, "dependency")
    assert terminal.state == "failed"
    assert terminal.retry_count == 2
    assert app.get_runner("r1").reserved == request.requirements.capacity, (
        "a failed assignment keeps its reservation until release proof arrives"
    )
    with pytest.raises(InvalidTransitionError):
        app.fail("s1", 1, request.fencing_token, "transport")
    assert app.release("s1", 1, request.fencing_token, PROOF)
    assert app.get_runner("r1").reserved == Capacity()


def test_terminal_failure_classes_do_not_retry(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock, retry_limit=5)
    failed = app.fail("s1", 1, request.fencing_token, "admission")
    assert failed.state == "failed"
    assert failed.retry_count == 0


def test_unknown_failure_class_is_refused(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock)
    before = app.event_count()
    with pytest.raises(InvalidRequestError) as raised:
        app.fail("s1", 1, request.fencing_token, "cosmic-rays")
    assert raised.value.field == "failure_class"
    assert app.event_count() == before


def test_reconcile_claims(app: SchedulerApplication, clock: Clock) -> None:
    scheduled(app, clock)
    until = clock() + timedelta(seconds=30)
    assert app.claim_reconcile("s1", 1, "reconciler-a", until) is True
    before = app.event_count()
    assert app.claim_reconcile("s1", 1, "reconciler-a", until) is True
    assert app.event_count() == before, "the same claim again writes nothing"
    assert app.claim_reconcile("s1", 1, "reconciler-b", until) is False
    assert app.event_count() == before
    claimed = app.get_assignment("s1")
    assert claimed is not None
    assert (claimed.reconcile_owner, claimed.reconcile_claim_expires_at) == ("reconciler-a", until)
    clock.advance(seconds=31)
    takeover = clock() + timedelta(seconds=30)
    assert app.claim_reconcile("s1", 1, "reconciler-b", takeover) is True, "expired: taken over"
    assert app.release_reconcile_claim("s1", 1, "reconciler-a") is False
    assert app.release_reconcile_claim("s1", 1, "reconciler-b") is True
    released = app.get_assignment("s1")
    assert released is not None
    assert released.reconcile_owner == ""
    with pytest.raises(InvalidRequestError) as raised:
        app.claim_reconcile("s1", 1, "reconciler-a", clock() - timedelta(seconds=1))
    assert raised.value.field == "until"
    with pytest.raises(InvalidRequestError):
        app.claim_reconcile("s1", 1, "", takeover)


def test_advance_generation_only_after_release(app: SchedulerApplication, clock: Clock) -> None:
    request = scheduled(app, clock)
    with pytest.raises(InvalidTransitionError):
        app.advance_generation("s1", 1)
    app.release("s1", 1, request.fencing_token, PROOF)
    assert app.advance_generation("s1", 1) == 2
    with pytest.raises(AssignmentNotFoundError):
        app.advance_generation("s1", 2)
    with pytest.raises(StaleFenceError):
        app.advance_generation("s1", 1)


StaleCall = Callable[[SchedulerApplication, int, bytes], object]
STALE_CALLS: dict[str, StaleCall] = {
    "mark_running": lambda app, gen, tok: app.mark_running("s1", gen, tok),
    "release": lambda app, gen, tok: app.release("s1", gen, tok, PROOF),
    "fail": lambda app, gen, tok: app.fail("s1", gen, tok, "transport"),
}


@pytest.mark.parametrize("name", sorted(STALE_CALLS))
def test_stale_fences_are_refused_and_write_nothing(
    app: SchedulerApplication, clock: Clock, name: str
) -> None:
    request = scheduled(app, clock)
    call = STALE_CALLS[name]
    before = app.event_count()
    with pytest.raises(StaleFenceError, match="fencing token"):
        call(app, 1, token())
    with pytest.raises(StaleFenceError, match="generation"):
        call(app, 2, request.fencing_token)
    assert app.event_count() == before
    assert app.get_assignment("s1") == app.get_assignment("s1", 1)
    assert app.get_runner("r1").reserved == request.requirements.capacity


def test_an_older_generation_cannot_act_on_a_newer_one(
    app: SchedulerApplication, clock: Clock
) -> None:
    first = scheduled(app, clock)
    app.release("s1", 1, first.fencing_token, PROOF)
    app.advance_generation("s1", 1)
    second = schedule_request("s1", clock())
    app.schedule(second)
    before = app.event_count()
    for name, call in STALE_CALLS.items():
        with pytest.raises(StaleFenceError):
            call(app, 1, first.fencing_token)
        with pytest.raises(StaleFenceError):
            call(app, 2, first.fencing_token)
        assert app.event_count() == before, f"{name}: a stale fence wrote an event"
    with pytest.raises(StaleFenceError):
        app.claim_reconcile("s1", 1, "reconciler", clock() + timedelta(seconds=5))
    assert app.event_count() == before


def test_commands_on_unknown_sandboxes_and_bad_fences(app: SchedulerApplication) -> None:
    with pytest.raises(SandboxNotFoundError):
        app.mark_running("nobody", 1, token())
    with pytest.raises(InvalidRequestError) as raised:
        app.mark_running("s1", 0, token())
    assert raised.value.field == "generation"
    with pytest.raises(InvalidRequestError) as raised:
        app.release("s1", 1, "not-bytes", PROOF)  # type: ignore[arg-type]
    assert raised.value.field == "fencing_token"
