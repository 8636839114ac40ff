"""The placement decision: a schedule request, its sandbox and its home runner become
new events, a replay of the generation's assignment, or a typed refusal.

Pure: no I/O, no clock read (the caller passes the clock's reading). The service loads
the aggregates, calls :func:`decide_placement`, and saves the events of a
:class:`Placed` in one atomic save with optimistic concurrency on every stream
(docs/spec.md, section 6, steps 2 to 5). Every caller decides through this one function:
the placement batch (``infrastructure/placing/batch.py``), the tests' aggregate helpers
and the bench.

The steps, in order:

1. the sandbox must exist and pin the request's workspace and profile revision
   (``ProfileRevisionMismatchError``);
2. an assignment of the sandbox's current generation is answered as a replay
   (:class:`Replayed`, nothing to write);
3. the home runner is looked up (``HomeRunnerUnavailableError`` when it is not
   registered); a home runner that already holds this generation's reservation, which
   the sandbox does not show, means the two were read on either side of a rival's
   commit (:class:`StaleHome`: reload and decide again);
4. the sandbox fences the generation on the runner's current snapshot, which runs the
   placement rules (:class:`Refused` carries the evidence to record), and
   the runner reserves the capacity (refused while draining or past allocatable);
5. the new events, pending on the aggregates, in save order: the fence, the
   reservation, the token's use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from secondbox_scheduler.domain.assignment import to_durable_assignment
from secondbox_scheduler.domain.errors import (
    PlacementError,
    ProfileRevisionMismatchError,
    SchedulerError,
)
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest

# A home runner as loaded for a decision: the aggregate and its lease, or why it
# cannot be had (not registered, no lease).
HomeRunner = tuple[Runner, RunnerLease]
HomeLookup = Callable[[str], HomeRunner | SchedulerError]


@dataclass(frozen=True)
class Replayed:
    """The generation is assigned already: the assignment, nothing written."""

    assignment: DurableAssignment


@dataclass(frozen=True)
class StaleHome:
    """The home runner holds a reservation of this generation that the sandbox read does
    not show: a rival committed between the two reads. Reload both and decide again."""


@dataclass(frozen=True)
class Refused:
    """The placement rules refused the home runner: the typed refusal, whose evidence
    (every rule the runner failed) is worth recording. Nothing else changed."""

    error: PlacementError


@dataclass(frozen=True)
class Placed:
    """A new assignment. Its events are pending on the aggregates, to be saved in their
    order here (the fence, the reservation, the token's use) in one atomic save; the
    token's use stream collides with an earlier generation's use of the same token
    (invariant 3)."""

    assignment: DurableAssignment
    aggregates: tuple[Sandbox, Runner, FencingTokenUse]

    @property
    def token(self) -> FencingTokenUse:
        return self.aggregates[2]


Decision = Replayed | StaleHome | Refused | Placed


def decide_placement(
    request: ScheduleRequest,
    sandbox: Sandbox | None,
    home_runner: HomeLookup,
    *,
    attempt: int,
    clock: datetime,
) -> Decision:
    """Decide one validated request against the sandbox and its home runner (copies
    the caller may command: the aggregates are changed in place when it places).

    ``home_runner(runner_id)``: the home runner with its lease, or the error that says
    why it is unavailable (raised here). ``attempt``: the lost races before this one,
    recorded with the placement. ``clock``: the scheduler's clock at the decision.
    A refusal by the placement rules is returned (:class:`Refused`); any other refusal
    is raised, typed (``SchedulerError``: the sandbox or its home runner missing, a
    reused token, a draining runner or capacity past allocatable at the reservation)."""
    if sandbox is None:
        raise ProfileRevisionMismatchError(f"sandbox {request.sandbox_id!r} does not exist")
    sandbox.check_pinned(request)
    existing = sandbox.assignment()
    if existing is not None:
        return Replayed(to_durable_assignment(existing))
    loaded = home_runner(sandbox.home_runner_id)
    if isinstance(loaded, SchedulerError):
        raise loaded
    runner, lease = loaded
    if runner.holds(request.sandbox_id, sandbox.generation):
        return StaleHome()
    try:
        record, token = sandbox.fence(
            request,
            runner.snapshot(lease),
            runner_version=runner.version,
            lease_version=lease.version,
            attempt=attempt,
            clock=clock,
        )
    except PlacementError as error:
        return Refused(error)
    assert request.now is not None  # a validated request has its times
    runner.reserve(
        assignment_id=request.assignment_id,
        sandbox_id=request.sandbox_id,
        generation=sandbox.generation,
        capacity=request.requirements.capacity,
        at=request.now,
    )
    return Placed(to_durable_assignment(record), (sandbox, runner, token))
