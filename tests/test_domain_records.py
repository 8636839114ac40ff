"""What the domain writes and says, exactly: each event's time and fields, each refusal's
message, and the evidence a decision records. Operators read these (``audit explain``,
``audit timeline``, error messages), so they are part of the behaviour."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    ProfileRevisionMismatchError,
    select_runner,
)
from secondbox_scheduler.domain.assignment import AssignmentRecord, AssignmentUpdate
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    AssignmentNotFoundError,
    ConflictError,
    InvalidTransitionError,
    ReleaseProofError,
)
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement.evidence import (
    RANK_FIELDS,
    CandidateRecord,
    HomeDecisionRecord,
    PlacementRecord,
    RankRecord,
    RuleFailure,
    RuleFailureRecord,
    RunnerEvaluation,
    Unlisted,
    UnlistedRecord,
    summarize_refusals,
)
from secondbox_scheduler.domain.placement.rules import evaluate_runner, select_home_runner
from secondbox_scheduler.domain.records import (
    MaterializationRecord,
    RequirementsRecord,
    RunnerSnapshotRecord,
)
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import ReservationRecord
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
)
from tests.aggregates import (
    PROOF,
    REQUEST,
    T0,
    TIMEOUT,
    EventLog,
    new_lease,
    new_runner,
    new_sandbox,
    place,
    request,
    requirements,
    slots,
)
from tests.test_sandbox_guards import LATER, MINUTE, in_state, placed

HOME_UNAVAILABLE = "SecondBox scheduler home runner unavailable"


# -- events carry the command's time ---------------------------------------------------------


def test_every_sandbox_event_carries_the_time_of_its_command() -> None:
    found = placed()
    sandbox, token = found.sandbox, found.token
    times = [LATER + timedelta(seconds=n) for n in range(1, 8)]
    sandbox.mark_running(1, token, times[0])
    sandbox.claim_reconcile(1, "rec", times[6], times[1])
    sandbox.release_reconcile_claim(1, "rec", times[2])
    sandbox.fail(1, token, "transport", times[3])
    sandbox.release(1, token, PROOF, times[4])
    sandbox.advance_generation(1, times[5])
    events: list[Any] = list(sandbox.collect_events())
    assert [type(e).__name__ for e in events] == [
        "AssignmentRunning", "ReconcileClaimed", "ReconcileClaimReleased", "AssignmentFailed",
        "AssignmentReleased", "GenerationAdvanced",
    ]  # fmt: skip
    assert [e.timestamp for e in events] == times[:6]
    claimed, unclaimed = events[1], events[2]
    assert (claimed.owner, claimed.until, claimed.generation) == ("rec", times[6], 1)
    assert (unclaimed.owner, unclaimed.generation) == ("rec", 1)


def test_a_fence_records_the_decision_it_was_made_on() -> None:
    runner, lease = new_runner(allocatable=slots(2)), new_lease()
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    sandbox.collect_events()
    wanted = request("s1", LATER)
    sandbox.fence(
        wanted, runner.snapshot(lease), runner_version=7, lease_version=3, attempt=2, clock=LATER
    )
    (fenced,) = sandbox.collect_events()
    assert isinstance(fenced, Sandbox.AssignmentFenced)
    assert fenced.timestamp == LATER
    placement = fenced.placement
    assert placement["chosen_runner_id"] == "r1"
    assert placement["decided_at"] == LATER
    assert placement["heartbeat_timeout_seconds"] == TIMEOUT.total_seconds()
    only_home: list[CandidateRecord] = [{"runner_id": "r1", "failures": []}]
    assert placement["candidates"] == only_home
    assert placement["home_runner_id"] == "r1"
    assert (placement["runner_version"], placement["lease_version"]) == (7, 3)
    assert placement["attempt"] == 2
    assert placement["requested"] == REQUEST.as_dict()
    assert placement["runner"] == runner.snapshot(lease).to_record()


# -- claims -----------------------------------------------------------------------------------


def test_the_claim_holder_renews_with_a_later_end() -> None:
    found = placed()
    sandbox = found.sandbox
    assert sandbox.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
    sandbox.collect_events()
    assert sandbox.claim_reconcile(1, "rec", LATER + 2 * MINUTE, LATER)
    renewed: Any = sandbox.collect_events()[0]
    assert renewed.until == LATER + 2 * MINUTE
    record = sandbox.assignment()
    assert record is not None
    assert record["reconcile_claim_expires_at"] == LATER + 2 * MINUTE


def test_the_same_claim_at_its_end_is_refused() -> None:
    found = placed()
    sandbox = found.sandbox
    end = LATER + MINUTE
    assert sandbox.claim_reconcile(1, "rec", end, LATER)
    with pytest.raises(InvalidRequestError) as raised:
        sandbox.claim_reconcile(1, "rec", end, end)
    assert (raised.value.field, raised.value.rule) == ("until", "must be later than now")


# -- refusal messages ------------------------------------------------------------------------


def test_the_messages_of_the_runners_refusals() -> None:
    runner = new_runner()
    with pytest.raises(InvalidRequestError) as proofless:
        runner.release(sandbox_id="s1", generation=1, release_proof={}, at=LATER)
    assert str(proofless.value) == (
        "SecondBox scheduler invalid request: release_proof: must not be empty"
    )
    with pytest.raises(ConflictError) as never:
        runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=LATER)
    assert str(never.value) == (
        "runner 'r1' holds no reservation for 's1#1': capacity is released at most once"
    )


def test_the_messages_of_the_sandboxes_refusals() -> None:
    found = placed()
    sandbox, token = found.sandbox, found.token
    record = sandbox.assignment()
    assert record is not None
    assignment = repr(record["id"])
    with pytest.raises(InvalidRequestError) as proofless:
        sandbox.release(1, token, {}, LATER)
    assert (proofless.value.field, proofless.value.rule) == ("release_proof", "must not be empty")
    advanced = in_state("released")
    advanced.sandbox.advance_generation(1, LATER)
    with pytest.raises(AssignmentNotFoundError) as missing:
        advanced.sandbox.mark_running(2, token, LATER)
    assert str(missing.value) == (
        "SecondBox scheduler assignment 's1#2' not found: this generation has not been scheduled"
    )
    failed = in_state("failed")
    failed_record = failed.sandbox.assignment()
    assert failed_record is not None
    with pytest.raises(InvalidTransitionError) as not_running:
        failed.sandbox.mark_running(1, failed.token, LATER)
    assert str(not_running.value) == f"assignment {failed_record['id']!r} is failed, not assigned"
    with pytest.raises(InvalidTransitionError) as early:
        sandbox.advance_generation(1, LATER)
    assert str(early.value) == (
        f"assignment {assignment} is assigned; advance the generation only after release"
    )
    released = in_state("released")
    released_record = released.sandbox.assignment()
    assert released_record is not None
    with pytest.raises(ReleaseProofError) as other:
        released.sandbox.release(1, released.token, {"other": "proof"}, LATER)
    assert str(other.value) == (
        f"assignment {released_record['id']!r} was already released with another proof"
    )


def test_the_messages_of_a_request_that_is_not_the_pinned_one() -> None:
    runner, lease = new_runner(), new_lease()
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    prefix = "SecondBox scheduler ProfileRevision mismatch: "
    cases = {
        "workspace_id": (
            "workspace-x", "sandbox 's1' belongs to workspace 'workspace-s1', not 'workspace-x'"
        ),
        "profile_revision_id": ("profile-2", "sandbox 's1' pins 'profile-1', not 'profile-2'"),
        "requirements": (
            requirements(architecture="aarch64"), "requirements differ from those pinned by "
            "'profile-1'",
        ),
    }  # fmt: skip
    for field_name, (value, detail) in cases.items():
        with pytest.raises(ProfileRevisionMismatchError) as raised:
            sandbox.check_pinned(request("s1", LATER, **{field_name: value}))
        assert str(raised.value) == prefix + detail


def test_the_messages_of_home_runner_refusals() -> None:
    runner = new_runner(allocatable=slots(1))
    snapshot = runner.snapshot(new_lease())
    with pytest.raises(HomeRunnerUnavailableError) as unset:
        select_home_runner("", requirements(), [snapshot], T0, TIMEOUT)
    assert str(unset.value) == f"{HOME_UNAVAILABLE}: sandbox has no home runner"
    full = snapshot.model_copy(update={"reserved": slots(1)})
    with pytest.raises(HomeRunnerUnavailableError) as short:
        select_home_runner("r1", requirements(), [full], T0, TIMEOUT)
    assert str(short.value).startswith(
        f"{HOME_UNAVAILABLE}: home runner 'r1': 0/1 runners are available: "
    )


def test_only_the_first_snapshot_of_the_home_runner_counts() -> None:
    runner = new_runner(allocatable=slots(1))
    good = runner.snapshot(new_lease())
    stale = good.model_copy(update={"last_heartbeat_at": None})
    with pytest.raises(HomeRunnerUnavailableError):
        select_home_runner("r1", requirements(), [stale, good], T0, TIMEOUT)
    assert select_home_runner("r1", requirements(), [good, stale], T0, TIMEOUT) == good


# -- decision evidence -----------------------------------------------------------------------


def test_the_home_decision_always_lists_the_chosen_runner() -> None:
    """Bounded evidence keeps 8 compatible runners per decision, and the chosen one."""
    lease = new_lease("r1")
    runners = [new_runner(f"r{n:02d}", allocatable=slots(1)) for n in range(10)]
    best = new_runner("r99", allocatable=slots(3))
    sandbox = new_sandbox("s1", [r.snapshot(lease) for r in runners] + [best.snapshot(lease)])
    created: Any = sandbox.collect_events()[0]
    listed = [candidate["runner_id"] for candidate in created.home_decision["candidates"]]
    assert "r99" in listed
    assert created.home_decision["chosen_runner_id"] == "r99"


def test_summaries_count_every_runner_most_frequent_reason_first() -> None:
    draining = RunnerEvaluation("a", (RuleFailure("draining", ""),))
    short = RunnerEvaluation("b", (RuleFailure("capacity", "", {"instances": 1}),))
    shorter = RunnerEvaluation("c", (RuleFailure("capacity", "", {"instances": 2}),))
    fits = RunnerEvaluation("d", ())
    assert summarize_refusals([draining, short, shorter, fits]) == (
        "1/4 runners are available: 2 insufficient instances, 1 draining"
    )
    assert summarize_refusals([short, draining]) == (
        "0/2 runners are available: 1 draining, 1 insufficient instances"
    )
    assert summarize_refusals([fits], Unlisted(compatible=2, not_evaluated=3)) == (
        "3/6 runners are available (3 not evaluated: ranked below the chosen runner)"
    )


def test_a_fold_of_a_runner_without_a_lease_has_no_heartbeat() -> None:
    log = EventLog()
    runner = new_runner("r1")
    log.save(runner)
    (snapshot,) = log.fold().runner_snapshots()
    assert snapshot.last_heartbeat_at is None
    assert snapshot.artifact_digests == ()
    assert snapshot.materializations == ()


def test_select_runner_keeps_every_evaluation_and_a_create_refusal_bounds_them() -> None:
    lease = new_lease("r1")
    drained = []
    for n in range(12):
        runner = new_runner(f"r{n:02d}")
        runner.start_drain(T0)
        drained.append(runner.snapshot(lease))
    with pytest.raises(NoCompatibleRunnerError) as everything:
        select_runner(requirements(), drained, T0, TIMEOUT)
    assert len(everything.value.evaluations) == 12
    assert not everything.value.unlisted
    with pytest.raises(NoCompatibleRunnerError) as bounded:
        new_sandbox("s1", drained)
    assert len(bounded.value.evaluations) == 8
    assert bounded.value.unlisted == Unlisted(refused=4, reasons={"draining": 4})
    assert str(bounded.value).endswith(": 0/12 runners are available: 12 draining")


def test_an_egress_refusal_keeps_its_detail_and_its_counts() -> None:
    lease = new_lease("r1")
    runners = [new_runner(f"r{n:02d}").snapshot(lease) for n in range(10)]
    with pytest.raises(EgressContextUnavailableError) as home:
        select_home_runner("r03", requirements(egress_context="private"), runners, T0, TIMEOUT)
    assert str(home.value).startswith(
        "SecondBox scheduler egress context unavailable: home runner 'r03': 0/1 runners"
    )
    with pytest.raises(EgressContextUnavailableError) as created:
        new_sandbox("s1", runners, egress_context="private")
    assert created.value.unlisted == Unlisted(refused=2, reasons={"egress": 2})


def test_the_message_of_a_second_fence() -> None:
    found = placed()
    with pytest.raises(AlreadyExistsError) as raised:
        found.sandbox.fence(request("s1", LATER), found.runner.snapshot(found.lease),
                            runner_version=1, lease_version=2, attempt=0, clock=LATER)  # fmt: skip
    assert str(raised.value) == "sandbox 's1' generation 1 is already assigned"


def test_the_detail_of_each_rule_a_runner_fails() -> None:
    base = new_runner(allocatable=slots(1)).snapshot(new_lease())
    base = base.model_copy(update={"capabilities": base.capabilities | {"client-selected-image"}})
    stale_before = (T0 - TIMEOUT).isoformat()
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({"pool_name": "pool-b"}, {}, "pool 'pool-b' is not 'pool-a'"),
        ({"backend_kind": ""}, {"required_capabilities": frozenset({"client-selected-image"})},
         "backend kind is empty"),
        ({"capabilities": base.capabilities - {"compute"}}, {},
         "missing capability 'compute'"),
        ({}, {"required_capabilities": frozenset({"gpu", "fpga"})},
         "missing capabilities ['fpga', 'gpu']"),
        ({"capabilities": base.capabilities - {"cleanup", "storage"}}, {},
         "missing prerequisite capabilities ['storage', 'cleanup']"),
        ({"reserved": Capacity(vcpu_count=1, operations=2)}, {},
         "insufficient capacity: vcpu_count short by 1, operations short by 2"),
        ({}, {"egress_context": "private"}, "egress context 'private' is not supported"),
        ({"last_heartbeat_at": None}, {}, f"last heartbeat never is before {stale_before}"),
        ({"materializations": ()}, {},
         "no firecracker/x86_64 materialization of runtime 'sha256:runtime' and toolchain "
         "'sha256:toolchain'"),
        ({"guest_protocol_minimum": 3}, {}, "guest protocol 2 is outside [3, 3]"),
    ]  # fmt: skip
    for runner_changes, requirement_changes, detail in cases:
        runner = base.model_copy(update=runner_changes)
        evaluation = evaluate_runner(requirements(**requirement_changes), runner, T0, TIMEOUT)
        assert [failure.detail for failure in evaluation.failures] == [detail], detail


def test_guest_protocol_generation_one_is_the_lowest_accepted() -> None:
    runner = new_runner().snapshot(new_lease()).model_copy(update={"guest_protocol_minimum": 0})
    assert evaluate_runner(
        requirements(guest_protocol_generation=1), runner, T0, TIMEOUT
    ).compatible
    refused = evaluate_runner(requirements(guest_protocol_generation=0), runner, T0, TIMEOUT)
    assert refused.reason_codes == ("guest_protocol",)


def test_placement_refuses_a_bad_clock_or_timeout_naming_the_field() -> None:
    runner = new_runner().snapshot(new_lease())
    with pytest.raises(InvalidRequestError) as timeout:
        evaluate_runner(requirements(), runner, T0, 30)  # type: ignore[arg-type]
    assert (timeout.value.field, timeout.value.rule, timeout.value.value) == (
        "heartbeat_timeout", "must be a timedelta", 30,
    )  # fmt: skip
    with pytest.raises(InvalidRequestError) as naive:
        evaluate_runner(requirements(), runner, T0.replace(tzinfo=None), TIMEOUT)
    assert naive.value.field == "now"


def test_a_lease_records_each_evidence_change_and_renewals_at_their_time() -> None:
    lease = RunnerLease.open("r1", T0)
    assert (lease.last_heartbeat_at, lease.artifact_digests, lease.materializations) == (
        None, [], [],
    )  # fmt: skip
    assert lease.runner_id == "r1"
    interval = timedelta(seconds=10)

    def observe(seconds: int, digests: list[str], items: list[Any]) -> str:
        at = T0 + timedelta(seconds=seconds)
        return lease.observe(at=at, artifact_digests=digests, materializations=items,
                             renewal_interval=interval, recorded_at=at + MINUTE)  # fmt: skip

    item = new_lease().materializations[0]
    assert observe(1, [], []) == "renewed"
    assert observe(2, ["d1"], []) == "evidence"  # digests alone changed
    assert observe(3, ["d1"], [MaterializationSnapshot.from_record(item)]) == "evidence"
    assert observe(4, ["d1"], [MaterializationSnapshot.from_record(item)]) == "coalesced"
    assert observe(0, ["d2"], []) == "stale"
    assert observe(20, ["d1"], [MaterializationSnapshot.from_record(item)]) == "renewed"
    events: list[Any] = list(lease.collect_events())[1:]
    assert [type(e).__name__ for e in events] == [
        "LivenessRenewed", "EvidenceRecorded", "EvidenceRecorded", "LivenessRenewed",
    ]  # fmt: skip
    assert [e.timestamp for e in events] == [
        T0 + timedelta(seconds=s) + MINUTE for s in (1, 2, 3, 20)
    ]
    assert [e.at for e in events] == [T0 + timedelta(seconds=s) for s in (1, 2, 3, 20)]


# -- record types ----------------------------------------------------------------------------


def _keys(record_type: type[Any]) -> list[str]:
    """A TypedDict's keys, in declaration order (its bases' first)."""
    return list(record_type.__annotations__)


def test_the_record_types_name_the_keys_the_domain_stores_in_their_order() -> None:
    """The TypedDicts of stored records are for the type checker only: the records an
    aggregate writes have exactly their keys, optional ones included, in their order."""
    runner, lease = new_runner(allocatable=slots(2)), new_lease()
    sandbox = new_sandbox("s1", [runner.snapshot(lease), new_runner("r2").snapshot(lease)])
    created: Any = sandbox.collect_events()[0]
    place(sandbox, runner, lease, LATER)
    fenced: Any = sandbox.collect_events()[0]
    reserved: Any = runner.collect_events()[-1]
    assert list(created.home_decision) == _keys(HomeDecisionRecord)
    assert [list(c) for c in created.home_decision["candidates"]] == [_keys(CandidateRecord)] * 2
    assert list(created.home_decision["candidates"][0]["rank"]) == _keys(RankRecord)
    assert _keys(RankRecord) == list(RANK_FIELDS)
    assert list(created.home_decision["unlisted"]) == _keys(UnlistedRecord)
    assert list(created.requirements) == _keys(RequirementsRecord)
    assert list(fenced.assignment) == _keys(AssignmentRecord)
    assert set(_keys(AssignmentRecord)) == set(DurableAssignment.model_fields)
    assert _keys(AssignmentUpdate) == _keys(AssignmentRecord)
    assert list(fenced.placement) == _keys(PlacementRecord)
    assert list(fenced.placement["runner"]) == _keys(RunnerSnapshotRecord)
    assert list(fenced.placement["runner"]["materializations"][0]) == _keys(MaterializationRecord)
    assert list(lease.materializations[0]) == _keys(MaterializationRecord)
    assert list(runner.reservations[reserved.reservation]) == _keys(ReservationRecord)

    log = RefusalLog.open("s2", T0)
    short = RunnerEvaluation("r1", (RuleFailure("capacity", "short", {"instances": 1}),))
    log.refuse(operation="create_sandbox", generation=1, error="NoCompatibleRunnerError",
               evaluations=[short], decided_at=T0, heartbeat_timeout=TIMEOUT,
               unlisted=Unlisted(refused=1, reasons={"draining": 1}),
               requirements=requirements())  # fmt: skip
    refused: Any = log.collect_events()[-1]
    (candidate,) = refused.candidates
    assert list(candidate) == _keys(CandidateRecord)[:2]  # no rank: refused
    assert list(candidate["failures"][0]) == _keys(RuleFailureRecord)
    assert list(refused.unlisted) == _keys(UnlistedRecord)
    assert list(refused.requirements) == _keys(RequirementsRecord)
