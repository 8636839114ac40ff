"""Every check of the audit fold, reached through every kind of event that can break it.

The fold is pure, so each test builds a history event by event: a clean history made
by the real aggregates (:mod:`tests.aggregates`), then one event the aggregates would
have refused, forged by hand. The fold must report the exact position and rule, and
nothing before it. (``test_audit.py`` does the same through a store and the CLI.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain.assignment_history import assignment_history
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity
from tests.aggregates import (
    CAPABILITIES,
    PHYSICAL_STORAGE,
    PROOF,
    REQUEST,
    RUNTIME,
    T0,
    EventLog,
    fresh_token,
    materialization,
    new_lease,
    new_runner,
    new_sandbox,
    one,
    place,
    slots,
)

LATER = T0 + timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
DIMENSIONS = Capacity.DIMENSIONS


@dataclass
class World:
    """A clean history: runner r1 (room for ``room`` requests), sandboxes s1 and s2 homed
    on it, s1 placed (generation 1) with ``token``."""

    log: EventLog
    runner: Runner
    lease: RunnerLease
    sandboxes: dict[str, Sandbox]
    tokens: dict[tuple[str, int], bytes] = field(default_factory=dict)

    def place(self, sandbox_id: str) -> int:
        sandbox = self.sandboxes[sandbox_id]
        made = place(sandbox, self.runner, self.lease, LATER)
        record = sandbox.assignment()
        assert record is not None
        self.tokens[(sandbox_id, record["generation"])] = made.request.fencing_token
        return self.log.save(sandbox, self.runner, made.token_use)

    def release(self, sandbox_id: str, generation: int = 1) -> int:
        sandbox = self.sandboxes[sandbox_id]
        token = self.tokens[(sandbox_id, generation)]
        sandbox.release(generation, token, PROOF, LATER)
        self.runner.release(sandbox_id=sandbox_id, generation=generation, release_proof=PROOF,
                            at=LATER)  # fmt: skip
        return self.log.save(sandbox, self.runner)

    def fence_fields(self, sandbox_id: str = "s2") -> dict[str, Any]:
        """The fields of a correct AssignmentFenced of ``sandbox_id`` now (not appended)."""
        sandbox, runner = copy.deepcopy(self.sandboxes[sandbox_id]), copy.deepcopy(self.runner)
        place(sandbox, runner, self.lease, LATER)
        fenced = sandbox.collect_events()[-1]
        assert isinstance(fenced, Sandbox.AssignmentFenced)
        return {"assignment": dict(fenced.assignment), "placement": dict(fenced.placement)}

    def forge_fence(self, sandbox_id: str = "s2", **changes: Any) -> int:
        fields = self.fence_fields(sandbox_id)
        fields["assignment"].update(changes.pop("assignment", {}))
        fields["placement"].update(changes.pop("placement", {}))
        return self.log.forge(
            Sandbox.AssignmentFenced, self.sandboxes[sandbox_id].id, **fields, **changes
        )

    def forge_reserved(
        self, sandbox_id: str = "s2", generation: int = 1, capacity: Capacity = REQUEST
    ) -> int:
        return self.log.forge(
            Runner.CapacityReserved, self.runner.id, reservation=f"{sandbox_id}#{generation}",
            assignment_id=f"forged-{sandbox_id}", sandbox_id=sandbox_id, generation=generation,
            capacity=capacity.as_dict(),
        )  # fmt: skip

    def forge_released(
        self, sandbox_id: str = "s1", capacity: Capacity = REQUEST, proof: Any = None
    ) -> int:
        return self.log.forge(
            Runner.CapacityReleased, self.runner.id, reservation=f"{sandbox_id}#1",
            assignment_id=f"a-{sandbox_id}", capacity=capacity.as_dict(),
            release_proof=PROOF if proof is None else proof,
        )  # fmt: skip


def world(room: int = 2, capabilities: tuple[str, ...] = CAPABILITIES) -> World:
    log = EventLog()
    runner = new_runner("r1", allocatable=slots(room), capabilities=capabilities)
    lease = new_lease("r1")
    log.save(runner, lease)
    sandboxes = {s: new_sandbox(s, [runner.snapshot(lease)]) for s in ("s1", "s2")}
    log.save(*sandboxes.values())
    found = World(log, runner, lease, sandboxes)
    found.place("s1")
    assert log.violations() == []
    return found


def rules_at(log: EventLog, position: int) -> set[str]:
    """The rules broken at ``position``; and nothing was reported before it."""
    violations = log.violations()
    assert violations, "the broken history was not caught"
    assert min(v.position for v in violations) == position, [str(v) for v in violations]
    return {v.rule for v in violations if v.position == position}


def details_at(log: EventLog, position: int, rule: str) -> list[str]:
    return [v.detail for v in log.violations() if v.position == position and v.rule == rule]


# -- clean histories ----------------------------------------------------------------------


def test_a_runner_filled_to_exactly_its_allocatable_is_clean() -> None:
    w = world(room=2)
    w.place("s2")
    assert w.runner.snapshot(w.lease).free() == Capacity()
    assert w.log.violations() == []


def test_a_whole_lifecycle_is_clean_and_the_folds_state_equals_the_aggregates() -> None:
    w = world(room=2)
    w.place("s2")
    s1, s2 = w.sandboxes["s1"], w.sandboxes["s2"]
    s1.mark_running(1, w.tokens[("s1", 1)], LATER)
    s1.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
    s1.reconcile(1, "rec", "uncertain", "silent", LATER + MINUTE, LATER)
    s1.release_reconcile_claim(1, "rec", LATER)
    s2.fail(1, w.tokens[("s2", 1)], "transport", LATER)
    w.log.save(s1, s2)
    w.release("s1")
    s1.advance_generation(1, LATER)
    w.log.save(s1)
    w.runner.start_drain(LATER)
    w.runner.cancel_drain(LATER)
    w.runner.change_allocatable(slots(3), LATER)
    for seconds in (2, 200):  # one evidence change, then one renewal
        at = LATER + timedelta(seconds=seconds)
        w.lease.observe(at=at, artifact_digests=[RUNTIME, "sha256:other"],
                        materializations=[materialization()], renewal_interval=MINUTE,
                        recorded_at=at)  # fmt: skip
    w.log.save(w.runner, w.lease)
    w.place("s1")  # generation 2
    audit = w.log.fold()
    assert audit.violations == []
    assert audit.runner_snapshots() == [w.runner.snapshot(w.lease)]
    history = {
        sandbox.sandbox_id: assignment_history(
            e for e in w.log.events if e.originator_id == sandbox.id
        )
        for sandbox in (s1, s2)
    }
    expected = [history["s1"][1], history["s1"][2], history["s2"][1]]
    assert audit.assignment_records() == expected
    assert audit.owed == {"r1": w.runner.snapshot(w.lease).reserved.as_dict()}
    assert audit.events == len(w.log.events)


def test_a_deregistered_runner_leaves_the_folds_snapshots() -> None:
    log = EventLog()
    runner, lease = new_runner("r1"), new_lease("r1")
    runner.deregister(LATER)
    log.save(runner, lease)
    audit = log.fold()
    assert audit.violations == []
    assert audit.runner_snapshots() == []


def test_refusals_are_kept_with_their_position() -> None:
    w = world()
    refusals = RefusalLog.open("s2", LATER)
    refusals.refuse(operation="schedule", generation=1, error="HomeRunnerUnavailableError",
                    evaluations=[], decided_at=LATER, heartbeat_timeout=MINUTE)  # fmt: skip
    position = w.log.save(refusals)
    audit = w.log.fold()
    assert audit.violations == []
    (kept,) = audit.refusals[str(refusals.id)]
    assert (kept["position"], kept["operation"], kept["generation"]) == (position, "schedule", 1)
    assert kept["error"] == "HomeRunnerUnavailableError"


# -- invariant 1: reserved <= allocatable ------------------------------------------------


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_invariant_1_a_reservation_past_allocatable_on_any_dimension(dim: str) -> None:
    w = world(room=2)
    left = w.runner.snapshot(w.lease).free().as_dict()[dim]
    position = w.forge_reserved(capacity=one(dim, left + 1))
    assert "invariant-1" in rules_at(w.log, position)
    (detail,) = details_at(w.log, position, "invariant-1")
    assert f"reserved {dim} " in detail
    violation = next(v for v in w.log.violations() if v.rule == "invariant-1")
    assert violation.event == "Runner.CapacityReserved"
    assert violation.aggregate == "Runner r1"


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_invariant_1_a_reservation_up_to_allocatable_is_not_a_breach(dim: str) -> None:
    w = world(room=2)
    left = w.runner.snapshot(w.lease).free().as_dict()[dim]
    position = w.forge_reserved(capacity=one(dim, left))
    assert "invariant-1" not in rules_at(w.log, position)


def test_invariant_1_disk_past_allocatable_is_no_breach_with_physical_storage_admission() -> None:
    w = world(room=1, capabilities=(*CAPABILITIES, PHYSICAL_STORAGE))
    position = w.forge_reserved(capacity=one("disk_bytes", 10**9))
    assert "invariant-1" not in rules_at(w.log, position)
    position = w.forge_reserved(sandbox_id="s3", capacity=one("operations", 1))
    assert "invariant-1" in {v.rule for v in w.log.violations() if v.position == position}


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_invariant_1_allocatable_changed_below_reserved(dim: str) -> None:
    w = world(room=2)
    wanted = slots(2).as_dict()
    wanted[dim] = REQUEST.as_dict()[dim] - 1
    position = w.log.forge(Runner.AllocatableChanged, w.runner.id, allocatable=wanted)
    assert rules_at(w.log, position) == {"invariant-1"}
    wanted[dim] += 1
    w.log.events.pop()
    w.log.forge(Runner.AllocatableChanged, w.runner.id, allocatable=wanted)
    assert w.log.violations() == []


# -- invariant 2: reserved = sum of unreleased assignments -------------------------------


def test_invariant_2_a_reservation_without_a_fence() -> None:
    w = world()
    position = w.forge_reserved()
    assert rules_at(w.log, position) == {"invariant-2"}


def test_invariant_2_a_fence_followed_by_another_event() -> None:
    w = world()
    w.forge_fence()
    position = w.log.forge(Runner.DrainStarted, w.runner.id)
    assert "invariant-2" in rules_at(w.log, position)


def test_invariant_2_a_fence_at_the_end_of_the_log() -> None:
    w = world()
    position = w.forge_fence()
    assert rules_at(w.log, position) == {"invariant-2"}
    assert "no matching CapacityReserved" in details_at(w.log, position, "invariant-2")[0]


@pytest.mark.parametrize("mismatch", ["sandbox", "generation", "capacity", "runner"])
def test_invariant_2_a_reservation_that_does_not_match_its_fence(mismatch: str) -> None:
    w = world(room=3)
    other = new_runner("r2")
    w.log.save(other)
    w.forge_fence()
    if mismatch == "runner":
        position = w.log.forge(
            Runner.CapacityReserved, other.id, reservation="s2#1", assignment_id="a",
            sandbox_id="s2", generation=1, capacity=REQUEST.as_dict(),
        )  # fmt: skip
    else:
        position = w.forge_reserved(
            sandbox_id="s3" if mismatch == "sandbox" else "s2",
            generation=2 if mismatch == "generation" else 1,
            capacity=slots(1, operations=1) if mismatch == "capacity" else REQUEST,
        )
    assert "invariant-2" in rules_at(w.log, position)
    assert any("matches no assignment" in d for d in details_at(w.log, position, "invariant-2"))


def test_invariant_2_a_release_followed_by_another_event() -> None:
    w = world()
    w.log.forge(Sandbox.AssignmentReleased, w.sandboxes["s1"].id, generation=1,
                release_proof=PROOF)  # fmt: skip
    position = w.log.forge(Runner.DrainStarted, w.runner.id)
    assert "invariant-2" in rules_at(w.log, position)


def test_invariant_2_a_capacity_release_of_another_amount() -> None:
    w = world()
    w.log.forge(Sandbox.AssignmentReleased, w.sandboxes["s1"].id, generation=1,
                release_proof=PROOF)  # fmt: skip
    position = w.forge_released(capacity=slots(1, vcpu_count=-1))
    assert rules_at(w.log, position) == {"invariant-2"}
    assert "unreleased assignments sum to" in details_at(w.log, position, "invariant-2")[0]


def test_invariant_2_a_capacity_release_past_zero() -> None:
    w = world()
    w.log.forge(Sandbox.AssignmentReleased, w.sandboxes["s1"].id, generation=1,
                release_proof=PROOF)  # fmt: skip
    position = w.forge_released(capacity=slots(1, memory_bytes=1))
    assert "invariant-2" in rules_at(w.log, position)
    assert any("memory_bytes < 0" in d for d in details_at(w.log, position, "invariant-2"))


def test_invariant_2_deregistered_while_reserved() -> None:
    w = world()
    position = w.log.forge(Runner.Deregistered, w.runner.id)
    assert rules_at(w.log, position) == {"invariant-2"}


# -- invariant 3: one assignment per generation, tokens never repeat --------------------


def test_invariant_3_a_second_assignment_for_a_generation() -> None:
    w = world(room=3)
    original = next(e for e in w.log.events if isinstance(e, Sandbox.AssignmentFenced))
    assignment = {**original.assignment, "fencing_token": fresh_token().hex()}
    position = w.log.forge(Sandbox.AssignmentFenced, w.sandboxes["s1"].id,
                           assignment=assignment, placement=original.placement)  # fmt: skip
    assert "invariant-3" in rules_at(w.log, position)
    assert any("second assignment" in d for d in details_at(w.log, position, "invariant-3"))


def test_invariant_3_an_assignment_for_another_generation() -> None:
    w = world(room=3)
    position = w.forge_fence(assignment={"generation": 2})
    assert "invariant-3" in rules_at(w.log, position)
    assert any("while current is 1" in d for d in details_at(w.log, position, "invariant-3"))


def test_invariant_3_a_token_of_an_earlier_generation_reused() -> None:
    w = world(room=3)
    w.release("s1")
    s1 = w.sandboxes["s1"]
    s1.advance_generation(1, LATER)
    w.log.save(s1)
    position = w.forge_fence("s1", assignment={"fencing_token": w.tokens[("s1", 1)].hex()})
    w.forge_reserved("s1", generation=2)
    assert rules_at(w.log, position) == {"invariant-3"}
    assert "fencing token reused" in details_at(w.log, position, "invariant-3")[0]


def test_invariant_3_a_second_reservation_for_one_sandbox_generation() -> None:
    w = world(room=3)
    position = w.forge_reserved(sandbox_id="s1")
    assert "invariant-3" in rules_at(w.log, position)


# -- invariant 4: the home runner, compatible by the recorded evidence --------------------


def test_invariant_4_an_assignment_on_another_runner() -> None:
    w = world()
    position = w.forge_fence(assignment={"runner_id": "r2"})
    assert "invariant-4" in rules_at(w.log, position)
    assert any("home runner is 'r1'" in d for d in details_at(w.log, position, "invariant-4"))


def evidence(w: World, **changes: Any) -> dict[str, Any]:
    runner = dict(w.fence_fields()["placement"]["runner"])
    runner.update(changes)
    return runner


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"last_heartbeat_at": (T0 - timedelta(hours=1)).isoformat()}, "last heartbeat"),
        ({"guest_protocol_maximum": 1}, "guest protocol"),
        ({"materializations": []}, "materialization"),
        ({"reserved": slots(2).as_dict()}, "insufficient capacity"),
        ({"drain_phase": "draining"}, "drain phase"),
    ],
)
def test_invariant_4_evidence_of_an_incompatible_runner(
    changes: dict[str, Any], words: str
) -> None:
    w = world()
    position = w.forge_fence(placement={"runner": evidence(w, **changes)})
    found = details_at(w.log, position, "invariant-4")
    assert any("was not compatible" in d and words in d for d in found), found


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("allocatable", slots(5).as_dict()),
        ("reserved", Capacity().as_dict()),
        ("drain_phase", "draining"),
        ("capabilities", [*CAPABILITIES, "gpu"]),
        ("pool_name", "pool-b"),
        ("architecture", "aarch64"),
        ("backend_kind", "cloud-hypervisor"),
    ],
)
def test_invariant_4_evidence_that_differs_from_the_runner_in_the_log(key: str, value: Any) -> None:
    w = world()
    position = w.forge_fence(placement={"runner": evidence(w, **{key: value})})
    assert any(
        d.startswith(f"evidence {key} ") for d in details_at(w.log, position, "invariant-4")
    ), w.log.violations()


def test_invariant_4_capacity_that_differs_from_the_pinned_requirements() -> None:
    w = world(room=3)
    position = w.forge_fence(assignment={"capacity": slots(2).as_dict()})
    assert "reserved capacity differs" in " ".join(details_at(w.log, position, "invariant-4"))


def test_invariant_4_a_runner_version_that_is_not_the_runners() -> None:
    w = world()
    version = w.runner.version
    position = w.forge_fence(placement={"runner_version": version - 1})
    assert rules_at(w.log, position) >= {"invariant-4"}
    assert any(f"was at {version}" in d for d in details_at(w.log, position, "invariant-4"))


def test_invariant_4_a_lease_version_not_yet_recorded() -> None:
    w = world()
    position = w.forge_fence(placement={"lease_version": w.lease.version + 1})
    assert any("not yet recorded" in d for d in details_at(w.log, position, "invariant-4"))


def test_invariant_4_heartbeat_evidence_that_differs_from_the_lease() -> None:
    w = world()
    moved = (T0 + timedelta(seconds=5)).isoformat()
    position = w.forge_fence(placement={"runner": evidence(w, last_heartbeat_at=moved)})
    w.forge_reserved()
    assert rules_at(w.log, position) == {"invariant-4"}
    assert "differs from the lease at version 2" in details_at(w.log, position, "invariant-4")[0]


@pytest.mark.parametrize("part", ["artifact_digests", "materializations"])
def test_invariant_4_artifact_evidence_that_differs_from_the_lease(part: str) -> None:
    w = world()
    runner = evidence(w)
    extra = runner["materializations"][0] | {"digest": "sha256:other"}
    changed = ["sha256:other"] if part == "artifact_digests" else [*runner[part], extra]
    position = w.forge_fence(placement={"runner": evidence(w, **{part: changed})})
    assert any("heartbeat evidence" in d for d in details_at(w.log, position, "invariant-4"))


def test_invariant_4_evidence_of_the_lease_at_an_earlier_version_is_accepted() -> None:
    w = world()
    fields = w.fence_fields()
    w.lease.observe(at=LATER, artifact_digests=["sha256:new"], materializations=[],
                    renewal_interval=MINUTE, recorded_at=LATER)  # fmt: skip
    w.log.save(w.lease)
    w.log.forge(Sandbox.AssignmentFenced, w.sandboxes["s2"].id, **fields)
    w.forge_reserved()
    assert w.log.violations() == []


def test_invariant_4_a_deregistered_runner() -> None:
    log = EventLog()
    runner, lease = new_runner("r1"), new_lease("r1")
    log.save(runner, lease)
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    log.save(sandbox)
    scratch = copy.deepcopy(sandbox)
    place(scratch, copy.deepcopy(runner), lease, LATER)
    fenced: Any = scratch.collect_events()[-1]
    runner.deregister(LATER)
    log.save(runner)
    position = log.forge(
        Sandbox.AssignmentFenced, sandbox.id, assignment=fenced.assignment,
        placement=fenced.placement,
    )  # fmt: skip
    assert any(
        "was deregistered" in v.detail and v.rule == "invariant-4"
        for v in log.violations()
        if v.position == position
    )


def test_invariant_4_a_runner_that_was_never_registered_or_has_no_lease() -> None:
    log = EventLog()
    runner, lease = new_runner("r1"), new_lease("r1")
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    log.save(sandbox)
    scratch = copy.deepcopy(sandbox)
    place(scratch, copy.deepcopy(runner), lease, LATER)
    fenced: Any = scratch.collect_events()[-1]
    position = log.forge(Sandbox.AssignmentFenced, sandbox.id, assignment=fenced.assignment,
                         placement=fenced.placement)  # fmt: skip
    assert any(
        "is not registered" in v.detail and v.rule == "invariant-4"
        for v in log.violations()
        if v.position == position
    )
    log.events.pop()
    log.save(runner)  # registered, but its lease never opened
    position = log.forge(Sandbox.AssignmentFenced, sandbox.id, assignment=fenced.assignment,
                         placement=fenced.placement)  # fmt: skip
    assert any(
        "has no lease" in v.detail and v.rule == "invariant-4"
        for v in log.violations()
        if v.position == position
    )


def created_fields(w: World, **decision: Any) -> dict[str, Any]:
    scratch = new_sandbox("s3", [w.runner.snapshot(w.lease)])
    created: Any = scratch.collect_events()[0]
    fields = {
        name: getattr(created, name)
        for name in ("sandbox_id", "workspace_id", "profile_revision_id", "requirements",
                     "home_runner_id")
    }  # fmt: skip
    fields["home_decision"] = {**created.home_decision, **decision}
    return {"id": scratch.id, **fields}


def forge_created(w: World, **decision: Any) -> int:
    fields = created_fields(w, **decision)
    stream = fields.pop("id")
    w.log.events.append(
        Sandbox.Created(originator_id=stream, originator_version=1, timestamp=LATER,
                        originator_topic="secondbox_scheduler.domain.sandbox:Sandbox", **fields)
    )  # fmt: skip
    return len(w.log.events)


def test_invariant_4_a_home_decision_that_chose_another_runner() -> None:
    w = world()
    position = forge_created(w, chosen_runner_id="r9")
    assert any("home decision chose 'r9'" in d for d in details_at(w.log, position, "invariant-4"))


def test_invariant_4_a_home_runner_not_listed_as_compatible() -> None:
    w = world()
    refused = [{"runner_id": "r1", "failures": [{"code": "draining", "detail": "d"}]}]
    position = forge_created(w, candidates=refused)
    assert rules_at(w.log, position) == {"invariant-4"}
    assert "not listed as compatible" in details_at(w.log, position, "invariant-4")[0]


def test_invariant_4_a_listed_runner_that_ranks_above_the_home_runner() -> None:
    w = world()
    candidates = copy.deepcopy(created_fields(w)["home_decision"]["candidates"])
    better = {**candidates[0], "runner_id": "r0"}
    better["rank"] = {**better["rank"], "free_instances": better["rank"]["free_instances"] + 1}
    position = forge_created(w, candidates=[*candidates, better])
    assert rules_at(w.log, position) == {"invariant-4"}
    assert "'r0' ranks above home 'r1'" in details_at(w.log, position, "invariant-4")[0]
    w.log.events.pop()
    tied = {**candidates[0], "runner_id": "r0"}  # same rank, smaller id: ranks above too
    position = forge_created(w, candidates=[*candidates, tied])
    assert rules_at(w.log, position) == {"invariant-4"}
    w.log.events.pop()
    worse = {**candidates[0], "runner_id": "r2"}  # same rank, larger id: below
    forge_created(w, candidates=[*candidates, worse])
    assert w.log.violations() == []


# -- invariant 5: nothing reserved on a draining or deregistered runner -------------------


def test_invariant_5_a_reservation_on_a_draining_runner() -> None:
    w = world(room=3)
    fields = w.fence_fields()
    w.runner.start_drain(LATER)
    w.log.save(w.runner)
    fields["placement"]["runner"] = {**fields["placement"]["runner"], "drain_phase": "draining"}
    fields["placement"]["runner_version"] = w.runner.version
    w.log.forge(Sandbox.AssignmentFenced, w.sandboxes["s2"].id, **fields)
    position = w.forge_reserved()
    assert rules_at(w.log, position - 1) == {"invariant-4"}  # the fence: evidence draining
    assert {v.rule for v in w.log.violations() if v.position == position} == {"invariant-5"}


def test_invariant_5_a_reservation_on_a_deregistered_runner() -> None:
    log = EventLog()
    runner, lease = new_runner("r1"), new_lease("r1")
    runner.deregister(LATER)
    log.save(runner, lease)
    position = log.forge(
        Runner.CapacityReserved, runner.id, reservation="s1#1", assignment_id="a",
        sandbox_id="s1", generation=1, capacity=REQUEST.as_dict(),
    )  # fmt: skip
    assert "invariant-5" in rules_at(log, position)
    assert any("deregistered runner" in d for d in details_at(log, position, "invariant-5"))


# -- invariant 6: released at most once, only with proof ---------------------------------


def release_event(w: World, sandbox_id: str = "s1", generation: int = 1, proof: Any = None) -> int:
    return w.log.forge(
        Sandbox.AssignmentReleased, w.sandboxes[sandbox_id].id, generation=generation,
        release_proof=PROOF if proof is None else proof,
    )  # fmt: skip


def test_invariant_6_capacity_released_without_proof() -> None:
    w = world()
    release_event(w)
    position = w.forge_released(proof={})
    assert rules_at(w.log, position) == {"invariant-6"}
    assert "without proof" in details_at(w.log, position, "invariant-6")[0]


def test_invariant_6_capacity_released_twice() -> None:
    w = world()
    w.release("s1")
    position = w.forge_released()
    assert "invariant-6" in rules_at(w.log, position)
    assert any("not held (twice?)" in d for d in details_at(w.log, position, "invariant-6"))


def test_invariant_6_capacity_released_without_the_assignments_release() -> None:
    w = world()
    position = w.forge_released()
    assert "invariant-6" in rules_at(w.log, position)
    assert any("without the assignment" in d for d in details_at(w.log, position, "invariant-6"))


def test_invariant_6_an_assignment_released_twice() -> None:
    w = world()
    w.release("s1")
    position = release_event(w)
    assert "invariant-6" in rules_at(w.log, position)
    assert "released twice" in details_at(w.log, position, "invariant-6")[0]


def test_invariant_6_an_assignment_released_without_proof() -> None:
    w = world()
    position = release_event(w, proof={})
    assert "invariant-6" in rules_at(w.log, position)
    assert "released without proof" in details_at(w.log, position, "invariant-6")


def test_invariant_6_a_release_of_a_generation_never_fenced() -> None:
    w = world()
    position = release_event(w, "s2")
    assert rules_at(w.log, position) == {"invariant-6"}
    assert "never fenced" in details_at(w.log, position, "invariant-6")[0]


@pytest.mark.parametrize("state", ["assigned", "running", "failed", "uncertain", "unfenced"])
def test_invariant_6_a_generation_advanced_before_its_release(state: str) -> None:
    w = world()
    sandbox_id = "s2" if state == "unfenced" else "s1"
    s1, token = w.sandboxes["s1"], w.tokens[("s1", 1)]
    if state == "running":
        s1.mark_running(1, token, LATER)
    elif state == "failed":
        s1.fail(1, token, "admission", LATER)
    elif state == "uncertain":
        s1.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
        s1.reconcile(1, "rec", "uncertain", "silent", None, LATER)
    w.log.save(s1)
    position = w.log.forge(Sandbox.GenerationAdvanced, w.sandboxes[sandbox_id].id, generation=2)
    assert rules_at(w.log, position) == {"invariant-6"}


# -- a history that does not hang together -------------------------------------------------


def test_events_of_a_runner_never_registered_or_a_sandbox_never_created() -> None:
    w = world()
    stranger = new_runner("r9")
    position = w.log.forge(Runner.DrainStarted, stranger.id)
    assert rules_at(w.log, position) == {"history"}
    w.log.events.pop()
    ghost = new_sandbox("s9", [w.runner.snapshot(w.lease)])
    position = w.log.forge(Sandbox.AssignmentRunning, ghost.id, generation=1)
    assert rules_at(w.log, position) == {"history"}
    violation = w.log.violations()[0]
    assert violation.aggregate == f"Sandbox {ghost.id}"
    assert str(violation).startswith(f"#{position} Sandbox {ghost.id} Sandbox.AssignmentRunning:")
    assert violation.to_dict()["rule"] == "history"


def test_an_update_of_a_generation_never_fenced() -> None:
    w = world()
    position = w.log.forge(Sandbox.AssignmentRunning, w.sandboxes["s2"].id, generation=1)
    assert rules_at(w.log, position) == {"history"}
    assert "unfenced generation 1" in details_at(w.log, position, "history")[0]


def test_a_fold_reports_each_events_violations_as_it_applies_it() -> None:
    w = world()
    position = w.forge_reserved()
    audit = AuditFold()
    for index, event in enumerate(w.log.events, start=1):
        found = audit.apply(index, event)
        assert bool(found) == (index == position)
    assert audit.position == position


def test_a_copy_of_a_fold_folds_on_without_touching_the_original() -> None:
    """The adversarial verify forges events on copies of the final fold."""
    w = world()
    audit = w.log.fold()
    scratch = copy.deepcopy(audit)
    drained = Runner.DrainStarted(
        originator_id=w.runner.id, originator_version=w.log.version(w.runner.id) + 1,
        timestamp=LATER,
    )  # fmt: skip
    assert scratch.apply(audit.position + 1, drained) == []
    assert scratch.runner_snapshots()[0].drain_phase == "draining"
    assert audit.runner_snapshots()[0].drain_phase == "active"
    assert audit.position == len(w.log.events)


# -- what an operator reads: the exact violation, for each message of the fold -------------


def reported(log: EventLog, position: int) -> list[tuple[str, str, str]]:
    """(aggregate, rule, detail) of every violation at ``position``."""
    return [(v.aggregate, v.rule, v.detail) for v in log.violations() if v.position == position]


def test_the_exact_report_of_each_runner_breach() -> None:
    w = world(room=2)
    r1 = "Runner r1"
    position = w.forge_reserved(capacity=one("operations", 8))
    assert reported(w.log, position) == [
        (r1, "invariant-2", "reservation 's2#1' on 'r1' matches no assignment fenced in the "
                            "same transaction"),
        (r1, "invariant-1", "runner 'r1' reserved operations 15 > allocatable 14"),
    ]  # fmt: skip
    w.log.events.pop()
    position = w.forge_reserved(sandbox_id="s1")
    assert ("Runner r1", "invariant-3", "second reservation 's1#1'") in reported(w.log, position)
    w.log.events.pop()
    position = w.log.forge(Runner.Deregistered, w.runner.id)
    assert reported(w.log, position) == [
        (r1, "invariant-2", "runner 'r1' deregistered while reserved")
    ]
    position = w.forge_reserved(sandbox_id="s3")
    assert (r1, "invariant-5", "reservation on deregistered runner 'r1'") in reported(
        w.log, position
    )


def test_the_exact_report_of_each_release_breach() -> None:
    w = world()
    r1, s1 = "Runner r1", "Sandbox s1"
    position = w.forge_released(proof={})
    assert reported(w.log, position) == [
        (r1, "invariant-6", "capacity of 's1#1' released without proof"),
        (r1, "invariant-6", "capacity of 's1#1' released without the assignment's release"),
        (r1, "invariant-2", "runner 'r1' reserved {'vcpu_count': 0, 'memory_bytes': 0, "
                            "'disk_bytes': 0, 'instances': 0, 'operations': 0} but its "
                            "unreleased assignments sum to {'vcpu_count': 2, 'memory_bytes': 3, "
                            "'disk_bytes': 5, 'instances': 1, 'operations': 7}"),
    ]  # fmt: skip
    w.log.events.pop()
    w.release("s1")
    position = w.forge_released()
    assert (r1, "invariant-6", "capacity of 's1#1' released but not held (twice?)") in reported(
        w.log, position
    )
    assert (r1, "invariant-2", "runner 'r1' reserved vcpu_count < 0") in reported(w.log, position)
    w.log.events.pop()
    position = release_event(w, proof={})
    assert reported(w.log, position) == [
        (s1, "invariant-6", "generation 1 released twice"),
        (s1, "invariant-6", "released without proof"),
        # the end of the log: the release's capacity release never came
        (
            s1,
            "invariant-2",
            f"release of s1#1 at #{position} has no matching CapacityReleased "
            "before the end of the log",
        ),
    ]
    after = w.log.forge(Runner.DrainStarted, w.runner.id)
    assert reported(w.log, after) == [
        (r1, "invariant-2", f"release of s1#1 at #{position} has no matching CapacityReleased in "
                            "the same transaction"),
    ]  # fmt: skip
    del w.log.events[-2:]
    position = release_event(w, "s2")
    assert reported(w.log, position) == [
        ("Sandbox s2", "invariant-6", "release of generation 1 never fenced")
    ]
    w.log.events.pop()
    position = w.log.forge(Sandbox.GenerationAdvanced, w.sandboxes["s2"].id, generation=2)
    assert reported(w.log, position) == [
        ("Sandbox s2", "invariant-6", "generation advanced before its assignment was released")
    ]


def test_the_exact_report_of_each_fence_breach() -> None:
    w = world(room=3)
    s2 = "Sandbox s2"
    position = w.forge_fence(assignment={"generation": 2, "runner_id": "r9"})
    assert reported(w.log, position) == [
        (s2, "invariant-3", "assignment for generation 2 while current is 1"),
        (s2, "invariant-4", "assignment on 'r9' but the home runner is 'r1'"),
        (s2, "invariant-4", "runner 'r9' is not registered"),
        (
            s2,
            "invariant-2",
            f"reserve of s2#2 at #{position} has no matching CapacityReserved "
            "before the end of the log",
        ),
    ]
    w.log.events.pop()
    capacity = slots(2).as_dict()
    position = w.forge_fence(assignment={"capacity": capacity}, placement={"runner_version": 1})
    assert reported(w.log, position) == [
        (s2, "invariant-4", "reserved capacity differs from the pinned requirements"),
        (s2, "invariant-4", f"evidence of runner version 1 but the runner was at "
                            f"{w.runner.version}"),
        (s2, "invariant-2", f"reserve of s2#1 at #{position} has no matching CapacityReserved "
                            "before the end of the log"),
    ]  # fmt: skip
    w.log.events.pop()
    stale = evidence(w, last_heartbeat_at=(T0 - timedelta(hours=1)).isoformat(), drain_phase="x")
    position = w.forge_fence(placement={"runner": stale, "lease_version": 9})
    decided = LATER - timedelta(seconds=30)
    assert reported(w.log, position) == [
        (s2, "invariant-4", "runner 'r1' was not compatible: drain phase is 'x', last heartbeat "
                            f"{(T0 - timedelta(hours=1)).isoformat()} is before "
                            f"{decided.isoformat()}"),
        (s2, "invariant-4", "evidence drain_phase 'x' differs from the runner's 'active'"),
        (s2, "invariant-4", "evidence of lease version 9 not yet recorded"),
        (s2, "invariant-2", f"reserve of s2#1 at #{position} has no matching CapacityReserved "
                            "before the end of the log"),
    ]  # fmt: skip


def test_the_exact_report_of_a_history_that_does_not_hang_together() -> None:
    w = world()
    stranger, ghost = new_runner("r9"), new_sandbox("s9", [w.runner.snapshot(w.lease)])
    position = w.log.forge(Runner.DrainStarted, stranger.id)
    assert reported(w.log, position) == [
        (f"Runner {stranger.id}", "history", "event of a runner that was never registered")
    ]
    w.log.events.pop()
    position = w.log.forge(Sandbox.GenerationAdvanced, ghost.id, generation=2)
    assert reported(w.log, position) == [
        (f"Sandbox {ghost.id}", "history", "event of a sandbox that was never created")
    ]
    w.log.events.pop()
    position = w.log.forge(Sandbox.AssignmentRunning, w.sandboxes["s2"].id, generation=1)
    assert reported(w.log, position) == [
        ("Sandbox s2", "history", "AssignmentRunning of unfenced generation 1")
    ]


def test_a_violation_as_a_record_and_as_text() -> None:
    w = world()
    position = w.log.forge(Runner.Deregistered, w.runner.id)
    (violation,) = w.log.violations()
    assert violation.to_dict() == {
        "position": position,
        "aggregate": "Runner r1",
        "event": "Runner.Deregistered",
        "rule": "invariant-2",
        "detail": "runner 'r1' deregistered while reserved",
    }
    assert str(violation) == (
        f"#{position} Runner r1 Runner.Deregistered: invariant-2: "
        "runner 'r1' deregistered while reserved"
    )


def test_an_empty_fold_is_at_position_zero() -> None:
    audit = AuditFold()
    assert (audit.position, audit.events, audit.finish()) == (0, 0, [])
    assert audit.runner_snapshots() == []
    assert audit.assignment_records() == []


def test_the_folds_runner_snapshots_are_sorted_by_id() -> None:
    log = EventLog()
    for runner_id in ("rc", "ra", "rb"):
        log.save(new_runner(runner_id), new_lease(runner_id))
    assert [snapshot.id for snapshot in log.fold().runner_snapshots()] == ["ra", "rb", "rc"]


def test_apply_returns_only_the_violations_of_the_event_it_applied() -> None:
    w = world()
    position = w.forge_reserved()
    w.lease.observe(at=LATER, artifact_digests=["sha256:x"], materializations=[],
                    renewal_interval=MINUTE, recorded_at=LATER)  # fmt: skip
    w.log.save(w.lease)
    audit = AuditFold()
    found = [audit.apply(index, event) for index, event in enumerate(w.log.events, start=1)]
    assert [index for index, new in enumerate(found, start=1) if new] == [position]


def test_the_best_ranked_home_runner_is_no_breach_whatever_the_ids() -> None:
    w = world()
    candidates = copy.deepcopy(created_fields(w)["home_decision"]["candidates"])
    worse = {**candidates[0], "runner_id": "r0"}  # a smaller id, but fewer free instances
    worse["rank"] = {**worse["rank"], "free_instances": worse["rank"]["free_instances"] - 1}
    forge_created(w, candidates=[*candidates, worse])
    assert w.log.violations() == []
    w.log.events.pop()
    position = forge_created(w, chosen_runner_id="r0", candidates=[*candidates, worse])
    assert reported(w.log, position) == [("Sandbox s3", "invariant-4", "home decision chose 'r0'")]


def test_a_capacity_release_on_a_runner_that_never_held_anything() -> None:
    w = world()
    other, lease = new_runner("r2"), new_lease("r2")
    w.log.save(other, lease)
    w.log.forge(Sandbox.AssignmentReleased, w.sandboxes["s1"].id, generation=1,
                release_proof=PROOF)  # fmt: skip
    position = w.log.forge(
        Runner.CapacityReleased, other.id, reservation="s1#1", assignment_id="a",
        capacity=Capacity(instances=1).as_dict(), release_proof=PROOF,
    )  # fmt: skip
    zero = Capacity().as_dict()
    assert ("Runner r2", "invariant-2", f"runner 'r2' reserved {dict(zero, instances=-1)} but "
            f"its unreleased assignments sum to {zero}") in reported(w.log, position)  # fmt: skip


def test_the_exact_report_of_a_reservation_on_a_draining_runner_and_of_another_amount() -> None:
    w = world(room=3)
    w.forge_fence()
    position = w.forge_reserved(capacity=slots(1, operations=1))
    wanted = dict(REQUEST.as_dict())
    owed = {dim: 2 * amount for dim, amount in wanted.items()}
    reserved = dict(owed, operations=owed["operations"] + 1)
    assert reported(w.log, position) == [
        ("Runner r1", "invariant-2", "reservation 's2#1' on 'r1' matches no assignment fenced "
                                     "in the same transaction"),
        ("Runner r1", "invariant-2", f"runner 'r1' reserved {reserved} but its unreleased "
                                     f"assignments sum to {owed}"),
    ]  # fmt: skip
    del w.log.events[-2:]
    w.runner.start_drain(LATER)
    w.log.save(w.runner)
    position = w.forge_reserved()
    assert ("Runner r1", "invariant-5", "reservation on draining runner 'r1'") in reported(
        w.log, position
    )


def test_evidence_of_a_lease_before_its_first_heartbeat() -> None:
    w = world()
    position = w.forge_fence(placement={"lease_version": 1})
    w.forge_reserved()
    assert reported(w.log, position) == [
        ("Sandbox s2", "invariant-4", "heartbeat evidence differs from the lease at version 1")
    ]


def test_heartbeats_of_a_lease_never_opened_are_ignored() -> None:
    w = world()
    stranger = new_lease("r9")
    stranger.collect_events()
    w.log.forge(RunnerLease.LivenessRenewed, stranger.id, at=LATER)
    w.log.forge(RunnerLease.EvidenceRecorded, stranger.id, at=LATER, artifact_digests=[],
                materializations=[])  # fmt: skip
    assert w.log.violations() == []
