"""Running a simulation: :func:`run_simulation` on a store, and the SQLite file it writes."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    READ_MODELS,
    sqlite_path,
)
from secondbox_scheduler.infrastructure.tools.simulation.config import (
    SimulatedClock,
    SimulationConfig,
)
from secondbox_scheduler.infrastructure.tools.simulation.fleet import FleetSimulation
from secondbox_scheduler.infrastructure.tools.simulation.result import SimulationResult, summarise


def run_simulation(
    config: SimulationConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> SimulationResult:
    """Run the simulation on ``config.database_url`` and summarise it.

    With ``config.fresh`` a SQLite database file is deleted first, so reruns are
    reproducible. On a store that already holds events, every id (runners, pools,
    sandboxes, profile revisions) is prefixed with ``run<position>-`` so the run
    never collides with what is there. ``progress(done, total)`` is called after
    every start attempt cycle.
    """
    started = time.perf_counter()
    path = sqlite_path(config.database_url)
    if config.fresh and path is not None:
        delete_sqlite_database(path)
    clock = SimulatedClock()
    app = SchedulerApplication(
        # the reconciler reads the read models; caught up inline, so runs stay reproducible
        env={**(env or {}), DATABASE_URL: config.database_url, READ_MODELS: "on"},
        now=clock,
        rng=random.Random(config.seed),
    )
    try:
        before = app.event_count()
        prefix = f"run{before}-" if before else ""
        simulation = FleetSimulation(app, clock, config, prefix=prefix, progress=progress)
        simulation.run_all()
        return summarise(simulation, before, time.perf_counter() - started)
    finally:
        app.close()


def delete_sqlite_database(path: Path) -> None:
    """Remove a SQLite database and its journal files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
