"""A Hypothesis rule-based state machine: every command against the reference model.

:class:`SchedulerMachine` drives a real :class:`SchedulerApplication` and the
:class:`~.model.ReferenceModel` side by side through every command (register,
heartbeat fresh and older, drain and cancel, change allocatable, deregister, create
sandbox, schedule with valid, duplicate and invalid requests, mark running, release
with right and stale fences (another token, a later generation, and an earlier
generation's own generation and token once the sandbox has advanced), release again
with the same and another proof, fail transient and terminal, claim, advance
generation, clock ticks that let heartbeats go stale). The model predicts every
outcome, including which refusal. The model tracks every capacity dimension; by
default only instances are tight (as the derandomized examples were tuned on), and
with ``every_dimension_tight`` runners offer as few units of every dimension and the
sandboxes ask two of some (:data:`SANDBOX_CAPACITY`), so each dimension binds.

After every step: reserved equals the model and the sum of unreleased assignments and
never exceeds allocatable, on every dimension (docs/spec.md (section 7), invariants 1
and 2), drain phases agree,
every assignment's state, token and retry count agree with the model, each sandbox's
tokens are distinct (3), and the read models equal the fold of the aggregates (7). At
the end of every example ``audit verify`` replays the whole log and must find nothing.

Every transition a rule takes is counted (:attr:`SchedulerMachine.transitions`, and
Hypothesis' ``event()``, shown by ``--hypothesis-show-statistics``), so a run can prove
that it reached each one (:data:`TRANSITIONS`).

Use it on any store::

    from secondbox_scheduler.testing import scheduler_machine, sqlite_store

    TestScheduler = scheduler_machine(sqlite_store).TestCase   # a unittest.TestCase
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    CapacityExceededError,
    ConflictError,
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    InvalidTransitionError,
    NoCompatibleRunnerError,
    ReleaseProofError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.values import ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.testing.builders import (
    CAPABILITIES,
    RUNTIME,
    Clock,
    materialization,
    profile,
    schedule_request,
)
from secondbox_scheduler.testing.model import (
    ModelAssignment,
    ModelRunner,
    ModelSandbox,
    ReferenceModel,
    amounts,
)

RUNNER_IDS = ("ra", "rb", "rc")
SANDBOX_IDS = ("sa", "sb", "sc", "sd")
LIKELY = ("sa", "sb", "sa", "sb", "sc", "sd")  # the two created at start, more often
PROOF = {"stopped": "yes"}
EARLIER_COMMANDS = ("running", "release", "fail", "fail-terminal")
ONE = {"vcpu_count": 1, "memory_bytes": 1, "disk_bytes": 1, "instances": 1, "operations": 1}
# What each sandbox asks: one unit of every dimension, but two of some (so the
# reservation of each dimension is checked apart from the others).
SANDBOX_CAPACITY = {
    "sa": ONE,
    "sb": {**ONE, "vcpu_count": 2},
    "sc": {**ONE, "memory_bytes": 2},
    "sd": {**ONE, "disk_bytes": 2, "operations": 2},
}
_tokens = itertools.count(10_000)

# Every transition the rules can take; a long enough run reaches each of them.
TRANSITIONS = frozenset(
    {
        "register: new", "register: already registered",
        "heartbeat: recorded", "heartbeat: older ignored", "heartbeat: unknown refused",
        "drain: started", "drain: cancelled", "drain: unknown refused",
        "allocatable: changed", "allocatable: below reserved refused",
        "allocatable: unknown refused",
        "deregister: done", "deregister: busy refused", "deregister: unknown refused",
        "create: new", "create: repeat", "create: no compatible runner",
        "schedule: created", "schedule: replay", "schedule: home unavailable",
        "schedule: invalid refused", "schedule: no sandbox",
        "running: from assigned", "running: repeat", "running: after release refused",
        "release: released", "release: repeat no-op", "release: another proof refused",
        "fail: retried", "fail: terminal", "fail: after release refused",
        "fence: stale token refused", "fence: stale generation refused",
        "fence: earlier generation refused",
        "claim: granted", "claim: held by another",
        "advance: done", "advance: refused assigned", "advance: refused running",
        "advance: refused failed",
    }
)  # fmt: skip

Store = Callable[[], AbstractContextManager[dict[str, str]]]


@contextlib.contextmanager
def sqlite_store() -> Iterator[dict[str, str]]:
    """An application environment on a new SQLite file, removed afterwards."""
    with tempfile.TemporaryDirectory() as directory:
        yield {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": str(Path(directory) / "machine.db"),
        }


def roomy(instances: int) -> dict[str, int]:
    """Allocatable that only ``instances`` makes tight."""
    return {
        "vcpu_count": 1000,
        "memory_bytes": 2**50,
        "disk_bytes": 2**50,
        "instances": instances,
        "operations": 1000,
    }


def offering(units: int, every_dimension: bool) -> dict[str, int]:
    """A runner's allocatable: ``units`` instances and roomy on the other dimensions
    (the default: the derandomized examples then reach every transition), or
    ``units`` of every dimension (``every_dimension``: the sandboxes that ask two of
    some dimension run out of it first, so each dimension binds somewhere)."""
    return dict.fromkeys(ONE, units) if every_dimension else roomy(units)


class SchedulerMachine(RuleBasedStateMachine):
    """See the module's docstring. Subclass with :func:`scheduler_machine`."""

    store: ClassVar[Store] = staticmethod(sqlite_store)
    every_dimension_tight: ClassVar[bool] = False
    transitions: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.stack = contextlib.ExitStack()
        env = self.stack.enter_context(type(self).store())
        self.clock = Clock()
        self.app = SchedulerApplication(env=env, now=self.clock)
        self.stack.callback(self.app.close)
        self.model = ReferenceModel(self.clock)
        self.runners = self.model.runners
        self.sandboxes = self.model.sandboxes

    def teardown(self) -> None:
        try:
            report = verify(self.app, measure_raw=False)
            assert report.ok, [str(v) for v in report.violations]
        finally:
            self.stack.close()

    def asks(self, sandbox_id: str) -> dict[str, int]:
        """What the sandbox's profile asks: :data:`SANDBOX_CAPACITY` when every dimension
        is tight, else one unit of each (as the examples the census was tuned on)."""
        return SANDBOX_CAPACITY[sandbox_id] if self.every_dimension_tight else ONE

    def reached(self, transition: str) -> None:
        assert transition in TRANSITIONS, transition
        type(self).transitions[transition] += 1
        event(transition)

    def heartbeat(self, runner_id: str, at: Any) -> None:
        self.app.record_heartbeat(
            runner_id=runner_id, at=at, artifact_digests=[RUNTIME],
            materializations=[materialization()],
        )  # fmt: skip
        self.model.heartbeat(runner_id, at)

    # -- rules ---------------------------------------------------------------------

    @initialize()
    def fleet(self) -> None:
        self.register("ra", 2)
        self.register("rb", 3)
        self.create("sa")
        self.create("sb")

    # (the argument keeps its name: Hypothesis draws a rule's arguments in name order,
    # so renaming it would change every derandomized example)
    @rule(runner_id=st.sampled_from(RUNNER_IDS), instances=st.integers(1, 3))
    def register(self, runner_id: str, instances: int) -> None:
        allocatable = offering(instances, self.every_dimension_tight)
        known = self.runners.get(runner_id)  # identical: a no-op; else a taken id refused
        same = known is not None and not known.deregistered and known.allocatable == allocatable
        try:
            created = self.app.register_runner(
                runner_id=runner_id, pool_name="pool-a", backend_kind="firecracker",
                architecture="x86_64", capabilities=CAPABILITIES, allocatable=allocatable,
                guest_protocol_minimum=1, guest_protocol_maximum=3,
                supported_egress_contexts=("default",),
            )  # fmt: skip
        except AlreadyExistsError:
            created = None
        if not created:
            assert (known is not None, created is False) == (True, same)
            self.reached("register: already registered")
            return
        assert runner_id not in self.runners
        self.runners[runner_id] = ModelRunner(dict(allocatable))
        self.heartbeat(runner_id, self.clock())
        self.reached("register: new")

    @rule(runner_id=st.sampled_from(RUNNER_IDS), older=st.booleans())
    def beat(self, runner_id: str, older: bool) -> None:
        runner = self.runners.get(runner_id)
        if runner is None or runner.deregistered:
            try:
                self.app.record_heartbeat(runner_id=runner_id, at=self.clock())
            except SchedulerError:
                self.reached("heartbeat: unknown refused")
                return
            raise AssertionError("a heartbeat of an unknown runner was accepted")
        at = self.clock() - timedelta(hours=1) if older else self.clock()
        if older and runner.heartbeat is not None and at < runner.heartbeat:
            before = self.app.head_position()
            self.heartbeat(runner_id, at)
            assert self.app.head_position() == before, "an older heartbeat changes nothing"
            self.reached("heartbeat: older ignored")
        else:
            self.heartbeat(runner_id, at)
            self.reached("heartbeat: recorded")

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
            self.refused(SchedulerError, "drain: unknown refused", command, runner_id)
            return
        command(runner_id)
        runner.draining = drain
        self.reached("drain: started" if drain else "drain: cancelled")

    @rule(runner_id=st.sampled_from(RUNNER_IDS), instances=st.integers(0, 3))
    def change_allocatable(self, runner_id: str, instances: int) -> None:
        allocatable = offering(instances, self.every_dimension_tight)
        runner = self.runners.get(runner_id)
        if runner is None or runner.deregistered:
            self.refused(
                SchedulerError, "allocatable: unknown refused", self.app.change_allocatable,
                runner_id, allocatable,
            )  # fmt: skip
            return
        if runner.holds_more_than(allocatable):
            self.refused(
                CapacityExceededError, "allocatable: below reserved refused",
                self.app.change_allocatable, runner_id, allocatable,
            )  # fmt: skip
            return
        self.app.change_allocatable(runner_id, allocatable)
        runner.allocatable = dict(allocatable)
        self.reached("allocatable: changed")

    @rule(runner_id=st.sampled_from(RUNNER_IDS))
    def deregister(self, runner_id: str) -> None:
        runner = self.runners.get(runner_id)
        if runner is None or runner.deregistered:
            self.refused(
                SchedulerError, "deregister: unknown refused", self.app.deregister_runner,
                runner_id,
            )  # fmt: skip
            return
        if any(runner.reserved.values()):
            self.refused(
                ConflictError, "deregister: busy refused", self.app.deregister_runner, runner_id
            )
            return
        self.app.deregister_runner(runner_id)
        runner.deregistered = True
        self.reached("deregister: done")

    def refused(
        self, error: type[Exception], transition: str, call: Callable[..., object], *args: Any
    ) -> None:
        """``call(*args)`` must raise ``error`` and write nothing."""
        before = self.app.head_position()
        try:
            call(*args)
        except error:
            assert self.app.head_position() == before, f"{transition}: wrote an event"
            self.reached(transition)
            return
        raise AssertionError(f"{transition}: accepted")

    @rule(sandbox_id=st.sampled_from(SANDBOX_IDS))
    def create(self, sandbox_id: str) -> None:
        def create() -> str:
            return self.app.create_sandbox(
                sandbox_id=sandbox_id, workspace_id=f"w-{sandbox_id}",
                profile_revision_id="profile-1",
                requirements=profile(capacity=self.asks(sandbox_id)),
                heartbeat_timeout=self.model.heartbeat_timeout,
            )  # fmt: skip

        if sandbox_id in self.sandboxes:
            assert create() == self.sandboxes[sandbox_id].home
            self.reached("create: repeat")
            return
        wanted = self.asks(sandbox_id)
        if not any(self.model.placeable(r, wanted) for r in self.runners):
            try:
                create()
            except (NoCompatibleRunnerError, EgressContextUnavailableError):
                self.reached("create: no compatible runner")
                return
            raise AssertionError("a sandbox was created with no compatible runner")
        home = create()
        assert self.model.placeable(home, wanted), f"{home} was not compatible"
        self.sandboxes[sandbox_id] = ModelSandbox(home, capacity=amounts(wanted))
        self.reached("create: new")

    def request(self, sandbox_id: str, **overrides: Any) -> ScheduleRequest:
        return schedule_request(
            sandbox_id, self.clock(), workspace_id=f"w-{sandbox_id}",
            requirements=profile(capacity=self.asks(sandbox_id)), retry_limit=1,
            serialization_retry_limit=3, **overrides,
        )  # fmt: skip

    @rule(sandbox_id=st.sampled_from(LIKELY), invalid=st.sampled_from([False] * 4 + [True]))
    def schedule(self, sandbox_id: str, invalid: bool) -> None:
        sandbox = self.sandboxes.get(sandbox_id)
        if invalid:
            self.refused(
                InvalidRequestError, "schedule: invalid refused", self.app.schedule,
                self.request(sandbox_id, fencing_token=b"short"),
            )  # fmt: skip
            return
        fresh = next(_tokens).to_bytes(32, "big")
        if sandbox is None:
            try:
                self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
            except SchedulerError:
                self.reached("schedule: no sandbox")
                return
            raise AssertionError("a sandbox that does not exist was scheduled")
        existing = sandbox.assignments.get(sandbox.generation)
        if existing is not None:
            assignment, created = self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
            assert not created
            assert assignment.fencing_token == existing.token
            self.reached("schedule: replay")
            return
        if not self.model.placeable(sandbox.home, sandbox.capacity):
            try:
                self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
            except HomeRunnerUnavailableError:
                self.reached("schedule: home unavailable")
                return
            raise AssertionError(f"placed on {sandbox.home}, which the model says is not placeable")
        assignment, created = self.app.schedule(self.request(sandbox_id, fencing_token=fresh))
        assert created
        assert assignment.runner_id == sandbox.home
        assert assignment.generation == sandbox.generation
        assert fresh not in sandbox.tokens
        assert assignment.capacity.as_dict() == sandbox.capacity
        sandbox.assignments[sandbox.generation] = ModelAssignment(
            sandbox.home, fresh, capacity=dict(sandbox.capacity)
        )
        sandbox.tokens.add(fresh)
        self.runners[sandbox.home].reserve(sandbox.capacity)
        self.reached("schedule: created")

    def assigned(self, released: bool | None = None) -> list[str]:
        """Sandboxes whose current generation is assigned (and released, or not)."""
        found = []
        for sandbox_id in SANDBOX_IDS:
            current = self.model.current(sandbox_id)
            if current is not None and (
                released is None or (current[1].state == "released") == released
            ):
                found.append(sandbox_id)
        return found

    @precondition(lambda self: self.assigned())
    @rule(
        data=st.data(),
        command=st.sampled_from(
            ["running", "running", "release", "release", "fail", "fail-terminal"]
        ),
        stale=st.sampled_from(["none"] * 4 + ["token", "generation"]),
    )
    def lifecycle(self, data: st.DataObject, command: str, stale: str) -> None:
        sandbox_id = data.draw(st.sampled_from(self.assigned()), label="sandbox")
        found = self.model.current(sandbox_id)
        assert found is not None
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
        if stale != "none":
            self.refused(StaleFenceError, f"fence: stale {stale} refused", call)
            return
        state = assignment.state
        if command == "running":
            if state in ("assigned", "uncertain"):
                call()
                assignment.state = "running"
                self.reached("running: from assigned")
            elif state == "running":
                before = self.app.head_position()
                call()
                assert self.app.head_position() == before
                self.reached("running: repeat")
            else:
                self.refused(InvalidTransitionError, "running: after release refused", call)
        elif command == "release":
            released = call()
            assert released == (state != "released")
            if state != "released":
                assignment.state = "released"
                self.runners[assignment.runner].release(assignment.capacity)
                self.reached("release: released")
            else:
                self.reached("release: repeat no-op")
        else:
            if state not in ("assigned", "running", "uncertain"):
                self.refused(InvalidTransitionError, "fail: after release refused", call)
                return
            call()
            if command == "fail" and assignment.retries < assignment.retry_limit:
                assignment.retries += 1
                assignment.state = "assigned"
                self.reached("fail: retried")
            else:
                assignment.state = "failed"
                self.reached("fail: terminal")

    # The lifecycle is where most promises live: give it more of the steps.
    lifecycle_more = lifecycle
    lifecycle_again = lifecycle
    schedule_more = schedule

    def earlier_fence(self, sandbox_id: str, generation: int, command: str) -> None:
        """An earlier generation's own fence (its generation and its token, both once
        valid) after the sandbox advanced: refused as stale, nothing written."""
        sandbox = self.sandboxes[sandbox_id]
        assert generation < sandbox.generation
        token = sandbox.assignments[generation].token
        call: Callable[[], object] = {
            "running": lambda: self.app.mark_running(sandbox_id, generation, token),
            "release": lambda: self.app.release(sandbox_id, generation, token, PROOF),
            "fail": lambda: self.app.fail(sandbox_id, generation, token, "transport"),
            "fail-terminal": lambda: self.app.fail(sandbox_id, generation, token, "admission"),
        }[command]
        self.refused(StaleFenceError, "fence: earlier generation refused", call)

    @precondition(lambda self: self.assigned(released=True))
    @rule(data=st.data(), other_proof=st.booleans())
    def release_again(self, data: st.DataObject, other_proof: bool) -> None:
        sandbox_id = data.draw(st.sampled_from(self.assigned(released=True)), label="sandbox")
        found = self.model.current(sandbox_id)
        assert found is not None
        sandbox, assignment = found
        if other_proof:
            self.refused(
                ReleaseProofError, "release: another proof refused", self.app.release,
                sandbox_id, sandbox.generation, assignment.token, {"other": "proof"},
            )  # fmt: skip
        else:
            assert not self.app.release(sandbox_id, sandbox.generation, assignment.token, PROOF)
            self.reached("release: repeat no-op")

    @precondition(lambda self: self.assigned())
    @rule(data=st.data(), owner=st.sampled_from(["o1", "o2"]))
    def claim(self, data: st.DataObject, owner: str) -> None:
        sandbox_id = data.draw(st.sampled_from(self.assigned()), label="sandbox")
        found = self.model.current(sandbox_id)
        assert found is not None
        sandbox, _ = found
        record = self.app.get_assignment(sandbox_id)
        assert record is not None
        holder, expires = record.reconcile_owner, record.reconcile_claim_expires_at
        held = bool(holder) and holder != owner and expires is not None and expires > self.clock()
        granted = self.app.claim_reconcile(
            sandbox_id, sandbox.generation, owner, self.clock() + timedelta(seconds=30)
        )
        assert granted == (not held)
        self.reached("claim: held by another" if held else "claim: granted")

    @precondition(lambda self: self.assigned())
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        sandbox_id = data.draw(st.sampled_from(self.assigned()), label="sandbox")
        found = self.model.current(sandbox_id)
        assert found is not None
        sandbox, assignment = found
        if assignment.state != "released":
            self.refused(
                InvalidTransitionError, f"advance: refused {assignment.state}",
                self.app.advance_generation, sandbox_id, sandbox.generation,
            )  # fmt: skip
            return
        assert self.app.advance_generation(sandbox_id, sandbox.generation) == sandbox.generation + 1
        sandbox.generation += 1
        self.reached("advance: done")
        # the generation just left presents its own fence: refused, nothing written (no
        # draw: the examples stay those the other rules were tuned on; the command
        # cycles through the four fenced ones)
        done = type(self).transitions["advance: done"]
        self.earlier_fence(sandbox_id, sandbox.generation - 1, EARLIER_COMMANDS[done % 4])

    advance_more = advance

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def capacity_agrees_with_model_and_ledger(self) -> None:
        for runner_id, model in self.runners.items():
            if model.deregistered:
                continue
            snapshot = self.app.fold_runner(runner_id)
            reserved, allocatable = snapshot.reserved.as_dict(), snapshot.allocatable.as_dict()
            assert reserved == model.reserved
            assert allocatable == model.allocatable
            assert not model.holds_more_than(model.allocatable)
            for dim, amount in reserved.items():
                assert amount <= allocatable[dim], dim
            assert snapshot.drain_phase == ("draining" if model.draining else "active")
            assert reserved == self.model.unreleased_on(runner_id)

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
        if read_models is None:  # a store without read models (eventsourcing.popo)
            return
        assert read_models.runners.snapshots() == self.app.fold_runner_snapshots()
        for sandbox_id in self.sandboxes:
            assert read_models.assignments.by_sandbox(sandbox_id) == self.app.fold_assignments(
                sandbox_id
            )


def scheduler_machine(
    store: Store = sqlite_store, name: str = "", *, every_dimension_tight: bool = False
) -> type[SchedulerMachine]:
    """A machine class on ``store`` (a callable returning a context manager of an
    application environment, fresh each time), with transition counts of its own.
    ``every_dimension_tight``: runners offer as few units of every dimension as of
    instances (:func:`offering`)."""
    attributes = {
        "store": staticmethod(store),
        "transitions": Counter(),
        "every_dimension_tight": every_dimension_tight,
    }
    return type(f"SchedulerMachine{name}", (SchedulerMachine,), attributes)
