"""Process CPU of each phase of the batched placement path, per placement.

    .venv/bin/python scripts/batch_phases.py [--placements 3000] [--batch 10] [--runners 200]
        [--gc-threshold N]

Sets up as ``scripts/profile_batch.py`` does (roomy runners cached as a long-running
replica has them, homed sandboxes, a new database of the local PostgreSQL server), then
places the sandboxes with ``schedule_many`` in batches of ``--batch``, one thread, with
each phase's functions wrapped to add up their own ``time.process_time`` (a phase's
figure excludes the wrapped phases it calls). ``time.process_time`` counts every thread
of the process: a connection pool's background thread (a connection refused by a full
server and tried again) lands in whichever phase runs meanwhile, so compare a phase
across alternated runs rather than one run's total. Run it from another checkout's
virtual environment to measure that checkout's code (``cd <checkout> && .venv/bin/python
<this checkout>/scripts/batch_phases.py``): the phases wrapped exist in both.
``--gc-threshold``: the collector's young-generation threshold, as the scheduler's
processes set it (``infrastructure/gc_tuning.py``: 20,000); by default Python's (700),
where a collection lands in whichever phase allocates past it, so a change that
allocates less in one phase can move collections, and their CPU, into another. Last,
the CPU and wall time while the batches held their runner locks (from the end of the
locking step to the start of the release: the wrapped phases inside included).
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.placing import batch, runner_locks
from secondbox_scheduler.infrastructure.store import (
    application_store,
    chained_postgres,
    encoding,
    fast_forward,
)
from secondbox_scheduler.infrastructure.tools.bench.database import bench_database
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    schedule_request,
)

spent: dict[str, float] = {}  # CPU seconds per phase label
_inner: list[float] = []  # CPU of the wrapped phases called by the running one


def _wrap(owner: Any, name: str, label: str) -> None:
    function: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        _inner.append(0.0)
        try:
            return function(*args, **kwargs)
        finally:
            elapsed = time.process_time() - start
            spent[label] = spent.get(label, 0.0) + elapsed - _inner.pop()
            if _inner:
                _inner[-1] += elapsed

    setattr(owner, name, timed)


held: dict[str, float] = {}  # while a batch holds its runner locks: CPU and wall seconds
_since: list[float] = []  # when the running batch's locks were taken (CPU, wall)


def _mark_held() -> None:
    """Add up the CPU and wall time from the end of each ``RunnerLocks._take`` (the
    locks held) to the start of the batch's ``RunnerLocks._release``."""
    take, release = runner_locks.RunnerLocks._take, runner_locks.RunnerLocks._release

    def taken(*args: Any, **kwargs: Any) -> Any:
        try:
            return take(*args, **kwargs)
        finally:
            _since[:] = [time.process_time(), time.perf_counter()]

    def released(*args: Any, **kwargs: Any) -> Any:
        if _since:
            held["cpu"] = held.get("cpu", 0.0) + time.process_time() - _since[0]
            held["wall"] = held.get("wall", 0.0) + time.perf_counter() - _since[1]
            held["batches"] = held.get("batches", 0.0) + 1
            _since.clear()
        return release(*args, **kwargs)

    setattr(runner_locks.RunnerLocks, "_take", taken)  # noqa: B010
    setattr(runner_locks.RunnerLocks, "_release", released)  # noqa: B010


PHASES = (
    (SchedulerApplication, "schedule_many", "schedule_many (its own)"),
    (batch.PlacementBatch, "run_deferring", "the batch (its own)"),
    (batch.PlacementBatch, "_sandboxes", "load the sandboxes"),
    (batch.PlacementBatch, "_runners", "load the runners and leases"),
    (batch.PlacementBatch, "_decide_one", "decide (the domain)"),
    (batch.PlacementBatch, "_commit", "commit (its own: the library's save, Recordings)"),
    (batch.PlacementBatch, "_refuse_used_tokens", "reused tokens"),
    (fast_forward, "_select_events_after", "select the events after (fast-forward)"),
    (encoding.EventMapper, "to_stored_event", "encode the events"),
    (application_store.StoredApplication, "_snapshots_due", "take the snapshots"),
    (chained_postgres.ChainedPostgresRecorder, "_appended", "the append (dump, execute)"),
    (runner_locks.RunnerLocks, "_take", "take the runner locks"),
    (runner_locks.RunnerLocks, "_release", "release the runner locks"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--placements", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--runners", type=int, default=200)
    parser.add_argument("--gc-threshold", type=int, default=None)
    args = parser.parse_args()
    if args.gc_threshold is not None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(args.gc_threshold, older, oldest)
    _mark_held()
    for owner, name, label in PHASES:
        _wrap(owner, name, label)
    with bench_database(None, f"phases_{int(time.time())}", keep=False) as fresh:
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": fresh.url})
        requirements = bench_requirements("profile")
        at = datetime.now(UTC)
        snapshots = register_fleet(app, roomy_fleet("profile", args.runners, instances=1000), at)
        rng = random.Random(7)
        homes = [(f"sbx-{n}", rng.choice(list(snapshots.values()))) for n in range(args.placements)]
        create_homed_sandboxes(app, homes, requirements, at)
        ids = [sandbox_id for sandbox_id, _ in homes]
        for runner_id in snapshots:  # a long-running replica has its runners cached
            app.repository.get(runner_uuid(runner_id))
            app.repository.get(lease_uuid(runner_id))
        spent.clear()
        held.clear()
        built = 0.0
        start = time.process_time()
        for first in range(0, len(ids), args.batch):
            before = time.process_time()
            now = datetime.now(UTC)
            requests = [
                schedule_request(s, requirements, now, seed=7, serialization_retry_limit=10)
                for s in ids[first : first + args.batch]
            ]
            built += time.process_time() - before
            app.schedule_many(requests)
        total = time.process_time() - start
        app.close()
    count = len(ids)
    print(
        f"process CPU {1000 * total / count:.3f} ms per placement "
        f"(building the requests {1e6 * built / count:.0f} us of it)"
    )
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {1e6 * seconds / count:7.1f} us  {label}")
    if held.get("batches"):
        print(
            f"locks held: {1e6 * held['cpu'] / count:.1f} us CPU per placement, "
            f"{1e3 * held['wall'] / held['batches']:.2f} ms wall per batch "
            f"({held['batches']:.0f} batches)"
        )


if __name__ == "__main__":
    main()
