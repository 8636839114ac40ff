"""A placement batch that loses a race answers as a serial execution would (batch.py).

Each test runs one batch (``PlacementBatch`` over the port ``PlacementStore``) through
:class:`RivalFirst`, a port around a real application whose first ``save_in_order``
lets another application instance (a rival replica) commit first: a placement, a change
of allocatable or a drain on one of the batch's runners or sandboxes, or a heartbeat.
The batch's save then fails on a stream version (except after a heartbeat, which writes
only the lease stream, a stream the batch never writes), and the batch decides again the
requests that read a stream that changed and the later requests that read what those
read or wrote (its dependents), and commits the others at once.

Every answer, and the state left (each sandbox's assignment, each runner's
reservation), must equal those of the same requests run one by one on a fresh store on
which the same rival commit was applied first (after the batch, for the heartbeat,
which the batch's save does not conflict with). The number of requests decided again
is exact, too: a batch that retried everything would be correct but is not what the
module promises. Deterministic: no threads, no sleeps; the rival commits exactly once,
between the batch's decision and its save.

Planted by hand (docs/verification.md, section 7): leaving one affected request out of
``retry`` in ``PlacementBatch._commit``, or not adding dependents in ``_dependents``,
fails these tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.refusals import Refusal
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.port import Outcome, PlacementCounters
from secondbox_scheduler.infrastructure.placing.runner_locks import RunnerLocks
from tests.conftest import Clock, Store
from tests.factories import capacity, create_sandbox, register, schedule_request

Rival = Callable[[SchedulerApplication], object]


class RivalFirst:
    """The port of ``app`` (``PlacementStore``), except that its first ``save_in_order``
    first runs ``rival`` (a commit by another application instance on the same store).
    No runner locks: the rival's own placement must not wait for the batch's lock (the
    locks are liveness only, never correctness)."""

    def __init__(self, app: SchedulerApplication, rival: Callable[[], object]) -> None:
        self.app, self.rival, self.fired = app, rival, 0
        self._locks = RunnerLocks(None)

    @property
    def runner_locks(self) -> RunnerLocks:
        return self._locks

    @property
    def metrics(self) -> PlacementCounters:
        return self.app.metrics

    def now(self) -> datetime:
        return self.app.now()

    def backoff(self, retry: int) -> None:
        pass  # no wall-clock wait: the rival commits once, the retry cannot lose again

    def load_many(
        self, aggregate_ids: Sequence[UUID], *, cache_new: bool = True
    ) -> dict[UUID, Any]:
        return self.app.load_many(aggregate_ids, cache_new=cache_new)

    def load_stored(self, aggregate_id: UUID) -> Any | None:
        return self.app.load_stored(aggregate_id)

    def save_in_order(self, events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None:
        if not self.fired:
            self.fired += 1
            self.rival()
        self.app.save_in_order(events, aggregates)

    def cache_committed(self, aggregates: Sequence[Any]) -> None:
        self.app.cache_committed(aggregates)

    def stream_versions(self, stream_ids: Sequence[UUID]) -> dict[UUID, int]:
        return self.app.stream_versions(stream_ids)

    def record_refusals(self, refusals: Sequence[Refusal]) -> None:
        self.app.record_refusals(refusals)


# -- the fleet ---------------------------------------------------------------------

R1_SANDBOXES = ("a1", "a2", "a3", "a4", "x")  # homed on r1 ("x": the rival's)
R2_SANDBOXES = ("b1", "b2")  # homed on r2


def fleet(app: SchedulerApplication, clock: Clock, r1_instances: int) -> None:
    """r1 (``r1_instances`` slots) homes a1..a4 and x; r2 (roomy) homes b1 and b2. Built
    the same way on every store, so the same requests get the same answers."""
    register(app, "r1", at=clock(), allocatable=capacity(instances=r1_instances, operations=16))
    for sandbox_id in R1_SANDBOXES:
        assert create_sandbox(app, sandbox_id) == "r1"
    register(app, "r2", at=clock(), allocatable=capacity(instances=8, vcpu_count=16))
    app.start_drain("r1")  # so the next sandboxes are homed on r2
    for sandbox_id in R2_SANDBOXES:
        assert create_sandbox(app, sandbox_id) == "r2"
    app.cancel_drain("r1")


def answer(outcome: Outcome | None) -> tuple[Any, ...]:
    """An answer, comparable across stores: the assignment and whether it was created,
    or the refusal's type and message."""
    assert outcome is not None
    if isinstance(outcome, SchedulerError):
        return (type(outcome).__name__, str(outcome))
    assignment, created = outcome
    assert isinstance(assignment, DurableAssignment)
    return ("assigned", assignment, created)


def state(app: SchedulerApplication) -> dict[str, Any]:
    """What the store holds: each sandbox's assignment and each runner's reservation."""
    held: dict[str, Any] = {s: app.get_assignment(s) for s in R1_SANDBOXES + R2_SANDBOXES}
    held.update({r: app.get_runner(r).reserved for r in ("r1", "r2")})
    return held


