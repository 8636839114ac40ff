"""A placement batch's details that its answers alone do not show (infrastructure/placing/
batch.py): the runners it caches, the refusals it records, the message of an absent home
runner, the retry limit and its back-off, the races recorded with a placement, and how
many deferrals are worth it.

Found by the mutation run of 2026-12-04 (docs/verification.md, section 5): each test
pins down what a surviving mutant of ``batch.py`` changed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.errors import (
    HomeRunnerUnavailableError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.ids import refusal_log_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.refusals import OPERATION_SCHEDULE
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.placing import batch as batch_module
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.runner_locks import lock_key
from tests.conftest import Clock, PostgresSchema, Store
from tests.factories import capacity, create_sandbox, register, schedule_request
from tests.test_batch_races import RivalFirst, fleet


class _Losing:
    """The application as the batch's store, whose first ``losses`` saves lose a race
    (IntegrityError, nothing written) and whose back-offs are counted, not waited."""

    def __init__(self, app: SchedulerApplication, losses: int) -> None:
        self.app = app
        self.losses = losses
        self.saves = 0
        self.backoffs: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    def backoff(self, retry: int) -> None:
        self.backoffs.append(retry)

    def save_in_order(self, events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None:
        self.saves += 1
        if self.saves <= self.losses:
            raise IntegrityError("a rival moved a stream")
        self.app.save_in_order(events, aggregates)


def test_a_request_that_keeps_losing_is_answered_after_its_retry_limit(
    app: SchedulerApplication, clock: Clock
) -> None:
    """A retry limit of 3: four races lost (the first try and three retries), backing
    off before each retry with a growing count, then a contention error naming 4."""
    fleet(app, clock, r1_instances=4)
    store = _Losing(app, losses=100)
    request = schedule_request("a1", clock()).model_copy(update={"serialization_retry_limit": 3})
    (outcome,) = PlacementBatch(store).run([request])
    assert isinstance(outcome, SerializationContentionError)
    assert outcome.attempts == 4
    assert store.saves == 4
    assert store.backoffs == [0, 1, 2]


def test_the_races_lost_before_a_placement_are_recorded_with_it(
    app: SchedulerApplication, clock: Clock
) -> None:
    fleet(app, clock, r1_instances=4)
    store = _Losing(app, losses=2)
    request = schedule_request("a1", clock()).model_copy(update={"serialization_retry_limit": 3})
    (outcome,) = PlacementBatch(store).run([request])
    assert isinstance(outcome, tuple)
    assert outcome[1]
    fenced = [
        app.mapper.to_domain_event(n)
        for n in app.recorder.select_notifications(start=1, limit=10_000)
        if n.originator_id == sandbox_uuid("a1") and n.topic.endswith(":Sandbox.AssignmentFenced")
    ]
    (event,) = fenced
    assert event.placement["attempt"] == 2  # type: ignore[attr-defined]


def test_a_batch_caches_every_runner_it_committed(app: SchedulerApplication, clock: Clock) -> None:
    """Placements on r1 and r2 in one batch: both cached copies are the committed state."""
    fleet(app, clock, r1_instances=4)
    outcomes = app.schedule_many([schedule_request(s, clock()) for s in ("a1", "b1")])
    assert [isinstance(o, tuple) and o[1] for o in outcomes] == [True, True]
    assert app.repository.cache is not None
    for runner_id in ("r1", "r2"):
        stream = runner_uuid(runner_id)
        cached = app.repository.cache.get(stream)
        assert cached.version == app.stream_versions([stream])[stream]


def test_a_refusal_in_a_batch_records_the_sandboxs_generation(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock(), allocatable=capacity(instances=1))
    create_sandbox(app, "s0")
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s0", clock()))  # the runner is full
    (refused,) = app.schedule_many([schedule_request("s1", clock())])
    assert isinstance(refused, Exception)
    sandbox: Any = app.repository.get(sandbox_uuid("s1"))
    log: Any = app.repository.get(refusal_log_uuid("s1"))
    generation, _ = log.last[OPERATION_SCHEDULE]
    assert generation == sandbox.generation


def test_a_deregistered_home_runner_is_named_in_the_answer(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.deregister_runner("r1")
    (outcome,) = app.schedule_many([schedule_request("s1", clock())])
    assert isinstance(outcome, HomeRunnerUnavailableError)
    assert "home runner 'r1' is not registered" in str(outcome)


def test_deferring_is_worth_it_for_a_quarter_of_the_batch_at_most() -> None:
    few = batch_module._few_deferred
    busy = frozenset({"hot"})
    assert few(["hot", "a", "b", "c"], 4, busy)  # 1 of 4
    assert not few(["hot", "hot", "b", "c"], 4, busy)  # 2 of 4
    assert few(["hot", "hot", "a", "b", "c", "d", "e", "f"], 8, busy)  # 2 of 8
    assert not few(["hot", "hot", "hot", "b", "c", "d", "e", "f"], 8, busy)
    assert few(["a", "b"], 2, busy)  # none


def test_a_rival_placing_the_same_request_first_is_replayed_not_refused(
    store: Store, clock: Clock
) -> None:
    """Another replica places the very request (same generation, same fencing token)
    while the batch decides it: the batch's save fails on the token's stream too, and
    its answer is the rival's assignment, replayed, as a serial execution gives, not a
    reused-token refusal (the token's earlier use is this generation's)."""
    app, rival = store.open(sleep=lambda _: None), store.open()
    fleet(app, clock, r1_instances=4)
    request = schedule_request("a1", clock())
    placed: list[Any] = []
    port = RivalFirst(app, lambda: placed.append(rival.schedule(request)))
    (outcome,) = PlacementBatch(port).run([request])
    assert port.fired == 1
    assert placed[0][1]  # the rival created the assignment
    assert isinstance(outcome, tuple)
    assert outcome == (placed[0][0], False)


@pytest.mark.postgres
def test_a_request_decided_again_waits_for_its_runner_and_is_not_deferred(
    postgres_schema: PostgresSchema, clock: Clock
) -> None:
    """A batch of four deferrable requests (one on "hot", three on "cold") loses a race
    and decides all four again; meanwhile another session holds hot's lock. A request
    decided again is never deferred: the batch waits for hot's lock (released once it
    waits) and places all four, where deferring s1 would have left it unanswered."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "hot", at=clock())
        create_sandbox(app, "s1")
        register(app, "cold", at=clock(), allocatable=capacity(instances=8, vcpu_count=16))
        app.start_drain("hot")
        for sandbox_id in ("c1", "c2", "c3"):
            assert create_sandbox(app, sandbox_id) == "cold"
        app.cancel_drain("hot")
        key = lock_key(app.runner_locks.namespace, "hot")
        holder = psycopg.connect(postgres_schema.server.conninfo(), autocommit=True)
        done = threading.Event()

        class Rival(_Losing):
            def backoff(self, retry: int) -> None:  # between the rounds: hot is taken
                super().backoff(retry)
                holder.execute("SELECT pg_advisory_lock(%s)", (key,))
                releaser.start()

        def release_once_waited() -> None:
            unsigned = key & (2**64 - 1)
            with psycopg.connect(postgres_schema.server.conninfo(), autocommit=True) as conn:
                while not done.is_set():
                    row = conn.execute(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND NOT granted AND classid = %s AND objid = %s",
                        (unsigned >> 32, unsigned & (2**32 - 1)),
                    ).fetchone()
                    if row is not None and row[0]:
                        break
                    time.sleep(0.01)
            holder.execute("SELECT pg_advisory_unlock(%s)", (key,))

        releaser = threading.Thread(target=release_once_waited, daemon=True)
        requests = [schedule_request(s, clock()) for s in ("s1", "c1", "c2", "c3")]
        try:
            outcomes = PlacementBatch(Rival(app, losses=1)).run_deferring(requests, [True] * 4)
        finally:
            done.set()
            releaser.join(30)
            holder.close()
        assert [isinstance(o, tuple) and o[1] for o in outcomes] == [True] * 4
    finally:
        app.close()
