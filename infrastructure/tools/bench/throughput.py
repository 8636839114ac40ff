"""Throughput of ``secondbox-scheduler bench`` from W worker processes: the raw
eventsourcing baseline, placement over runners with spare capacity, and contention on
a few hot runners (with reserved <= allocatable checked on them at the end)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from psycopg.conninfo import make_conninfo

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    POSTGRES_MODULE,
    settings_from_url,
)
from secondbox_scheduler.infrastructure.tools.bench.database import settle
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
)
from secondbox_scheduler.infrastructure.tools.bench.ledger import acknowledged_homes, check_ledger
from secondbox_scheduler.infrastructure.tools.bench.row_lock_peer import create_tables
from secondbox_scheduler.infrastructure.tools.bench.serve_metrics import SpeedProbe
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.timing import now
from secondbox_scheduler.infrastructure.tools.bench.workers import (
    Job,
    RawJob,
    RowLockJob,
    ScheduleJob,
    WorkerPool,
    summarize,
)

HOT_RUNNERS = 4
HOT_FILL = 0.95  # hot runners hold room for this share of the contention sandboxes
SERIALIZATION_RETRY_LIMIT = 8


def measure_raw(pool: WorkerPool, env: dict[str, str], settings: BenchSettings) -> dict[str, Any]:
    """Saves of new one-event aggregates: 1, 2 and N per transaction (N: the ceiling a
    batch of placements can approach)."""
    found: dict[str, Any] = {}
    for key, per_transaction in (
        ("one_aggregate", 1),
        ("two_aggregates", 2),
        ("batched_aggregates", settings.raw_batch),
    ):
        jobs: list[Job] = [
            RawJob(env, per_transaction, settings.raw_seconds) for _ in range(pool.workers)
        ]
        settle(env)  # as before every timed run: what the previous one left is not counted
        summary = summarize(pool.run(jobs), count="saved")
        summary["aggregates_per_transaction"] = per_transaction
        summary["transactions_per_second"] = summary.pop("per_second")
        found[key] = summary
    return found


def _spread(ids: list[str], workers: int) -> list[list[str]]:
    return [ids[index::workers] for index in range(workers)]


def _homed_sandboxes(
    app: SchedulerApplication, settings: BenchSettings, pool_name: str, count: int, at: Any
) -> dict[str, str]:
    """A roomy pool of ``settings.runners`` runners and ``count`` sandboxes homed on them
    at random; sandbox id -> home runner id."""
    rng = random.Random(settings.seed)
    fleet = roomy_fleet(pool_name, settings.runners, instances=100_000)
    snapshots = register_fleet(app, fleet, at)
    runner_ids = [spec.runner_id for spec in fleet]
    homes = {f"{pool_name}-{index:07d}": rng.choice(runner_ids) for index in range(count)}
    create_homed_sandboxes(
        app,
        [(sandbox_id, snapshots[home]) for sandbox_id, home in homes.items()],
        bench_requirements(pool_name),
        at,
    )
    return homes


def measure_placement(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    expected_rate: float,
    progress: Progress,
    *,
    threads: int = 1,
    pool_name: str = "place",
    offered_per_second: float | None = None,
    before_run: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Placements over a roomy pool: ``threads`` concurrent callers per worker (1: one
    call at a time, so every batch holds one request; more: the batcher groups them).
    With ``offered_per_second`` the run is an open loop: requests arrive at that rate
    over all workers whether or not the earlier ones were answered (``threads`` callers
    per worker take them), each timed from its arrival."""
    count = math.ceil(expected_rate * settings.placement_seconds * 1.5) + 50 * settings.workers
    progress(f"{pool_name}: registering {settings.runners:,} runners, creating {count:,} sandboxes")
    homes = _homed_sandboxes(app, settings, pool_name, count, now())
    load = (
        f"{offered_per_second:,.0f} requests/s arriving (open loop), {threads} callers/worker"
        if offered_per_second
        else f"{threads} callers"
    )
    seconds = settings.placement_seconds
    progress(f"{pool_name}: {settings.workers} workers x {load} for {seconds:g}s")
    jobs: list[Job] = [
        ScheduleJob(
            env=env,
            pool_name=pool_name,
            sandbox_ids=tuple(ids),
            warm_runner_ids=tuple(sorted({homes[i] for i in ids})),
            seconds=settings.placement_seconds,
            seed=settings.seed,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            threads=threads,
            offered_per_second=(
                offered_per_second / settings.workers if offered_per_second else None
            ),
        )
        for ids in _spread(list(homes), settings.workers)
    ]
    progress(f"{pool_name}: settling the database ({settle(env)})")
    before_run()  # the runners and sandboxes are written: the placements come next
    with SpeedProbe() as probe:
        results = pool.run(jobs)
    summary = summarize(results)
    summary["speed_probe_us"] = probe.median_us()
    summary["steal_share"] = probe.steal_share
    summary["runners"] = settings.runners
    summary["callers_per_worker"] = threads
    summary["sandboxes_prepared"] = count
    if offered_per_second:
        summary["offered_per_second"] = round(offered_per_second, 1)
        summary["late_starts"] = sum(result.late_starts for result in results)
    summary["ledger"] = check_ledger(env, acknowledged_homes(results, homes))
    return summary


