"""Large histories for the audit's scale figures (``secondbox-scheduler bench``, section
``audit``), written fast and as the application writes them.

Two shapes:

- :func:`steady_history`: a steady fleet (runners, sandboxes homed over them) whose
  sandboxes go round generation after generation (placed, released, advanced) with a
  heartbeat per runner and round, until the log holds a number of events: the log grows,
  the fleet does not;
- :func:`one_runner_history`: one runner holding ``reservations`` live reservations
  (every sandbox homed on it, placed, none released).

The steady fleet is written fast (a million events in a couple of minutes): its
aggregates are loaded once and kept in memory, every command is the aggregates' own
(``decide_placement`` as ``schedule`` decides, ``Sandbox.release``, ``Runner.release``,
``advance_generation``, ``RunnerLease.observe``: real evidence), and their events are
saved a few hundred placements per transaction with :meth:`save_in_order`, in the order
the commands one at a time would write them (a fence, its reservation, its token index;
a release, its capacity release at once, then the advance), with the store's own
encoding, chain links and snapshots. The busy runner's placements go through
:meth:`SchedulerApplication.schedule_many` (the batch path of ``schedule``). Setup as in
:mod:`.fleet`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.placement.deciding import Placed, decide_placement
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Requirements, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    CLAIM_AHEAD,
    DEADLINE_AHEAD,
    HEARTBEAT_TIMEOUT,
    MATERIALIZATION,
    PROFILE,
    RUNTIME,
    TOOLCHAIN,
    bench_requirements,
    chunks,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
)

BATCH = 250  # sandboxes per transaction of releases
PROOF = {"bench": "released"}


def _token(sandbox_id: str, generation: int) -> bytes:
    return hashlib.sha256(f"audit-bench:{sandbox_id}:{generation}".encode()).digest()


def _request(
    sandbox_id: str, generation: int, requirements: Requirements, now: datetime | None = None
) -> ScheduleRequest:
    now = now or datetime.now(UTC)
    return ScheduleRequest(
        assignment_id=f"assignment-{sandbox_id}-{generation}",
        assignment_command_id=f"command-{sandbox_id}-{generation}",
        instance_id=f"instance-{sandbox_id}",
        sandbox_id=sandbox_id,
        workspace_id=f"ws-{sandbox_id}",
        start_mutation_id=f"start-{sandbox_id}-{generation}",
        profile_revision_id=PROFILE,
        requirements=requirements,
        assignment_command={"kind": "start"},
        fencing_token=_token(sandbox_id, generation),
        resolved_artifacts={"runtime": RUNTIME, "toolchain": TOOLCHAIN},
        claim_expires_at=now + CLAIM_AHEAD,
        operation_deadline=now + DEADLINE_AHEAD,
        retry_limit=2,
        serialization_retry_limit=5,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        now=now,
        effect_started_at=now,
        plan_ready_at=now,
    )


def _place(
    app: SchedulerApplication,
    sandbox_ids: Sequence[str],
    generation: int,
    requirements: Requirements,
) -> None:
    for part in chunks(sandbox_ids, BATCH):
        outcomes = app.schedule_many([_request(s, generation, requirements) for s in part])
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome


class _SteadyFleet:
    """The steady fleet's aggregates, in memory: each round is decided on them and their
    events saved in order (what the commands would write, without loading anything)."""

    def __init__(self, app: SchedulerApplication, runner_ids: Sequence[str],
                 sandbox_ids: Sequence[str]) -> None:  # fmt: skip
        self.app = app
        get: Any = app.repository.get
        self.runners: dict[str, Runner] = {r: get(runner_uuid(r)) for r in runner_ids}
        self.leases: dict[str, Any] = {r: app.queries.lease(r) for r in runner_ids}
        self.sandboxes: dict[str, Sandbox] = {s: get(sandbox_uuid(s)) for s in sandbox_ids}

    def _home(self, runner_id: str) -> tuple[Runner, Any]:
        return self.runners[runner_id], self.leases[runner_id]

    def place(self, generation: int, requirements: Requirements) -> None:
        for part in chunks(list(self.sandboxes), BATCH):
            now = datetime.now(UTC)
            events: list[Any] = []
            touched: dict[Any, Any] = {}
            for sandbox_id in part:
                sandbox = self.sandboxes[sandbox_id]
                request = _request(sandbox_id, generation, requirements, now)
                decided = decide_placement(request, sandbox, self._home, attempt=0, clock=now)
                if not isinstance(decided, Placed):
                    raise RuntimeError(f"{sandbox_id}#{generation} not placed: {decided!r}")
                placed_sandbox, runner, token = decided.aggregates
                for aggregate in (placed_sandbox, runner, token):
                    events += aggregate.collect_events()
                    touched[aggregate.id] = aggregate
            self.app.save_in_order(events, list(touched.values()))

    def release_and_advance(self, generation: int) -> None:
        for part in chunks(list(self.sandboxes), BATCH):
            now = datetime.now(UTC)
            events: list[Any] = []
            touched: dict[Any, Any] = {}
            for sandbox_id in part:
                sandbox = self.sandboxes[sandbox_id]
                record = sandbox.release(generation, _token(sandbox_id, generation), PROOF, now)
                assert record is not None
                runner = self.runners[record["runner_id"]]
                runner.release(
                    sandbox_id=sandbox_id, generation=generation, release_proof=PROOF, at=now
                )
                events += sandbox.collect_events()
                events += runner.collect_events()
                sandbox.advance_generation(generation, now)
                events += sandbox.collect_events()
                touched[sandbox.id] = sandbox
                touched[runner.id] = runner
            self.app.save_in_order(events, list(touched.values()))

    def heartbeats(self) -> None:
        """One heartbeat per runner, each recorded (a renewal)."""
        now = datetime.now(UTC)
        events: list[Any] = []
        for lease in self.leases.values():
            lease.observe(
                at=now,
                artifact_digests=(RUNTIME,),
                materializations=[MATERIALIZATION],
                renewal_interval=timedelta(0),  # a renewal every round
                recorded_at=now,
            )
            events += lease.collect_events()
        self.app.save_in_order(events, list(self.leases.values()))


def steady_history(
    app: SchedulerApplication,
    events: int,
    *,
    runners: int = 50,
    sandboxes: int = 1000,
    progress: Callable[[str], None] = lambda _: None,
    prefix: str = "steady",
) -> int:
    """Grow the log to at least ``events`` events with a steady fleet; the events written.
    ``prefix`` names the fleet's pool and sandboxes (another prefix: another fleet)."""
    start = app.event_count()
    pool = f"audit-{prefix}"
    fleet = roomy_fleet(pool, runners, instances=sandboxes)
    at = datetime.now(UTC)
    snapshots = register_fleet(app, fleet, at)
    homes = list(snapshots.values())
    sandbox_ids = [f"{prefix}-{index:06d}" for index in range(sandboxes)]
    requirements = bench_requirements(pool)
    create_homed_sandboxes(
        app, [(s, homes[i % len(homes)]) for i, s in enumerate(sandbox_ids)], requirements, at
    )
    steady = _SteadyFleet(app, [spec.runner_id for spec in fleet], sandbox_ids)
    generation = 1
    written = app.event_count() - start
    per_round = 6 * sandboxes + runners  # a placement's 3 events, a release's 3, heartbeats
    while written < events:
        steady.place(generation, requirements)
        steady.release_and_advance(generation)
        steady.heartbeats()
        generation += 1
        written += per_round
        progress(f"steady history: {written:,} events")
    return app.event_count() - start


def one_runner_history(
    app: SchedulerApplication,
    reservations: int,
    progress: Callable[[str], None] = lambda _: None,
) -> int:
    """One runner with ``reservations`` live reservations; the events written."""
    start = app.event_count()
    pool = "audit-one"
    fleet = roomy_fleet(pool, 1, instances=reservations)
    at = datetime.now(UTC)
    home = register_fleet(app, fleet, at)[fleet[0].runner_id]
    sandbox_ids = [f"one-{index:06d}" for index in range(reservations)]
    requirements = bench_requirements(pool)
    create_homed_sandboxes(app, [(s, home) for s in sandbox_ids], requirements, at)
    _place(app, sandbox_ids, 1, requirements)
    progress(f"one runner: {reservations:,} reservations")
    return app.event_count() - start
