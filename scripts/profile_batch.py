"""CPU cost of the batched placement path in one process, for before/after comparisons.

    .venv/bin/python scripts/profile_batch.py [--batch 32] [--placements 3200] [--profile]
        [--threads N] [--runners 200] [--extra N] [--sort tottime] [--top 25] [--cpu-timer]

Registers 200 roomy runners (``--runners``), loads them into the aggregate cache as a
long-running replica has them, and creates the sandboxes (untimed; ``--extra`` more that
are never placed, to measure with a larger table) in a new database of the local
PostgreSQL server, then places them with ``schedule_many`` in batches, or from
``--threads`` concurrent callers of ``schedule`` (the batcher groups them), building
each request as it is sent. Prints placements/s (wall), the process's CPU ms per
placement (``time.process_time``: this process only, so less sensitive to other load on
the machine than the wall figures), the machine's CPU ms per placement (``/proc/stat``:
with the database server's), and with ``--profile`` the functions that cost the
most (cProfile, cumulative). Run it with ``PYTHONPATH=<another checkout>`` to measure
that checkout's code with the same script.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import threading
import time
from collections import deque
from datetime import UTC, datetime

from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.domain.values import Requirements
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.bench.database import bench_database
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    schedule_request,
)
from secondbox_scheduler.infrastructure.tools.bench.process_cpu import machine_cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--placements", type=int, default=3200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="cumulative", help="cProfile order: cumulative, tottime")
    parser.add_argument("--top", type=int, default=25, help="functions printed with --profile")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="N concurrent callers of schedule (the batcher groups them) instead of schedule_many",
    )
    parser.add_argument(
        "--cpu-timer",
        action="store_true",
        help="cProfile on process CPU time (time.process_time) instead of wall time",
    )
    parser.add_argument("--runners", type=int, default=200)
    parser.add_argument(
        "--extra", type=int, default=0, help="more sandboxes created (untimed) and not placed"
    )
    args = parser.parse_args()
    stamp = f"profile_{int(time.time())}"
    with bench_database(None, stamp, keep=False) as fresh:
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": fresh.url})
        requirements = bench_requirements("profile")
        at = datetime.now(UTC)
        snapshots = register_fleet(app, roomy_fleet("profile", args.runners, instances=1000), at)
        rng = random.Random(7)
        homes = [
            (f"sbx-{n}", rng.choice(list(snapshots.values())))
            for n in range(args.placements + args.extra)
        ]
        create_homed_sandboxes(app, homes, requirements, at)
        homes = homes[: args.placements]
        ids = [sandbox_id for sandbox_id, _ in homes]
        for runner_id in snapshots:  # a long-running replica has its runners cached
            app.repository.get(runner_uuid(runner_id))
            app.repository.get(lease_uuid(runner_id))
        timer = time.process_time if args.cpu_timer else time.perf_counter
        profiler = cProfile.Profile(timer) if args.profile else None
        wall, cpu, machine = time.perf_counter(), time.process_time(), machine_cpu_seconds()[0]
        if profiler:
            profiler.enable()
        placed = 0
        if args.threads:
            placed = _threaded(app, ids, requirements, args.threads)
        for start in range(0, len(ids) if not args.threads else 0, args.batch):
            now = datetime.now(UTC)
            requests = [
                schedule_request(s, requirements, now, seed=7, serialization_retry_limit=10)
                for s in ids[start : start + args.batch]
            ]
            placed += sum(
                1 for outcome in app.schedule_many(requests) if isinstance(outcome, tuple)
            )
        if profiler:
            profiler.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        machine = machine_cpu_seconds()[0] - machine
        app.close()
    print(json.dumps({
        "batch": args.batch, "threads": args.threads, "runners": args.runners, "placed": placed,
        "placements_per_second": round(placed / wall, 1),
        "process_cpu_ms_per_placement": round(1000 * cpu / placed, 3),
        "machine_cpu_ms_per_placement": round(1000 * machine / placed, 3),
    }))  # fmt: skip
    if profiler:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.top)


def _threaded(
    app: SchedulerApplication, ids: list[str], requirements: Requirements, threads: int
) -> int:
    """Place ``ids`` from ``threads`` concurrent callers of ``app.schedule``."""
    remaining = deque(ids)
    lock = threading.Lock()
    placed = [0]

    def caller() -> None:
        while True:
            with lock:
                if not remaining:
                    return
                sandbox_id = remaining.popleft()
            request = schedule_request(
                sandbox_id, requirements, datetime.now(UTC), seed=7, serialization_retry_limit=10
            )
            _, created = app.schedule(request)
            with lock:
                placed[0] += created

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return placed[0]


if __name__ == "__main__":
    main()