def measure_new_sandbox(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    expected_rate: float,
    progress: Progress,
    *,
    threads: int,
    pool_name: str = "newsbx",
) -> dict[str, Any]:
    """The new-sandbox path: ``threads`` callers per worker, each call
    ``create_sandbox`` (the home chosen over a roomy pool of ``settings.runners``) then
    ``schedule``, for the placement duration; timed from the creation."""
    count = math.ceil(expected_rate * settings.placement_seconds * 1.5) + 50 * settings.workers
    progress(f"{pool_name}: registering {settings.runners:,} runners")
    fleet = roomy_fleet(pool_name, settings.runners, instances=100_000)
    register_fleet(app, fleet, now())
    app.runner_snapshots(pool_name)  # the read models caught up, untimed
    runner_ids = [spec.runner_id for spec in fleet]
    ids = [f"{pool_name}-{index:07d}" for index in range(count)]
    progress(
        f"{pool_name}: {settings.workers} workers x {threads} callers, create_sandbox then "
        f"schedule, for {settings.placement_seconds:g}s"
    )
    jobs: list[Job] = [
        ScheduleJob(
            env=env,
            pool_name=pool_name,
            sandbox_ids=tuple(part),
            warm_runner_ids=tuple(runner_ids),
            seconds=settings.placement_seconds,
            seed=settings.seed,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            threads=threads,
            create_first=True,
        )
        for part in _spread(ids, settings.workers)
    ]
    progress(f"{pool_name}: settling the database ({settle(env)})")
    results = pool.run(jobs)
    summary = summarize(results)
    summary["runners"] = settings.runners
    summary["callers_per_worker"] = threads
    summary["ledger"] = check_ledger(env, acknowledged_homes(results, None), runner_ids)
    return summary


def measure_row_lock(
    pool: WorkerPool, env: dict[str, str], settings: BenchSettings, progress: Progress
) -> dict[str, Any]:
    """The row-lock peer (:mod:`.row_lock_peer`): same server, workers, runners and
    request, one SERIALIZABLE transaction per placement."""
    settings_of = settings_from_url(env[DATABASE_URL])
    if settings_of["PERSISTENCE_MODULE"] != POSTGRES_MODULE:
        return {"skipped": "the row-lock peer runs on PostgreSQL only"}
    conninfo = make_conninfo(
        host=settings_of["POSTGRES_HOST"], port=settings_of["POSTGRES_PORT"],
        user=settings_of["POSTGRES_USER"], password=settings_of["POSTGRES_PASSWORD"] or None,
        dbname=settings_of["POSTGRES_DBNAME"],
    )  # fmt: skip
    schema = settings_of.get("POSTGRES_SCHEMA") or "public"
    rng = random.Random(settings.seed)
    runner_ids = [f"rl-{index:05d}" for index in range(settings.runners)]
    roomy = roomy_fleet("rl", 1, instances=100_000)[0].allocatable
    create_tables(conninfo, schema, [(runner_id, roomy) for runner_id in runner_ids])
    count = 200_000 if not settings.quick else 20_000
    placements = [(f"rl-sbx-{index:07d}", rng.choice(runner_ids)) for index in range(count)]
    progress(f"row-lock peer: {settings.workers} workers for {settings.placement_seconds:g}s")
    jobs: list[Job] = [
        RowLockJob(conninfo, schema, tuple(placements[i :: settings.workers]),
                   settings.placement_seconds)
        for i in range(settings.workers)
    ]  # fmt: skip
    progress(f"row-lock peer: settling the database ({settle(env)})")
    summary = summarize(pool.run(jobs))
    summary["runners"] = settings.runners
    return summary


