"""Process CPU per batch of placements on one hot runner as its reservations grow.

    .venv/bin/python scripts/hot_runner_cost.py [--placements 4500] [--runners 1]

Registers ``--runners`` roomy runners (cached, as a long-running replica has them),
homes ``--placements`` sandboxes on them round robin, then places them with
``schedule_many`` in batches of 10, one thread, on a new database of the local
PostgreSQL server, and prints the mean process CPU of a batch in each sixth of the run
(the runner holding about a sixth more reservations each time) and the whole run's CPU
per placement. A cost that grows with a runner's reservations shows as rising sixths.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.bench.database import bench_database
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    schedule_request,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--placements", type=int, default=4500)
    parser.add_argument("--runners", type=int, default=1)
    args = parser.parse_args()
    with bench_database(None, f"hot_{int(time.time())}", keep=False) as fresh:
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": fresh.url})
        requirements = bench_requirements("profile")
        at = datetime.now(UTC)
        fleet = roomy_fleet("profile", args.runners, instances=args.placements + 10)
        registered = register_fleet(app, fleet, at)
        snapshots = list(registered.values())
        homes = [(f"sbx-{n}", snapshots[n % args.runners]) for n in range(args.placements)]
        create_homed_sandboxes(app, homes, requirements, at)
        for runner_id in registered:  # a long-running replica has its runners cached
            app.repository.get(runner_uuid(runner_id))
            app.repository.get(lease_uuid(runner_id))
        ids = [sandbox_id for sandbox_id, _ in homes]
        batches: list[float] = []
        start = time.process_time()
        for first in range(0, len(ids), 10):
            now = datetime.now(UTC)
            requests = [
                schedule_request(s, requirements, now, seed=7, serialization_retry_limit=10)
                for s in ids[first : first + 10]
            ]
            before = time.process_time()
            app.schedule_many(requests)
            batches.append(time.process_time() - before)
        total = time.process_time() - start
        app.close()
    step = max(1, len(batches) // 6)
    sixths = [
        1000 * sum(batches[i : i + step]) / len(batches[i : i + step])
        for i in range(0, len(batches), step)
    ]
    print("ms of process CPU per batch of 10, by sixth:", " ".join(f"{ms:.2f}" for ms in sixths))
    print(f"process CPU {1000 * total / len(ids):.3f} ms per placement")


if __name__ == "__main__":
    main()