@dataclass
class Case:
    """A batch and the rival commit that it loses to."""

    r1_instances: int
    batch: list[str]  # sandbox ids, in request order (a repeat: a duplicate request)
    rival: Rival
    retried: int  # how many requests must be decided again
    rival_after: bool = False  # the serial order puts the rival after the batch


def serial(
    tmp_path: Path, clock: Clock, case: Case, requests: list[ScheduleRequest]
) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    """The answers and state of the requests one by one, on a fresh SQLite store, with
    the rival's commit before them (or after, if it cannot conflict)."""
    reference = Store(
        "sqlite",
        {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "ref.db")},
        clock,
    )
    try:
        app = reference.open()
        fleet(app, clock, case.r1_instances)
        if not case.rival_after:
            case.rival(app)
        answers = [answer(PlacementBatch(app).run([request])[0]) for request in requests]
        if case.rival_after:
            case.rival(app)
        return answers, state(app)
    finally:
        reference.close()


def run_case(store: Store, clock: Clock, tmp_path: Path, case: Case) -> None:
    app, rival = store.open(sleep=lambda _: None), store.open()
    fleet(app, clock, case.r1_instances)
    requests = [schedule_request(sandbox_id, clock()) for sandbox_id in case.batch]
    port = RivalFirst(app, lambda: case.rival(rival))
    outcomes = PlacementBatch(port).run(requests)
    assert port.fired == 1
    expected_answers, expected_state = serial(tmp_path, clock, case, requests)
    got = [answer(outcome) for outcome in outcomes]
    for index, (ours, theirs) in enumerate(zip(got, expected_answers, strict=True)):
        assert ours == theirs, f"request {index} ({case.batch[index]}): {ours} != {theirs}"
    assert state(app) == expected_state
    assert app.metrics.contention_retries == case.retried
    assert app.metrics.contention_errors == 0


# The rival's request is built once, so both stores see the same rival placement.
RIVAL_X = schedule_request("x", Clock()())
RIVAL_A1 = schedule_request("a1", Clock()())


def place_x(app: SchedulerApplication) -> None:
    assert app.schedule(RIVAL_X)[1]


def place_a1(app: SchedulerApplication) -> None:
    assert app.schedule(RIVAL_A1)[1]


def grow_r1(app: SchedulerApplication) -> None:
    app.change_allocatable("r1", capacity(instances=3, operations=16))


def drain_r1(app: SchedulerApplication) -> None:
    app.start_drain("r1")


def strip_r1_evidence(app: SchedulerApplication) -> None:
    """A heartbeat that drops r1's materializations (so r1 would fail the placement
    rules from now on): it writes only r1's lease stream."""
    clock = app.now()
    app.record_heartbeat(runner_id="r1", at=clock, artifact_digests=[], materializations=[])


CASES = {
    # r1 has 3 slots; the rival takes one: a1 to a4 all read r1 and are decided again
    # (a3 is now refused for capacity, a4 still is); b1 on r2 is committed at once.
    "placement takes a slot: several affected": Case(
        3, ["a1", "b1", "a2", "a3", "a4"], place_x, retried=4
    ),
    # r1 has 1 slot; the rival grows it to 3: a2 and a3, first refused, are placed.
    "allocatable grows: refusals become placements": Case(
        1, ["a1", "a2", "b1", "a3"], grow_r1, retried=3
    ),
    # the rival places a1 itself: a1 and its duplicate replay the rival's assignment,
    # a2 (read r1, which the rival wrote) is decided again and still placed.
    "rival places a batch sandbox": Case(3, ["a1", "b1", "a1", "a2"], place_a1, retried=3),
    # dependents: the duplicates of a1 and of a2 read only their sandbox, which a1 and
    # a2 wrote; the rival changed r1 alone. Decided again, they are refused like a1 and
    # a2 (draining); left final, they would replay assignments that were never saved.
    "drain: dependents refused with what they repeat": Case(
        3, ["a1", "b1", "a1", "a2", "b2", "a2"], drain_r1, retried=4
    ),
    # dependents again: a2 loses its slot to the rival (r1 has 2), and so must a2's
    # duplicate; a1's duplicate replays a1's assignment, saved on the second round.
    "placement takes a slot: dependents of a refused request": Case(
        2, ["a1", "a1", "a2", "b1", "a2"], place_x, retried=4
    ),
    # a heartbeat writes only the lease stream: no conflict, nothing decided again,
    # and the serial order is the batch, then the heartbeat.
    "heartbeat: no conflict": Case(
        3, ["a1", "b1", "a2"], strip_r1_evidence, retried=0, rival_after=True
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_batch_that_loses_a_race_answers_as_a_serial_execution(
    store: Store, clock: Clock, tmp_path: Path, name: str
) -> None:
    run_case(store, clock, tmp_path, CASES[name])
