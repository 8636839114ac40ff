"""Selection cost of ``secondbox-scheduler bench``: ``domain.placement.select_runner``
in memory, ``SchedulerApplication.create_sandbox`` in the store, and the path of a new
sandbox end to end (``create_sandbox`` then ``schedule``), over pools of growing size
(median per call, ratio to the next smaller pool; new sandboxes placed per second by
one caller); then ``create_sandbox`` over one large pool, refused (a toolchain digest
no runner has) and homed (:func:`measure_large_pool`)."""

from __future__ import annotations

import itertools
import random
from typing import Any

from secondbox_scheduler.domain.errors import NoCompatibleRunnerError
from secondbox_scheduler.domain.placement.evidence import summarize_refusals
from secondbox_scheduler.domain.placement.rules import select_runner
from secondbox_scheduler.domain.values import Requirements
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.tools.bench.database import settle
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    HEARTBEAT_TIMEOUT,
    PROFILE,
    FleetRunner,
    bench_requirements,
    register_fleet,
    roomy_fleet,
    runner_snapshots,
    schedule_request,
    varied_fleet,
)
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.timing import median_ms, now

LARGE_POOL_REGISTERED = 16  # runners of the large pool registered with their events


def _selection_row(
    app: SchedulerApplication,
    pool_name: str,
    fleet: list[FleetRunner],
    select_calls: int,
    create_calls: int,
    seed: int,
) -> dict[str, Any]:
    """Time select_runner over the pool in memory, then create_sandbox over it in the
    store (registration, read model catch-up and one warm-up call untimed)."""
    requirements = bench_requirements(pool_name)
    at = now()
    snapshots = runner_snapshots(fleet, at)
    select_ms = median_ms(
        lambda: select_runner(requirements, snapshots, now(), HEARTBEAT_TIMEOUT), select_calls
    )
    register_fleet(app, fleet, at)
    app.runner_snapshots(pool_name)  # the read models catch up
    serial = itertools.count()

    def create(sandbox_id: str | None = None) -> str:
        """A new sandbox of the pool; its home runner."""
        sandbox_id = sandbox_id or f"{pool_name}-sandbox-{next(serial)}"
        return app.create_sandbox(
            sandbox_id=sandbox_id,
            workspace_id=f"ws-{sandbox_id}",
            profile_revision_id=PROFILE,
            requirements=requirements,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )

    def create_and_schedule() -> object:
        sandbox_id = f"{pool_name}-sandbox-{next(serial)}"
        create(sandbox_id)
        request = schedule_request(
            sandbox_id, requirements, now(), seed=seed, serialization_retry_limit=10
        )
        return app.schedule(request)

    create()  # warm-up
    create_ms = median_ms(create, create_calls)
    new_ms = median_ms(create_and_schedule, create_calls)
    return {
        "runners": len(fleet),
        "select_runner_ms": round(select_ms, 3),
        "select_runner_calls": select_calls,
        "create_sandbox_ms": round(create_ms, 3),
        "create_sandbox_calls": create_calls,
        "new_sandbox_ms": round(new_ms, 3),
        "new_sandboxes_per_second": round(1000.0 / new_ms, 1) if new_ms else 0.0,
    }


def measure_selection(
    app: SchedulerApplication, settings: BenchSettings, progress: Progress
) -> dict[str, Any]:
    rng = random.Random(settings.seed + 2)
    rows: list[dict[str, Any]] = []
    for size, select_calls, create_calls in zip(
        settings.selection_sizes, settings.select_calls, settings.create_calls, strict=True
    ):
        progress(f"selection: {size:,} runners")
        pool_name = f"select-{size}"
        fleet = varied_fleet(pool_name, size, rng)
        rows.append(
            _selection_row(app, pool_name, fleet, select_calls, create_calls, settings.seed)
        )
    for row, previous in zip(rows[1:], rows, strict=False):
        row["select_runner_ratio"] = round(
            row["select_runner_ms"] / previous["select_runner_ms"], 2
        )
        row["create_sandbox_ratio"] = round(
            row["create_sandbox_ms"] / previous["create_sandbox_ms"], 2
        )
        row["new_sandbox_ratio"] = round(row["new_sandbox_ms"] / previous["new_sandbox_ms"], 2)
    return {"rows": rows, "large_pool": measure_large_pool(app, settings, progress)}


def measure_large_pool(
    app: SchedulerApplication, settings: BenchSettings, progress: Progress
) -> dict[str, Any]:
    """``create_sandbox`` over one pool of ``settings.large_pool`` runners: asking a
    toolchain digest no runner has (refused, projections/unmatched.py) and a normal
    request (a home chosen).

    Setup: :data:`LARGE_POOL_REGISTERED` runners registered as usual (the best ones: the
    homes a normal request gets, checked against their aggregates), the others rows of
    the read model alone, copies of a registered runner's row with fewer free instances
    (:meth:`RunnerSnapshotsView.copy_row`), written in one statement: registering 50,000
    runners with their events would take minutes. Then the database is settled
    (:func:`~secondbox_scheduler.infrastructure.tools.bench.database.settle`)."""
    size, calls = settings.large_pool, settings.large_pool_calls
    pool_name = f"large-{size}"
    progress(f"selection: a pool of {size:,} runners")
    read_models = app.queries.current_read_models()
    if read_models is None:
        return {}
    fleet = roomy_fleet(pool_name, LARGE_POOL_REGISTERED, instances=64)
    register_fleet(app, fleet, now())
    app.runner_snapshots(pool_name)  # the read models catch up
    copies = size - len(fleet)
    read_models.runners.copy_row(fleet[0].runner_id, f"{pool_name}-copy-", copies, instances=8)
    # as before every timed run; here also the planner's statistics, which a pool grown
    # by registrations has (autoanalyze) and a table filled in one statement lacks
    settled = settle({DATABASE_URL: app.env[DATABASE_URL]}) if DATABASE_URL in app.env else "-"
    progress(f"selection: {pool_name} settled ({settled})")
    matched = bench_requirements(pool_name)
    runtime, _ = matched.preferred_artifact_digests
    unmatched = matched.model_copy(
        update={"preferred_artifact_digests": (runtime, "sha256:bench-toolchain-nobody-has")}
    )
    serial = itertools.count()

    def create(requirements: Requirements) -> object:
        try:
            return app.create_sandbox(
                sandbox_id=f"{pool_name}-sandbox-{next(serial)}",
                workspace_id="ws-large",
                profile_revision_id=PROFILE,
                requirements=requirements,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
            )
        except NoCompatibleRunnerError as error:
            return error

    refusal = create(unmatched)  # warm-up, and the refusal it gives
    if not isinstance(refusal, NoCompatibleRunnerError):
        raise BenchError(f"the unmatched request was not refused: {refusal!r}")
    home = create(matched)
    if not isinstance(home, str):
        raise BenchError(f"the normal request was refused: {home}")
    unmatched_ms = median_ms(lambda: create(unmatched), calls)
    matched_ms = median_ms(lambda: create(matched), calls)
    return {
        "runners": size,
        "registered": len(fleet),
        "calls": calls,
        "unmatched_ms": round(unmatched_ms, 3),
        "matched_ms": round(matched_ms, 3),
        "refusal": summarize_refusals(refusal.evaluations, refusal.unlisted),
    }
