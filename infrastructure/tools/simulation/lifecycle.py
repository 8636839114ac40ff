"""One sandbox's life in a simulation: arrive, start, run, stop with proof, advance, idle.

:class:`Sandbox` is the simulation's view of one sandbox and its next step;
:class:`SandboxLifecycle` holds what the steps share (the application, the simulated
clock and the calendar of ticks, the seeded random source, the ledger, the counters)
and takes them: a sandbox arrives (is created), starts (is scheduled: a refused start is
retried, a placed one may be replayed, fail once, be fenced late or never be reported
running), runs, stops (is released with proof), advances its generation and idles
before its next start. Refusals are counted by error type and reason code. The operator
looks at assignments that wait on the reconciler and releases failed and uncertain ones
by hand. :class:`~.fleet.FleetSimulation` builds the run on it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from secondbox_scheduler.domain.assignment import STATE_ASSIGNED, STATE_FAILED, STATE_UNCERTAIN
from secondbox_scheduler.domain.errors import PlacementError, SchedulerError, StaleFenceError
from secondbox_scheduler.domain.placement.evidence import reason_keys
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.simulation.config import (
    ASSIGNMENT_RETRY_LIMIT,
    ATTEMPTS_PER_CYCLE,
    HEARTBEAT_TIMEOUT,
    IDLE_TICKS,
    LATE_FENCE_PROBABILITY,
    OPERATION_DEADLINE,
    OPERATOR,
    RECOVERY_PROBABILITY,
    REPLAY_PROBABILITY,
    RETRY_TICKS,
    RUN_TICKS,
    SERIALIZATION_RETRY_LIMIT,
    TRANSIENT_FAILURE_PROBABILITY,
    UNREPORTED_START_PROBABILITY,
    UNREPORTED_UNTIL,
    SimulatedClock,
    SimulationConfig,
)
from secondbox_scheduler.infrastructure.tools.simulation.ledger import Ledger
from secondbox_scheduler.infrastructure.tools.simulation.plans import ProfileRevision


@dataclass
class Sandbox:
    """The simulation's view of one sandbox and its next step."""

    sandbox_id: str
    workspace_id: str
    profile: ProfileRevision
    starts_left: int
    home: str = ""
    generation: int = 1
    # arriving, starting, running, idle, done, refused; and waiting for the reconciler
    # and the operator: unreported (placed, never reported running) or lost (running
    # on a runner that stopped heartbeating, so its stop cannot be reported)
    phase: str = "arriving"
    attempts: int = 0
    next_tick: int = 0
    running_token: bytes = b""  # the current generation's fencing token once placed
    previous_token: bytes = b""
    retries_seen: int = 0  # the assignment's retry_count when last looked at
    noticed: str = ""  # the failed or uncertain state the operator has seen


