"""The Sandbox aggregate's own guards, with nothing in front of it (no application):
the pinned profile, one fenced assignment per generation on a compatible home runner
(docs/spec.md (section 7), invariants 3 and 4), fences on every runner-facing command, the
assignment's transitions, release proof (6) and reconcile claims. A refused command
raises its typed error and records nothing: same version, no pending event.

Fencing-token reuse across generations is refused by the application (a per-token
index saved with the fence), so it is tested in ``test_application_guards.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest

from secondbox_scheduler.domain import (
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    ProfileRevisionMismatchError,
    StaleFenceError,
)
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    AssignmentNotFoundError,
    EgressContextUnavailableError,
    InvalidTransitionError,
    ReconcileClaimError,
    ReleaseProofError,
)
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.reconcile import (
    ACTION_DEADLINE_EXCEEDED,
    ACTION_NONE,
    ACTION_UNCERTAIN,
)
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot
from tests.aggregates import (
    PROOF,
    REQUEST,
    T0,
    TIMEOUT,
    new_lease,
    new_runner,
    new_sandbox,
    place,
    request,
    requirements,
    slots,
    unchanged,
)

LATER = T0 + timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
STATES_BUT_RELEASED = ("assigned", "running", "failed", "uncertain")


@dataclass
class Placed:
    """One runner, its lease and one sandbox homed on it, with the tokens fenced so far."""

    runner: Runner
    lease: RunnerLease
    sandbox: Sandbox
    tokens: dict[int, bytes] = field(default_factory=dict)
    generation: int = 1

    @property
    def token(self) -> bytes:
        return self.tokens[self.generation]

    def place(self) -> None:
        made = place(self.sandbox, self.runner, self.lease, LATER)
        self.tokens[self.generation] = made.request.fencing_token

    def release(self) -> None:
        record = self.sandbox.release(self.generation, self.token, PROOF, LATER)
        assert record is not None
        self.runner.release(
            sandbox_id=self.sandbox.sandbox_id, generation=self.generation, release_proof=PROOF,
            at=LATER,
        )  # fmt: skip

    def advance(self) -> None:
        self.generation = self.sandbox.advance_generation(self.generation, LATER)

    def state(self) -> str:
        record = self.sandbox.assignment()
        assert record is not None
        return str(record["state"])

    def uncertain(self) -> None:
        assert self.sandbox.claim_reconcile(self.generation, "rec", LATER + MINUTE, LATER)
        self.sandbox.reconcile(self.generation, "rec", ACTION_UNCERTAIN, "silent", None, LATER)


def placed(generations: int = 1) -> Placed:
    """A sandbox at generation ``generations``, every earlier one released and advanced,
    the current one fenced (state assigned)."""
    runner, lease = new_runner(allocatable=slots(2)), new_lease()
    found = Placed(runner, lease, new_sandbox("s1", [runner.snapshot(lease)]))
    for _ in range(generations - 1):
        found.place()
        found.release()
        found.advance()
    found.place()
    found.sandbox.collect_events()
    found.runner.collect_events()
    return found


def in_state(state: str) -> Placed:
    found = placed()
    if state == "running":
        found.sandbox.mark_running(1, found.token, LATER)
    elif state == "failed":
        found.sandbox.fail(1, found.token, "admission", LATER)
    elif state == "uncertain":
        found.uncertain()
    elif state == "released":
        found.release()
    assert found.state() == state
    found.sandbox.collect_events()
    return found


# -- create: the home runner ----------------------------------------------------------


def test_create_records_the_best_compatible_runner_as_home() -> None:
    lease = new_lease("r1")
    small, big = new_runner("r1", allocatable=slots(1)), new_runner("r2", allocatable=slots(3))
    sandbox = new_sandbox("s1", [small.snapshot(lease), big.snapshot(new_lease("r2"))])
    assert sandbox.home_runner_id == "r2"
    (created,) = sandbox.collect_events()
    assert isinstance(created, Sandbox.Created)
    assert created.home_decision["chosen_runner_id"] == "r2"
    assert created.requirements == requirements().to_record()


def test_create_refuses_when_no_runner_is_compatible() -> None:
    full = new_runner(allocatable=slots(1))
    full.start_drain(T0)
    with pytest.raises(NoCompatibleRunnerError):
        new_sandbox("s1", [full.snapshot(new_lease())])
    with pytest.raises(NoCompatibleRunnerError):
        new_sandbox("s1", [])


def test_create_refuses_an_unsupported_egress_context() -> None:
    runner = new_runner()
    with pytest.raises(EgressContextUnavailableError):
        new_sandbox("s1", [runner.snapshot(new_lease())], egress_context="private")


# -- fence: invariants 3 and 4 --------------------------------------------------------


@pytest.mark.parametrize(
    ("field_name", "value"),
    [("workspace_id", "workspace-other"), ("profile_revision_id", "profile-2"),
     ("requirements", requirements(architecture="aarch64"))],
)  # fmt: skip
def test_fence_refuses_a_request_that_differs_from_the_pinned_profile(
    field_name: str, value: object
) -> None:
    runner, lease = new_runner(), new_lease()
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    before = unchanged(sandbox)
    with pytest.raises(ProfileRevisionMismatchError):
        sandbox.fence(request("s1", LATER, **{field_name: value}), runner.snapshot(lease),
                      runner_version=1, lease_version=2, attempt=0, clock=LATER)  # fmt: skip
    assert unchanged(sandbox) == before
    assert sandbox.assignment() is None


def test_fence_records_the_assignment_and_its_evidence() -> None:
    found = placed()
    record = found.sandbox.assignment()
    assert record is not None
    assert (record["runner_id"], record["generation"], record["state"]) == ("r1", 1, "assigned")
    assert record["fencing_token"] == found.token.hex()
    assert record["capacity"] == REQUEST.as_dict()
    assert found.runner.snapshot(found.lease).reserved == REQUEST


def test_fence_refuses_a_second_assignment_for_the_generation() -> None:
    found = placed()
    before = unchanged(found.sandbox)
    with pytest.raises(AlreadyExistsError):
        found.sandbox.fence(
            request("s1", LATER), found.runner.snapshot(found.lease),
            runner_version=found.runner.version, lease_version=found.lease.version, attempt=0,
            clock=LATER,
        )  # fmt: skip
    assert unchanged(found.sandbox) == before
    record = found.sandbox.assignment()
    assert record is not None
    assert record["fencing_token"] == found.token.hex()


def fence_on(sandbox: Sandbox, snapshot: RunnerSnapshot) -> None:
    sandbox.fence(
        request("s1", LATER), snapshot, runner_version=1, lease_version=2, attempt=0, clock=LATER
    )


def home_and_sandbox() -> tuple[RunnerSnapshot, Sandbox]:
    runner = new_runner(allocatable=slots(1))
    snapshot = runner.snapshot(new_lease())
    return snapshot, new_sandbox("s1", [snapshot])


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
def test_fence_refuses_a_home_runner_short_on_any_dimension(dim: str) -> None:
    snapshot, sandbox = home_and_sandbox()
    reserved = Capacity(**{dim: 1})
    before = unchanged(sandbox)
    with pytest.raises(HomeRunnerUnavailableError, match=f"insufficient {dim}"):
        fence_on(sandbox, snapshot.model_copy(update={"reserved": reserved}))
    assert unchanged(sandbox) == before


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        ({"drain_phase": "draining"}, "draining"),
        ({"last_heartbeat_at": T0 - TIMEOUT - timedelta(microseconds=1)}, "heartbeat stale"),
        ({"last_heartbeat_at": None}, "heartbeat stale"),
        ({"id": "r2"}, "absent"),
        ({"architecture": "aarch64"}, "of another architecture"),
    ],
)
def test_fence_refuses_a_home_runner_that_is_not_compatible(
    update: dict[str, object], reason: str
) -> None:
    snapshot, sandbox = home_and_sandbox()
    before = unchanged(sandbox)
    with pytest.raises(HomeRunnerUnavailableError, match=reason):
        fence_on(sandbox, snapshot.model_copy(update=update))
    assert unchanged(sandbox) == before
    assert sandbox.assignment() is None


def test_fence_at_the_heartbeat_boundary_is_accepted() -> None:
    snapshot, sandbox = home_and_sandbox()
    fresh_enough = snapshot.model_copy(update={"last_heartbeat_at": LATER - TIMEOUT})
    fence_on(sandbox, fresh_enough)
    assert sandbox.assignment() is not None


# -- fences: stale generations and tokens, of every earlier generation ----------------


def commands(found: Placed, generation: int, token: bytes) -> dict[str, Callable[[], object]]:
    sandbox = found.sandbox
    return {
        "mark_running": lambda: sandbox.mark_running(generation, token, LATER),
        "release": lambda: sandbox.release(generation, token, PROOF, LATER),
        "fail": lambda: sandbox.fail(generation, token, "transport", LATER),
    }


GENERATION_COMMANDS: dict[str, Callable[[Sandbox, int], object]] = {
    "claim_reconcile": lambda s, g: s.claim_reconcile(g, "rec", LATER + MINUTE, LATER),
    "release_reconcile_claim": lambda s, g: s.release_reconcile_claim(g, "rec", LATER),
    "reconcile": lambda s, g: s.reconcile(g, "rec", ACTION_NONE, "", None, LATER),
    "advance_generation": lambda s, g: s.advance_generation(g, LATER),
}


@pytest.mark.parametrize("command", ["mark_running", "release", "fail"])
def test_every_earlier_generation_and_its_token_is_refused(command: str) -> None:
    found = placed(generations=3)
    for generation in (1, 2):
        for token in (found.tokens[generation], found.token):
            before = unchanged(found.sandbox)
            with pytest.raises(StaleFenceError, match=f"generation {generation} is not"):
                commands(found, generation, token)[command]()
            assert unchanged(found.sandbox) == before
    assert found.state() == "assigned"


@pytest.mark.parametrize("command", ["mark_running", "release", "fail"])
def test_an_earlier_generations_token_is_refused_at_the_current_generation(command: str) -> None:
    found = placed(generations=3)
    for token in (found.tokens[1], found.tokens[2], b"\xff" * 32, found.token[:-1]):
        before = unchanged(found.sandbox)
        with pytest.raises(StaleFenceError, match="fencing token does not match"):
            commands(found, 3, token)[command]()
        assert unchanged(found.sandbox) == before
    assert found.state() == "assigned"


@pytest.mark.parametrize("command", ["mark_running", "release", "fail"])
def test_a_future_generation_is_refused(command: str) -> None:
    found = placed()
    before = unchanged(found.sandbox)
    with pytest.raises(StaleFenceError):
        commands(found, 2, found.token)[command]()
    assert unchanged(found.sandbox) == before


@pytest.mark.parametrize("command", sorted(GENERATION_COMMANDS))
def test_claims_and_advances_refuse_every_other_generation(command: str) -> None:
    found = placed(generations=3)
    for generation in (1, 2, 4):
        before = unchanged(found.sandbox)
        with pytest.raises(StaleFenceError):
            GENERATION_COMMANDS[command](found.sandbox, generation)
        assert unchanged(found.sandbox) == before


def test_a_generation_not_yet_scheduled_has_no_assignment() -> None:
    found = placed()
    found.release()
    found.advance()
    found.sandbox.collect_events()
    calls: list[Callable[[], object]] = [
        lambda: found.sandbox.mark_running(2, found.tokens[1], LATER),
        lambda: found.sandbox.release(2, found.tokens[1], PROOF, LATER),
        lambda: found.sandbox.claim_reconcile(2, "rec", LATER + MINUTE, LATER),
        lambda: found.sandbox.advance_generation(2, LATER),
    ]
    for call in calls:
        with pytest.raises(AssignmentNotFoundError):
            call()
    assert found.sandbox.pending_events == []


# -- transitions ----------------------------------------------------------------------


@pytest.mark.parametrize("state", STATES_BUT_RELEASED)
def test_advance_is_refused_in_every_state_but_released(state: str) -> None:
    found = in_state(state)
    before = unchanged(found.sandbox)
    with pytest.raises(InvalidTransitionError, match=f"is {state}; advance"):
        found.sandbox.advance_generation(1, LATER)
    assert unchanged(found.sandbox) == before
    assert found.state() == state


def test_advance_after_release_moves_to_the_next_generation() -> None:
    found = in_state("released")
    assert found.sandbox.advance_generation(1, LATER) == 2
    (advanced,) = found.sandbox.collect_events()
    assert isinstance(advanced, Sandbox.GenerationAdvanced)
    assert advanced.generation == 2
    assert found.sandbox.assignment() is None
    with pytest.raises(StaleFenceError):
        found.sandbox.advance_generation(1, LATER)


@pytest.mark.parametrize("state", ["assigned", "uncertain"])
def test_mark_running_from_assigned_or_uncertain(state: str) -> None:
    found = in_state(state)
    assert found.sandbox.mark_running(1, found.token, LATER) is True
    assert found.state() == "running"
    before = unchanged(found.sandbox)
    assert found.sandbox.mark_running(1, found.token, LATER) is False
    assert unchanged(found.sandbox) == before


@pytest.mark.parametrize("state", ["released", "failed"])
def test_mark_running_is_refused_after_release_or_terminal_failure(state: str) -> None:
    found = in_state(state)
    before = unchanged(found.sandbox)
    with pytest.raises(InvalidTransitionError):
        found.sandbox.mark_running(1, found.token, LATER)
    assert unchanged(found.sandbox) == before


@pytest.mark.parametrize("state", ["released", "failed"])
def test_fail_is_refused_after_release_or_terminal_failure(state: str) -> None:
    found = in_state(state)
    before = unchanged(found.sandbox)
    with pytest.raises(InvalidTransitionError, match="cannot fail"):
        found.sandbox.fail(1, found.token, "transport", LATER)
    assert unchanged(found.sandbox) == before


def test_fail_refuses_an_unknown_failure_class() -> None:
    found = placed()
    before = unchanged(found.sandbox)
    with pytest.raises(InvalidRequestError) as raised:
        found.sandbox.fail(1, found.token, "gremlins", LATER)
    assert raised.value.field == "failure_class"
    assert unchanged(found.sandbox) == before


@pytest.mark.parametrize("state", ["assigned", "running", "uncertain"])
def test_transient_failures_retry_up_to_the_limit_then_fail(state: str) -> None:
    found = in_state(state)  # retry_limit 1
    found.sandbox.fail(1, found.token, "transport", LATER)
    record = found.sandbox.assignment()
    assert record is not None
    assert (record["state"], record["retry_count"], record["failure_class"]) == (
        "assigned", 1, "transport",
    )  # fmt: skip
    found.sandbox.fail(1, found.token, "dependency", LATER)
    record = found.sandbox.assignment()
    assert record is not None
    assert (record["state"], record["retry_count"]) == ("failed", 1)


def test_a_terminal_failure_class_fails_at_once() -> None:
    found = placed()
    found.sandbox.fail(1, found.token, "authorization", LATER)
    record = found.sandbox.assignment()
    assert record is not None
    assert (record["state"], record["retry_count"]) == ("failed", 0)


# -- release: invariant 6 ---------------------------------------------------------------


@pytest.mark.parametrize("state", STATES_BUT_RELEASED)
def test_release_from_every_holding_state_returns_the_record_to_free(state: str) -> None:
    found = in_state(state)
    record = found.sandbox.release(1, found.token, PROOF, LATER)
    assert record is not None
    assert (record["runner_id"], record["capacity"]) == ("r1", REQUEST.as_dict())
    assert found.state() == "released"
    released = found.sandbox.assignment()
    assert released is not None
    assert released["release_proof"] == PROOF


def test_release_without_proof_is_refused_in_every_state() -> None:
    for state in (*STATES_BUT_RELEASED, "released"):
        found = in_state(state)
        before = unchanged(found.sandbox)
        with pytest.raises(InvalidRequestError) as raised:
            found.sandbox.release(1, found.token, {}, LATER)
        assert raised.value.field == "release_proof"
        assert unchanged(found.sandbox) == before
        assert found.state() == state


def test_a_second_release_with_the_same_proof_is_a_no_op() -> None:
    found = in_state("released")
    before = unchanged(found.sandbox)
    assert found.sandbox.release(1, found.token, dict(PROOF), LATER) is None
    assert unchanged(found.sandbox) == before


def test_a_second_release_with_another_proof_is_refused() -> None:
    found = in_state("released")
    before = unchanged(found.sandbox)
    with pytest.raises(ReleaseProofError):
        found.sandbox.release(1, found.token, {"other": "proof"}, LATER)
    assert unchanged(found.sandbox) == before


# -- reconcile claims ----------------------------------------------------------------------


def test_a_claim_held_by_another_owner_is_refused_until_it_expires() -> None:
    found = placed()
    sandbox = found.sandbox
    assert sandbox.claim_reconcile(1, "a", LATER + MINUTE, LATER) is True
    before = unchanged(sandbox)
    assert sandbox.claim_reconcile(1, "b", LATER + MINUTE, LATER) is False
    assert unchanged(sandbox) == before
    assert sandbox.claim_reconcile(1, "a", LATER + MINUTE, LATER) is True  # same claim again
    assert unchanged(sandbox) == before
    expired = LATER + MINUTE
    assert sandbox.claim_reconcile(1, "b", expired + MINUTE, expired) is True
    record = sandbox.assignment()
    assert record is not None
    assert record["reconcile_owner"] == "b"


def test_a_claim_must_end_after_now() -> None:
    found = placed()
    before = unchanged(found.sandbox)
    for until in (LATER, LATER - MINUTE):
        with pytest.raises(InvalidRequestError) as raised:
            found.sandbox.claim_reconcile(1, "a", until, LATER)
        assert raised.value.field == "until"
    assert unchanged(found.sandbox) == before


def test_reconcile_results_need_the_current_claim() -> None:
    found = placed()
    sandbox = found.sandbox
    with pytest.raises(ReconcileClaimError, match="nobody"):
        sandbox.reconcile(1, "a", ACTION_UNCERTAIN, "", None, LATER)
    sandbox.claim_reconcile(1, "a", LATER + MINUTE, LATER)
    sandbox.collect_events()
    for owner, at in (("b", LATER), ("a", LATER + MINUTE), ("a", LATER + 2 * MINUTE)):
        with pytest.raises(ReconcileClaimError):
            sandbox.reconcile(1, owner, ACTION_UNCERTAIN, "", None, at)
    assert sandbox.pending_events == []
    assert sandbox.release_reconcile_claim(1, "b", LATER) is False
    assert sandbox.pending_events == []
    assert sandbox.release_reconcile_claim(1, "a", LATER) is True
    with pytest.raises(ReconcileClaimError):
        sandbox.reconcile(1, "a", ACTION_UNCERTAIN, "", None, LATER)


@pytest.mark.parametrize(
    ("state", "action"),
    [("running", ACTION_DEADLINE_EXCEEDED), ("uncertain", ACTION_DEADLINE_EXCEEDED),
     ("released", ACTION_DEADLINE_EXCEEDED), ("failed", ACTION_DEADLINE_EXCEEDED),
     ("released", ACTION_UNCERTAIN), ("failed", ACTION_UNCERTAIN)],
)  # fmt: skip
def test_reconcile_actions_refuse_states_they_do_not_apply_to(state: str, action: str) -> None:
    found = in_state(state)
    sandbox = found.sandbox
    sandbox.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
    sandbox.collect_events()
    with pytest.raises(InvalidTransitionError):
        sandbox.reconcile(1, "rec", action, "", None, LATER)
    assert sandbox.pending_events == []


def test_reconcile_refuses_an_unknown_action() -> None:
    found = placed()
    found.sandbox.claim_reconcile(1, "a", LATER + MINUTE, LATER)
    with pytest.raises(InvalidRequestError) as raised:
        found.sandbox.reconcile(1, "a", "relocate", "", None, LATER)
    assert raised.value.field == "action"


def test_deadline_exceeded_redelivers_with_a_fresh_window_then_fails() -> None:
    found = placed()  # retry_limit 1, deadline 10 minutes after fencing
    sandbox = found.sandbox
    late = LATER + timedelta(minutes=11)
    sandbox.claim_reconcile(1, "a", late + MINUTE, late)
    sandbox.reconcile(1, "a", ACTION_DEADLINE_EXCEEDED, "late", late + MINUTE, late)
    record = sandbox.assignment()
    assert record is not None
    assert (record["state"], record["retry_count"]) == ("assigned", 1)
    assert record["operation_deadline"] == late + timedelta(minutes=10)
    assert record["next_reconcile_at"] == late + MINUTE
    sandbox.reconcile(1, "a", ACTION_DEADLINE_EXCEEDED, "late", late + MINUTE, late)
    record = sandbox.assignment()
    assert record is not None
    assert (record["state"], record["retry_count"]) == ("failed", 1)
    assert record["operation_deadline"] == late + timedelta(minutes=10)


def test_a_reconcile_that_changes_nothing_records_nothing() -> None:
    found = placed()
    sandbox = found.sandbox
    sandbox.claim_reconcile(1, "a", LATER + MINUTE, LATER)
    record = sandbox.assignment()
    assert record is not None
    sandbox.collect_events()
    sandbox.reconcile(1, "a", ACTION_NONE, "", record["next_reconcile_at"], LATER)
    assert sandbox.pending_events == []
    sandbox.reconcile(1, "a", ACTION_NONE, "", LATER + MINUTE, LATER)
    (scheduled,) = sandbox.collect_events()
    assert isinstance(scheduled, Sandbox.ReconcileScheduled)
    assert scheduled.next_reconcile_at == LATER + MINUTE


def test_reconcile_records_who_decided_what_and_when() -> None:
    found = placed()
    sandbox = found.sandbox
    late = LATER + timedelta(minutes=11)
    sandbox.claim_reconcile(1, "rec", late + MINUTE, late)
    sandbox.collect_events()
    sandbox.reconcile(1, "rec", ACTION_DEADLINE_EXCEEDED, "late", late + MINUTE, late)
    failed, scheduled = sandbox.collect_events()
    assert isinstance(failed, Sandbox.AssignmentFailed)
    assert (failed.timestamp, failed.failure_class, failed.state) == (
        late, "deadline_exceeded", "assigned",
    )  # fmt: skip
    assert isinstance(scheduled, Sandbox.ReconcileScheduled)
    assert (scheduled.timestamp, scheduled.owner, scheduled.generation) == (late, "rec", 1)
    assert scheduled.operation_deadline == late + timedelta(minutes=10)
    sandbox.reconcile(1, "rec", ACTION_UNCERTAIN, "silent runner", None, late)
    uncertain, rescheduled = sandbox.collect_events()
    assert isinstance(uncertain, Sandbox.AssignmentUncertain)
    assert (uncertain.timestamp, uncertain.owner, uncertain.reason) == (
        late,
        "rec",
        "silent runner",
    )
    assert isinstance(rescheduled, Sandbox.ReconcileScheduled)
    assert (rescheduled.timestamp, rescheduled.owner, rescheduled.next_reconcile_at) == (
        late, "rec", None,
    )  # fmt: skip


def test_a_terminal_deadline_failure_keeps_the_operation_deadline() -> None:
    found = placed()  # retry_limit 1
    sandbox = found.sandbox
    first, second = LATER + timedelta(minutes=11), LATER + timedelta(minutes=25)
    sandbox.claim_reconcile(1, "rec", second + MINUTE, first)
    sandbox.reconcile(1, "rec", ACTION_DEADLINE_EXCEEDED, "late", None, first)
    redelivered = sandbox.assignment()
    assert redelivered is not None
    assert redelivered["operation_deadline"] == first + timedelta(minutes=10)
    sandbox.reconcile(1, "rec", ACTION_DEADLINE_EXCEEDED, "late", None, second)
    record = sandbox.assignment()
    assert record is not None
    assert record["state"] == "failed"
    assert record["operation_deadline"] == first + timedelta(minutes=10), "no new window"


def test_reconcile_refusals_say_why() -> None:
    found = in_state("running")
    sandbox = found.sandbox
    sandbox.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
    record = sandbox.assignment()
    assert record is not None
    with pytest.raises(InvalidTransitionError) as deadline:
        sandbox.reconcile(1, "rec", ACTION_DEADLINE_EXCEEDED, "", None, LATER)
    assert str(deadline.value) == f"assignment {record['id']!r} is running, not assigned"
    with pytest.raises(InvalidRequestError) as unknown:
        sandbox.reconcile(1, "rec", "relocate", "", None, LATER)
    assert (unknown.value.rule, unknown.value.value) == (
        "must be one of ['none', 'deadline_exceeded', 'uncertain']", "relocate",
    )  # fmt: skip
    released = in_state("released")
    released.sandbox.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
    gone = released.sandbox.assignment()
    assert gone is not None
    with pytest.raises(InvalidTransitionError) as uncertain:
        released.sandbox.reconcile(1, "rec", ACTION_UNCERTAIN, "", None, LATER)
    assert str(uncertain.value) == (
        f"assignment {gone['id']!r} is released and cannot become uncertain"
    )
    with pytest.raises(ReconcileClaimError) as unclaimed:
        placed().sandbox.reconcile(1, "rec", ACTION_NONE, "", None, LATER)
    assert str(unclaimed.value).endswith("(held by 'nobody' until -)")
    with pytest.raises(ReconcileClaimError) as expired:
        sandbox.reconcile(1, "rec", ACTION_NONE, "", None, LATER + MINUTE)
    assert str(expired.value).endswith(f"(held by 'rec' until {(LATER + MINUTE).isoformat()})")