def measure_contention(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    progress: Progress,
    *,
    threads: int = 1,
    pool_name: str = "hot",
    sandboxes: int | None = None,
) -> dict[str, Any]:
    """``sandboxes`` homed on the hot runners (``settings.contention_sandboxes`` unless
    given), each scheduled once by the workers' ``threads`` callers."""
    rng = random.Random(settings.seed + 1)
    at = now()
    count = sandboxes or settings.contention_sandboxes
    room = math.ceil(count * HOT_FILL / HOT_RUNNERS)
    progress(f"contention: {count:,} sandboxes on {HOT_RUNNERS} runners with room for {room:,}")
    fleet = roomy_fleet(pool_name, HOT_RUNNERS, instances=room)
    snapshots = register_fleet(app, fleet, at)
    runner_ids = [spec.runner_id for spec in fleet]
    sandbox_ids = [f"{pool_name}-sbx-{index:07d}" for index in range(count)]
    homes = {
        sandbox_id: runner_ids[index % HOT_RUNNERS] for index, sandbox_id in enumerate(sandbox_ids)
    }
    rng.shuffle(sandbox_ids)
    create_homed_sandboxes(
        app,
        [(sandbox_id, snapshots[homes[sandbox_id]]) for sandbox_id in sandbox_ids],
        bench_requirements(pool_name),
        at,
    )
    progress(f"contention: {settings.workers} workers scheduling every sandbox")
    jobs: list[Job] = [
        ScheduleJob(
            env=env,
            pool_name=pool_name,
            sandbox_ids=tuple(ids),
            warm_runner_ids=tuple(runner_ids),
            seconds=None,
            seed=settings.seed,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            threads=threads,
        )
        for ids in _spread(sandbox_ids, settings.workers)
    ]
    progress(f"{pool_name}: settling the database ({settle(env)})")
    summary = summarize(pool.run(jobs))
    summary["goodput_per_second"] = summary.pop("per_second")
    summary["sandboxes"] = count
    summary["hot_runners"] = HOT_RUNNERS
    summary["room_per_runner"] = room
    summary["hot_runner_state"] = _hot_runner_state(env, runner_ids, summary["placed"])
    return summary


def _hot_runner_state(env: dict[str, str], runner_ids: list[str], placed: int) -> dict[str, Any]:
    """Reserved against allocatable on the hot runners, folded from their streams by a
    new application (no cache shared with the workers)."""
    checker = SchedulerApplication(env=env)
    try:
        rows = []
        oversubscribed = 0
        reservations = 0
        for runner_id in runner_ids:
            snapshot = checker.fold_runner(runner_id)
            reserved, allocatable = snapshot.reserved.as_dict(), snapshot.allocatable.as_dict()
            over = [dim for dim in reserved if reserved[dim] > allocatable[dim]]
            oversubscribed += bool(over)
            reservations += len(checker.fold_runner_assignments(runner_id))
            rows.append(
                {
                    "runner_id": runner_id,
                    "reserved_instances": reserved["instances"],
                    "allocatable_instances": allocatable["instances"],
                    "oversubscribed_dimensions": over,
                }
            )
    finally:
        checker.close()
    return {
        "runners": rows,
        "oversubscribed_runners": oversubscribed,
        "reservations": reservations,
        "reservations_match_placements": reservations == placed,
    }
