"""A Hypothesis state machine drives every command against a deliberately simple model.

After every step: the invariants of SPEC section 7 hold on the aggregates, the
application agrees with the model, and the read models agree with both. At the end of
each example ``audit verify`` finds nothing. Runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from secondbox_scheduler.domain import (
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    CapacityExceededError,
    ConflictError,
    EgressContextUnavailableError,
    InvalidTransitionError,
    ReleaseProofError,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit_replay import verify
from tests.conftest import Clock
from tests.factories import (
    CAPABILITIES,
    HEARTBEAT_TIMEOUT,
    RUNTIME,
    materialization,
    requirements,
    schedule_request,
)
from tests.test_projections import fresh_store

RUNNER_IDS = ("ra", "rb", "rc")
SANDBOX_IDS = ("sa", "sb", "sc", "sd")
RENEWAL = timedelta(seconds=10)
LIKELY = ("sa", "sb", "sa", "sb", "sc", "sd")  # the two created at start, more often
PROOF = {"stopped": "yes"}
_tokens = itertools.count(10_000)
ONE = {"vcpu_count": 1, "memory_bytes": 1, "disk_bytes": 1, "instances": 1, "operations": 1}


def roomy(instances: int) -> dict[str, int]:
    return {
        "vcpu_count": 1000,
        "memory_bytes": 2**50,
        "disk_bytes": 2**50,
        "instances": instances,
        "operations": 1000,
    }


@dataclass
class ModelRunner:
    instances: int
    reserved: int = 0
    draining: bool = False
    deregistered: bool = False
    heartbeat: Any = None


@dataclass
class ModelAssignment:
    runner: str
    token: bytes
    state: str = "assigned"
    retries: int = 0
    retry_limit: int = 1


@dataclass
class ModelSandbox:
    home: str
    generation: int = 1
    assignments: dict[int, ModelAssignment] = field(default_factory=dict)
    tokens: set[bytes] = field(default_factory=set)


class SchedulerMachine(RuleBasedStateMachine):
    kind: ClassVar[str] = "sqlite"
    server: ClassVar[Any] = None

    def __init__(self) -> None:
        super().__init__()
        self.stack = contextlib.ExitStack()
        env = self.stack.enter_context(fresh_store(self.kind, self.server))
        self.clock = Clock()
        self.app = SchedulerApplication(env=env, now=self.clock)
        self.stack.callback(self.app.close)
        self.runners: dict[str, ModelRunner] = {}
        self.sandboxes: dict[str, ModelSandbox] = {}

    def teardown(self) -> None:
        try:
            report = verify(self.app, measure_raw=False)
            assert report.ok, [str(v) for v in report.violations]
        finally:
            self.stack.close()

    # -- model helpers -----------------------------------------------------------

    def fresh(self, runner: ModelRunner) -> bool:
        return runner.heartbeat is not None and runner.heartbeat >= self.clock() - HEARTBEAT_TIMEOUT

    def placeable(self, runner_id: str) -> bool:
        runner = self.runners.get(runner_id)
        return (
            runner is not None
            and not runner.deregistered
            and not runner.draining
            and self.fresh(runner)
            and runner.reserved < runner.instances
        )

    def heartbeat(self, runner_id: str, at: Any) -> None:
        runner = self.runners[runner_id]
        self.app.record_heartbeat(
            runner_id=runner_id, at=at, artifact_digests=[RUNTIME],
            materializations=[materialization()],
        )  # fmt: skip
        if runner.heartbeat is None or at - runner.heartbeat >= RENEWAL:
            runner.heartbeat = at

    # -- rules ---------------------------------------------------------------------

    @initialize()
    def fleet(self) -> None:
        self.register("ra", 2)
        self.register("rb", 3)
        self.create("sa")
        self.create("sb")

    @rule(runner_id=st.sampled_from(RUNNER_IDS), instances=st.integers(1, 3))
    def register(self, runner_id: str, instances: int) -> None:
        try:
            self.app.register_runner(
                runner_id=runner_id, pool_name="pool-a", backend_kind="firecracker",
                architecture="x86_64", capabilities=CAPABILITIES, allocatable=roomy(instances),
                guest_protocol_minimum=1, guest_protocol_maximum=3,
                supported_egress_contexts=("default",),
            )  # fmt: skip
        except AlreadyExistsError:
            assert runner_id in self.runners
            return
        assert runner_id not in self.runners
        self.runners[runner_id] = ModelRunner(instances)
        self.heartbeat(runner_id, self.clock())

    @rule(runner_id=st.sampled_from(RUNNER_IDS), older=st.booleans())
    def beat(self, runner_id: str, older: bool) -> None:
        runner = self.runners.get(runner_id)
        if runner is None or runner.deregistered:
            with pytest.raises(SchedulerError):
                self.app.record_heartbeat(runner_id=runner_id, at=self.clock())
            return
        at = self.clock() - timedelta(hours=1) if older else self.clock()
        if older and runner.heartbeat is not None and at < runner.heartbeat:
            before = self.app.head_position()
            self.heartbeat(runner_id, at)
            assert self.app.head_position() == before, "an older heartbeat changes nothing"
        else:
            self.heartbeat(runner_id, at)

    @rule(seconds=st.sampled_from([1, 5, 11, 20, 45]), beat_all=st.booleans())
    def tick(self, seconds: int, beat_all: bool) -> None:
        self.clock.advance(seconds=seconds)
        if beat_all:
            for runner_id, runner in self.runners.items():
                if not runner.deregistered:
                    self.heartbeat(runner_id, self.clock())

    @rule(runner_id=st.sampled_from(RUNNER_IDS), drain=st.booleans())
    def drain(self, runner_id: str, drain: bool) -> None:
        runner = self.runners.get(runner_id)
        command = self.app.start_drain if drain else self.app.cancel_drain
        if runner is None or runner.deregistered:
            with pytest.raises(SchedulerError):
                command(runner_id)
            return
        command(runner_id)
        runner.draining = drain

    @rule(runner_id=st.sampled_from(RUNNER_IDS), instances=st.integers(0, 3))
    def change_allocatable(self, runner_id: str, instances: int) -> None:
        runner = self.runners.get(runner_id)
        if runner is None or runner.deregistered:
            with pytest.raises(SchedulerError):
                self.app.change_allocatable(runner_id, roomy(instances))
            return
        if instances < runner.reserved:
            with pytest.raises(CapacityExceededError):
                self.app.change_allocatable(runner_id, roomy(instances))
            return
        self.app.change_allocatable(runner_id, roomy(instances))
        runner.instances = instances

    @rule(runner_id=st.sampled_from(RUNNER_IDS))
    def deregister(self, runner_id: str) -> None:
        runner = self.runners.get(runner_id)
        if runner is None or runner.deregistered:
            with pytest.raises(SchedulerError):
                self.app.deregister_runner(runner_id)
            return
        if runner.reserved:
            with pytest.raises(ConflictError):
                self.app.deregister_runner(runner_id)
            return
        self.app.deregister_runner(runner_id)
        runner.deregistered = True

    @rule(sandbox_id=st.sampled_from(SANDBOX_IDS))
    def create(self, sandbox_id: str) -> None:
        def create() -> str:
            return self.app.create_sandbox(
                sandbox_id=sandbox_id, workspace_id=f"w-{sandbox_id}",
                profile_revision_id="profile-1", requirements=requirements(capacity=ONE),
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
            )  # fmt: skip

        if sandbox_id in self.sandboxes:
            assert create() == self.sandboxes[sandbox_id].home
            return
        if not any(self.placeable(r) for r in self.runners):
            with pytest.raises((NoCompatibleRunnerError, EgressContextUnavailableError)):
                create()
            return
        home = create()
        assert self.placeable(home), f"{home} was not compatible"
        self.sandboxes[sandbox_id] = ModelSandbox(home)

    def request(self, sandbox_id: str, **overrides: Any) -> Any:
        return schedule_request(
            sandbox_id, self.clock(), workspace_id=f"w-{sandbox_id}",
            requirements=requirements(capacity=ONE), retry_limit=1,
            serialization_retry_limit=3, **overrides,
        )  # fmt: skip

    @rule(sandbox_id=st.sampled_from(LIKELY), invalid=st.sampled_from([False] * 4 + [True]))
    def schedule(self, sandbox_id: str, invalid: bool) -> None:
        sandbox = self.sandboxes.get(sandbox_id)
        if invalid:
            before = self.app.head_position()
            with pytest.raises(InvalidRequestError):
                self.app.schedule(self.request(sandbox_id, fencing_token=b"short"))
            assert self.app.head_position() == before
            return
        fresh = next(_tokens).to_bytes(32, "big")
        if sandbox is None:
            with pytest.raises(SchedulerError):
                self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
            return
        existing = sandbox.assignments.get(sandbox.generation)
        if existing is not None:
            assignment, created = self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
            assert not created
            assert assignment.fencing_token == existing.token
            return
        if not self.placeable(sandbox.home):
            with pytest.raises(HomeRunnerUnavailableError):
                self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
            return
        assignment, created = self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
        assert created
        assert assignment.runner_id == sandbox.home
        assert assignment.generation == sandbox.generation
        assert fresh not in sandbox.tokens
        sandbox.assignments[sandbox.generation] = ModelAssignment(sandbox.home, fresh)
        sandbox.tokens.add(fresh)
        self.runners[sandbox.home].reserved += 1

    def current(self, sandbox_id: str) -> tuple[ModelSandbox, ModelAssignment] | None:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            return None
        assignment = sandbox.assignments.get(sandbox.generation)
        return None if assignment is None else (sandbox, assignment)

    @precondition(lambda self: any(self.current(s) for s in SANDBOX_IDS))
    @rule(
        sandbox_id=st.sampled_from(LIKELY),
        command=st.sampled_from(["running", "release", "release", "fail", "fail-terminal"]),
        stale=st.sampled_from(["none"] * 4 + ["token", "generation"]),
    )
    def lifecycle(self, sandbox_id: str, command: str, stale: str) -> None:
        found = self.current(sandbox_id)
        if found is None:
            return
        sandbox, assignment = found
        generation, token = sandbox.generation, assignment.token
        if stale == "token":
            token = b"\xff" * 32
        elif stale == "generation":
            generation += 1
        call: Callable[[], object] = {
            "running": lambda: self.app.mark_running(sandbox_id, generation, token),
            "release": lambda: self.app.release(sandbox_id, generation, token, PROOF),
            "fail": lambda: self.app.fail(sandbox_id, generation, token, "transport"),
            "fail-terminal": lambda: self.app.fail(sandbox_id, generation, token, "admission"),
        }[command]
        before = self.app.head_position()
        if stale != "none":
            with pytest.raises(StaleFenceError):
                call()
            assert self.app.head_position() == before
            return
        state = assignment.state
        if command == "running":
            if state in ("assigned", "uncertain"):
                call()
                assignment.state = "running"
            elif state == "running":
                call()
                assert self.app.head_position() == before
            else:
                with pytest.raises(InvalidTransitionError):
                    call()
        elif command == "release":
            released = call()
            assert released == (state != "released")
            if state != "released":
                assignment.state = "released"
                self.runners[assignment.runner].reserved -= 1
        else:
            if state not in ("assigned", "running", "uncertain"):
                with pytest.raises(InvalidTransitionError):
                    call()
                return
            call()
            if command == "fail" and assignment.retries < assignment.retry_limit:
                assignment.retries += 1
                assignment.state = "assigned"
            else:
                assignment.state = "failed"

    # The lifecycle is where most promises live: give it more of the steps.
    lifecycle_more = lifecycle
    schedule_more = schedule

    @rule(sandbox_id=st.sampled_from(SANDBOX_IDS), other_proof=st.booleans())
    def release_again(self, sandbox_id: str, other_proof: bool) -> None:
        found = self.current(sandbox_id)
        if found is None or found[1].state != "released":
            return
        sandbox, assignment = found
        proof = {"other": "proof"} if other_proof else PROOF
        if other_proof:
            with pytest.raises(ReleaseProofError):
                self.app.release(sandbox_id, sandbox.generation, assignment.token, proof)
        else:
            assert not self.app.release(sandbox_id, sandbox.generation, assignment.token, proof)

    @rule(sandbox_id=st.sampled_from(SANDBOX_IDS), owner=st.sampled_from(["o1", "o2"]))
    def claim(self, sandbox_id: str, owner: str) -> None:
        found = self.current(sandbox_id)
        if found is None:
            return
        sandbox, _ = found
        record = self.app.get_assignment(sandbox_id)
        assert record is not None
        holder, expires = record.reconcile_owner, record.reconcile_claim_expires_at
        held = bool(holder) and holder != owner and expires is not None and expires > self.clock()
        granted = self.app.claim_reconcile(
            sandbox_id, sandbox.generation, owner, self.clock() + timedelta(seconds=30)
        )
        assert granted == (not held)

    @rule(sandbox_id=st.sampled_from(LIKELY))
    def advance(self, sandbox_id: str) -> None:
        found = self.current(sandbox_id)
        if found is None:
            return
        sandbox, assignment = found
        if assignment.state != "released":
            with pytest.raises(InvalidTransitionError):
                self.app.advance_generation(sandbox_id, sandbox.generation)
            return
        assert self.app.advance_generation(sandbox_id, sandbox.generation) == sandbox.generation + 1
        sandbox.generation += 1

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def capacity_agrees_with_model_and_ledger(self) -> None:
        for runner_id, model in self.runners.items():
            if model.deregistered:
                continue
            snapshot = self.app.fold_runner(runner_id)
            assert snapshot.reserved.instances == model.reserved
            assert snapshot.reserved.instances <= snapshot.allocatable.instances or (
                model.reserved <= model.instances
            )
            assert model.reserved <= model.instances
            assert snapshot.drain_phase == ("draining" if model.draining else "active")
            unreleased = sum(
                1
                for sandbox in self.sandboxes.values()
                for assignment in sandbox.assignments.values()
                if assignment.runner == runner_id and assignment.state != "released"
            )
            assert snapshot.reserved.instances == unreleased

    @invariant()
    def assignments_agree_with_model(self) -> None:
        for sandbox_id, sandbox in self.sandboxes.items():
            for generation, model in sandbox.assignments.items():
                actual = self.app.get_assignment(sandbox_id, generation)
                assert actual is not None
                assert actual.state == model.state
                assert actual.fencing_token == model.token
                assert actual.retry_count == model.retries
            assert len(sandbox.tokens) == len(sandbox.assignments)

    @invariant()
    def read_models_agree(self) -> None:
        read_models = self.app.current_read_models()
        assert read_models is not None
        assert read_models.runners.snapshots() == self.app.fold_runner_snapshots()
        for sandbox_id in self.sandboxes:
            assert read_models.assignments.by_sandbox(sandbox_id) == self.app.fold_assignments(
                sandbox_id
            )


def machine_for(kind: str, server: Any) -> type[SchedulerMachine]:
    return type(f"SchedulerMachine_{kind}", (SchedulerMachine,), {"kind": kind, "server": server})


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_state_machine(kind: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("postgres_server") if kind == "postgres" else None
    machine = machine_for(kind, server)
    machine.TestCase.settings = settings(
        max_examples=40 if kind == "sqlite" else 15,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
