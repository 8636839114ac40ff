"""Large histories for the audit's scale figures (``secondbox-scheduler bench``, section
``audit``), written fast and as the application writes them.

Two shapes:

- :func:`steady_history`: a steady fleet (runners, sandboxes homed over them) whose
  sandboxes go round generation after generation (placed, released, advanced) with a
  heartbeat per runner and round, until the log holds a number of events: the log grows,
  the fleet does not;
- :func:`one_runner_history`: one runner holding ``reservations`` live reservations
  (every sandbox homed on it, placed, none released).

Placements go through :meth:`SchedulerApplication.schedule_many` (the batch path of
``schedule``: real evidence, chain links, snapshots); releases and generation advances
are made by the aggregates and saved a few hundred per transaction in the order one
release at a time would write them (the sandbox's release followed by the runner's
capacity release at once, then the advance). Setup as in :mod:`.fleet`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
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


def _request(sandbox_id: str, generation: int, requirements: Requirements) -> ScheduleRequest:
    now = datetime.now(UTC)
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


def _release_and_advance(
    app: SchedulerApplication, sandbox_ids: Sequence[str], generation: int
) -> None:
    """Release generation ``generation`` of each sandbox and advance it, a batch per
    transaction, each release's two events adjacent as ``release`` writes them."""
    for part in chunks(sandbox_ids, BATCH):
        now = datetime.now(UTC)
        events: list[Any] = []
        aggregates: dict[Any, Any] = {}
        runners: dict[str, Runner] = {}
        for sandbox_id in part:
            sandbox: Any = app.repository.get(sandbox_uuid(sandbox_id))
            assert isinstance(sandbox, Sandbox)
            record = sandbox.release(generation, _token(sandbox_id, generation), PROOF, now)
            assert record is not None
            runner_id = record["runner_id"]
            runner = runners.get(runner_id)
            if runner is None:
                loaded: Any = app.repository.get(runner_uuid(runner_id))
                assert isinstance(loaded, Runner)
                runner = runners[runner_id] = loaded
            runner.release(
                sandbox_id=sandbox_id, generation=generation, release_proof=PROOF, at=now
            )
            events += sandbox.collect_events()
            events += runner.collect_events()
            sandbox.advance_generation(generation, now)
            events += sandbox.collect_events()
            aggregates[sandbox.id] = sandbox
            aggregates[runner.id] = runner
        app.save_in_order(events, list(aggregates.values()))


def _heartbeats(app: SchedulerApplication, runner_ids: Sequence[str]) -> None:
    """One heartbeat per runner, each recorded (a renewal)."""
    for part in chunks(runner_ids, BATCH):
        now = datetime.now(UTC)
        leases = []
        for runner_id in part:
            lease = app.queries.lease(runner_id)
            lease.observe(
                at=now,
                artifact_digests=(RUNTIME,),
                materializations=[MATERIALIZATION],
                renewal_interval=timedelta(0),  # a renewal every round
                recorded_at=now,
            )
            leases.append(lease)
        app.save(*leases)


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
    generation = 1
    runner_ids = [spec.runner_id for spec in fleet]
    while app.event_count() - start < events:
        _place(app, sandbox_ids, generation, requirements)
        _release_and_advance(app, sandbox_ids, generation)
        _heartbeats(app, runner_ids)
        generation += 1
        progress(f"steady history: {app.event_count() - start:,} events")
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
