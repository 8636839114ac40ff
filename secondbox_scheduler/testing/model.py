"""The reference model: what the scheduler must answer, kept deliberately simple.

Per runner: an instance count (the only dimension the model's profile is tight on),
a reserved count, a drain flag, a deregistered flag and the last recorded heartbeat.
Per sandbox: its home runner, its generation and, per generation, the assignment's
state, token and retry count. It knows nothing of events, evidence or stores: it
predicts outcomes from the specification alone (docs/spec.md), so a bug in the scheduler shows as a
disagreement with it. :mod:`.state_machine` drives both side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from secondbox_scheduler.testing.builders import HEARTBEAT_TIMEOUT, Clock


@dataclass
class ModelRunner:
    instances: int
    reserved: int = 0
    draining: bool = False
    deregistered: bool = False
    heartbeat: datetime | None = None


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


@dataclass
class ReferenceModel:
    """Runners and sandboxes as docs/spec.md says they must be, at the clock's time."""

    clock: Clock
    heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT
    renewal_interval: timedelta = timedelta(seconds=10)
    runners: dict[str, ModelRunner] = field(default_factory=dict)
    sandboxes: dict[str, ModelSandbox] = field(default_factory=dict)

    def fresh(self, runner: ModelRunner) -> bool:
        """The heartbeat rule: seen no earlier than now - heartbeat_timeout."""
        seen = runner.heartbeat
        return seen is not None and seen >= self.clock() - self.heartbeat_timeout

    def placeable(self, runner_id: str) -> bool:
        """Would a one-instance placement be accepted on this runner now?"""
        runner = self.runners.get(runner_id)
        return (
            runner is not None
            and not runner.deregistered
            and not runner.draining
            and self.fresh(runner)
            and runner.reserved < runner.instances
        )

    def heartbeat(self, runner_id: str, at: datetime) -> None:
        """A heartbeat with unchanged evidence: recorded only once the renewal interval
        has passed since the last recorded one (older ones change nothing)."""
        runner = self.runners[runner_id]
        if runner.heartbeat is None or at - runner.heartbeat >= self.renewal_interval:
            runner.heartbeat = at

    def current(self, sandbox_id: str) -> tuple[ModelSandbox, ModelAssignment] | None:
        """The sandbox and its current generation's assignment, if it has one."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            return None
        assignment = sandbox.assignments.get(sandbox.generation)
        return None if assignment is None else (sandbox, assignment)

    def unreleased_on(self, runner_id: str) -> int:
        """Invariant 2: the assignments whose reservation the runner must still hold."""
        return sum(
            1
            for sandbox in self.sandboxes.values()
            for assignment in sandbox.assignments.values()
            if assignment.runner == runner_id and assignment.state != "released"
        )
