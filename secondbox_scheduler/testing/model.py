"""The reference model: what the scheduler must answer, kept deliberately simple.

Per runner: its allocatable and reserved amounts on every capacity dimension (vCPUs,
memory, disk, instances, operations: any of them can be the one that binds), a drain
flag, a deregistered flag and the last recorded heartbeat. Per sandbox: its home
runner, what each of its generations reserves, its generation and, per generation,
the assignment's state, token, retry count and reserved capacity. It knows nothing
of events, evidence or stores: it predicts outcomes from the specification alone
(docs/spec.md), so a bug in the scheduler shows as a disagreement with it.
:mod:`.state_machine` drives both side by side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from secondbox_scheduler.domain.values import Capacity
from secondbox_scheduler.testing.builders import HEARTBEAT_TIMEOUT, Clock

DIMENSIONS = Capacity.DIMENSIONS


def amounts(values: Mapping[str, int] | None = None) -> dict[str, int]:
    """An amount on every capacity dimension (0 where ``values`` has none)."""
    return {dim: (values or {}).get(dim, 0) for dim in DIMENSIONS}


def total(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The sum of amounts, dimension by dimension."""
    summed = amounts()
    for part in parts:
        for dim in DIMENSIONS:
            summed[dim] += part.get(dim, 0)
    return summed


@dataclass
class ModelRunner:
    allocatable: dict[str, int]
    reserved: dict[str, int] = field(default_factory=amounts)
    draining: bool = False
    deregistered: bool = False
    heartbeat: datetime | None = None

    def fits(self, capacity: Mapping[str, int]) -> bool:
        """Whether ``capacity`` fits beside what is reserved, on every dimension."""
        return all(
            self.reserved[dim] + capacity.get(dim, 0) <= self.allocatable[dim] for dim in DIMENSIONS
        )

    def holds_more_than(self, allocatable: Mapping[str, int]) -> bool:
        """Whether the reservations exceed ``allocatable`` on some dimension."""
        return any(self.reserved[dim] > allocatable.get(dim, 0) for dim in DIMENSIONS)

    def reserve(self, capacity: Mapping[str, int]) -> None:
        self.reserved = total([self.reserved, capacity])

    def release(self, capacity: Mapping[str, int]) -> None:
        self.reserved = {dim: self.reserved[dim] - capacity.get(dim, 0) for dim in DIMENSIONS}


@dataclass
class ModelAssignment:
    runner: str
    token: bytes
    state: str = "assigned"
    retries: int = 0
    retry_limit: int = 1
    capacity: dict[str, int] = field(default_factory=amounts)


@dataclass
class ModelSandbox:
    home: str
    generation: int = 1
    capacity: dict[str, int] = field(default_factory=amounts)  # what each generation asks
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

    def placeable(self, runner_id: str, capacity: Mapping[str, int]) -> bool:
        """Would a placement asking ``capacity`` be accepted on this runner now?"""
        runner = self.runners.get(runner_id)
        return (
            runner is not None
            and not runner.deregistered
            and not runner.draining
            and self.fresh(runner)
            and runner.fits(capacity)
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

    def unreleased_on(self, runner_id: str) -> dict[str, int]:
        """Invariant 2: the capacity of the assignments whose reservation the runner must
        still hold, on every dimension."""
        return total(
            assignment.capacity
            for sandbox in self.sandboxes.values()
            for assignment in sandbox.assignments.values()
            if assignment.runner == runner_id and assignment.state != "released"
        )