class SandboxLifecycle:
    """The sandboxes' side of one run: their steps and what the steps share."""

    def __init__(
        self,
        app: SchedulerApplication,
        clock: SimulatedClock,
        config: SimulationConfig,
        ledger: Ledger,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.app = app
        self.clock = clock
        self.config = config
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.ledger = ledger
        self.silent: set[str] = set()  # runners that stopped heartbeating
        self.tick = 0
        self.calendar: dict[int, list[str]] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        self.total_starts = config.sandboxes * config.cycles
        self.starts_done = 0
        operations = ("create_sandbox", "schedule")
        self.refusals: dict[str, Counter[str]] = {op: Counter() for op in operations}
        self.reasons: dict[str, Counter[str]] = {op: Counter() for op in operations}
        self.counts: Counter[str] = Counter()
        self.manual_releases: Counter[str] = Counter()  # by the state released from

    # -- time ------------------------------------------------------------------

    def at(self, tick: int, sandbox: Sandbox) -> None:
        sandbox.next_tick = tick
        self.calendar.setdefault(tick, []).append(sandbox.sandbox_id)

    def now(self) -> datetime:
        return self.clock()

    def finish_start(self, amount: int = 1) -> None:
        self.starts_done += amount
        if self.progress is not None:
            self.progress(self.starts_done, self.total_starts)

    @property
    def share_done(self) -> float:
        return self.starts_done / self.total_starts

    # -- sandbox steps ---------------------------------------------------------

    def step(self, sandbox: Sandbox) -> None:
        if sandbox.phase == "arriving":
            self.arrive(sandbox)
        elif sandbox.phase == "running":
            if sandbox.home in self.silent:
                sandbox.phase = "lost"  # its runner cannot report the stop
            else:
                self.stop(sandbox)
        elif sandbox.phase in ("idle", "starting"):
            sandbox.phase = "starting"
            self.start(sandbox)

    def arrive(self, sandbox: Sandbox) -> None:
        try:
            sandbox.home = self.app.create_sandbox(
                sandbox_id=sandbox.sandbox_id,
                workspace_id=sandbox.workspace_id,
                profile_revision_id=sandbox.profile.revision_id,
                requirements=sandbox.profile.requirements,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
            )
        except SchedulerError as error:
            self.refused("create_sandbox", error)
            sandbox.phase = "refused"
            self.finish_start(sandbox.starts_left)
            return
        self.counts["sandboxes_created"] += 1
        sandbox.phase = "starting"
        self.start(sandbox)

    def request(self, sandbox: Sandbox, token: bytes) -> ScheduleRequest:
        now = self.now()
        generation = sandbox.generation
        key = f"{sandbox.sandbox_id}/g{generation}"
        requirements = sandbox.profile.requirements
        artifacts = dict(
            zip(("runtime", "toolchain"), requirements.preferred_artifact_digests, strict=False)
        )
        return ScheduleRequest(
            assignment_id=f"asg-{key}",
            assignment_command_id=f"cmd-{key}",
            instance_id=f"inst-{key}",
            sandbox_id=sandbox.sandbox_id,
            workspace_id=sandbox.workspace_id,
            start_mutation_id=f"start-{key}",
            profile_revision_id=sandbox.profile.revision_id,
            requirements=requirements,
            assignment_command={
                "kind": "start",
                "sandbox": sandbox.sandbox_id,
                "generation": str(generation),
            },
            fencing_token=token,
            resolved_artifacts=artifacts,
            claim_expires_at=now + timedelta(seconds=30),
            operation_deadline=now + OPERATION_DEADLINE,
            retry_limit=ASSIGNMENT_RETRY_LIMIT,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            now=now,
            effect_started_at=now,
            plan_ready_at=now + timedelta(milliseconds=200),
        )

    def start(self, sandbox: Sandbox) -> None:
        sandbox.attempts += 1
        self.counts["start_attempts"] += 1
        request = self.request(sandbox, self.rng.randbytes(32))
        try:
            assignment, created = self.app.schedule(request)
        except SchedulerError as error:
            self.refused("schedule", error)
            if sandbox.attempts < ATTEMPTS_PER_CYCLE:
                self.at(self.tick + RETRY_TICKS, sandbox)
                return
            self.counts["cycles_abandoned"] += 1
            self.end_cycle(sandbox)
            self.idle(sandbox)
            return
        assert created, f"{sandbox.sandbox_id} generation {sandbox.generation} was already placed"
        self.ledger.change(assignment.runner_id, assignment.capacity, +1)
        if self.rng.random() < REPLAY_PROBABILITY:
            again, created = self.app.schedule(request)  # duplicate delivery: a replay
            assert not created
            assert again.id == assignment.id
        self.run(sandbox, assignment)

    def run(self, sandbox: Sandbox, assignment: DurableAssignment) -> None:
        token = assignment.fencing_token
        sandbox.running_token = token
        sandbox.retries_seen = 0
        self.end_cycle(sandbox)
        unreported = self.share_done < UNREPORTED_UNTIL and (
            self.rng.random() < UNREPORTED_START_PROBABILITY
        )
        if sandbox.home in self.silent or unreported:
            sandbox.phase = "unreported"  # left to the reconciler's operation deadline
            self.counts["starts_unreported"] += 1
            return
        if self.rng.random() < TRANSIENT_FAILURE_PROBABILITY:
            self.app.fail(sandbox.sandbox_id, sandbox.generation, token, "transport")
            self.counts["transient_failures"] += 1
        self.report_running(sandbox)

    def report_running(self, sandbox: Sandbox) -> None:
        self.app.mark_running(sandbox.sandbox_id, sandbox.generation, sandbox.running_token)
        if sandbox.previous_token and self.rng.random() < LATE_FENCE_PROBABILITY:
            try:  # a late message of the previous generation is fenced out
                self.app.mark_running(
                    sandbox.sandbox_id, sandbox.generation - 1, sandbox.previous_token
                )
            except StaleFenceError:
                self.counts["late_fences_rejected"] += 1
        sandbox.phase = "running"
        if sandbox.starts_left > 0:  # after its last start a sandbox stays running
            self.at(self.tick + self.rng.randint(*RUN_TICKS), sandbox)

    def end_cycle(self, sandbox: Sandbox) -> None:
        sandbox.starts_left -= 1
        sandbox.attempts = 0
        self.finish_start()

    def idle(self, sandbox: Sandbox) -> None:
        if sandbox.starts_left <= 0:
            sandbox.phase = "done"
            return
        sandbox.phase = "idle"
        self.at(self.tick + self.rng.randint(*IDLE_TICKS), sandbox)

    def stop(self, sandbox: Sandbox) -> None:
        now = self.now()
        assignment = self.app.get_assignment(sandbox.sandbox_id, sandbox.generation)
        assert assignment is not None
        proof = {
            "runner_id": assignment.runner_id,
            "stopped_at": now.isoformat(),
            "exit": "clean",
        }
        released = self.app.release(
            sandbox.sandbox_id, sandbox.generation, sandbox.running_token, proof
        )
        assert released
        self.counts["releases"] += 1
        self.ledger.change(assignment.runner_id, assignment.capacity, -1)
        self.next_generation(sandbox)

    def next_generation(self, sandbox: Sandbox) -> None:
        sandbox.generation = self.app.advance_generation(sandbox.sandbox_id, sandbox.generation)
        self.counts["generations_advanced"] += 1
        sandbox.previous_token = sandbox.running_token
        sandbox.running_token = b""
        sandbox.retries_seen = 0
        sandbox.noticed = ""
        self.idle(sandbox)

    # -- refusals --------------------------------------------------------------

    def refused(self, operation: str, error: SchedulerError) -> None:
        self.refusals[operation][type(error).__name__] += 1
        if isinstance(error, PlacementError):
            for evaluation in error.evaluations:  # keys as the unlisted counts name them
                self.reasons[operation].update(reason_keys(evaluation))
            for key, count in error.unlisted.reasons.items():  # refused without a record
                if count:
                    self.reasons[operation][key] += count

    # -- the operator ----------------------------------------------------------

    def look_at(self, sandbox: Sandbox) -> None:
        """Release a failed or uncertain assignment by hand one round after noticing it;
        a redelivered unreported start may now be reported running."""
        assignment = self.app.get_assignment(sandbox.sandbox_id, sandbox.generation)
        assert assignment is not None
        if assignment.state in (STATE_FAILED, STATE_UNCERTAIN):
            if sandbox.noticed == assignment.state:
                self.release_by_hand(sandbox, assignment)
            else:
                sandbox.noticed = assignment.state
        elif (
            sandbox.phase == "unreported"
            and assignment.state == STATE_ASSIGNED
            and assignment.retry_count > sandbox.retries_seen
        ):
            sandbox.retries_seen = assignment.retry_count  # the reconciler redelivered it
            if sandbox.home not in self.silent and self.rng.random() < RECOVERY_PROBABILITY:
                self.counts["redelivered_starts_running"] += 1
                self.report_running(sandbox)

    def release_by_hand(self, sandbox: Sandbox, assignment: DurableAssignment) -> None:
        reason = {
            STATE_FAILED: "start never reported running; the runner holds no compute for it",
            STATE_UNCERTAIN: "home runner stopped heartbeating; the host was confirmed gone",
        }[assignment.state]
        proof = {"operator": OPERATOR, "reason": reason, "released_at": self.now().isoformat()}
        released = self.app.release(
            sandbox.sandbox_id, sandbox.generation, assignment.fencing_token, proof
        )
        assert released
        self.manual_releases[assignment.state] += 1
        self.ledger.change(assignment.runner_id, assignment.capacity, -1)
        self.next_generation(sandbox)
