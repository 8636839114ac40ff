"""Process CPU of a batched placement's decision and of its events' encoding, alone.

    .venv/bin/python scripts/decide_cost.py [--placements 200] [--rounds 15]

Sets up as ``scripts/batch_phases.py`` does (roomy runners cached, homed sandboxes, a
new database of the local PostgreSQL server) and places ``--placements`` sandboxes with
``schedule_many`` in batches of 10, keeping what each decision read (the request, copies
of its sandbox, home runner and lease, the clock). Then, with the garbage collector
paused and no database in the way, it decides those placements again from fresh copies
(``decide_placement`` and the events collected from the aggregates: the fence, the
reservation, the token's use) and encodes their events (the application's mapper), and
prints the best of ``--rounds`` per placement. Less noisy than a phase of
``batch_phases.py`` on a shared machine (no round trips, no collector's pauses). Run it
from another checkout's virtual environment to measure that checkout's code (``cd
<checkout> && .venv/bin/python <this checkout>/scripts/decide_cost.py``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import time
from datetime import UTC, datetime
from typing import Any

from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.domain.placement.deciding import Placed, decide_placement
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.placing import batch
from secondbox_scheduler.infrastructure.tools.bench.database import bench_database
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    schedule_request,
)


def _lookup(home: Any) -> Any:
    return lambda _runner_id: home


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--placements", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    captured: list[tuple[Any, ...]] = []
    decide_one = batch.PlacementBatch._decide_one

    def capturing(self: Any, decision: Any, sandbox: Any, runners: Any, clock: Any) -> Any:
        if sandbox is not None:
            home = copy.deepcopy(runners[sandbox.home_runner_id])
            captured.append((decision.request, copy.deepcopy(sandbox), home, clock))
        return decide_one(self, decision, sandbox, runners, clock)

    batch.PlacementBatch._decide_one = capturing  # type: ignore[method-assign]
    with bench_database(None, f"decide_{int(time.time())}", keep=False) as fresh:
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": fresh.url})
        requirements = bench_requirements("profile")
        at = datetime.now(UTC)
        snapshots = register_fleet(app, roomy_fleet("profile", 200, instances=1000), at)
        rng = random.Random(7)
        homes = [(f"sbx-{n}", rng.choice(list(snapshots.values()))) for n in range(args.placements)]
        create_homed_sandboxes(app, homes, requirements, at)
        ids = [sandbox_id for sandbox_id, _ in homes]
        for runner_id in snapshots:
            app.repository.get(runner_uuid(runner_id))
            app.repository.get(lease_uuid(runner_id))
        for first in range(0, len(ids), 10):
            now = datetime.now(UTC)
            app.schedule_many(
                [
                    schedule_request(s, requirements, now, seed=7, serialization_retry_limit=10)
                    for s in ids[first : first + 10]
                ]
            )
        mapper = app.mapper
        app.close()
    batch.PlacementBatch._decide_one = decide_one  # type: ignore[method-assign]
    deciding, encoding = [], []
    for _ in range(args.rounds):
        work = [(r, copy.deepcopy(s), copy.deepcopy(h), c) for r, s, h, c in captured]
        gc.collect()
        gc.disable()
        start = time.process_time()
        placed = []
        for request, sandbox, home, clock in work:
            decided = decide_placement(request, sandbox, _lookup(home), attempt=0, clock=clock)
            assert isinstance(decided, Placed)
            placed.append([e for a in decided.aggregates for e in a.collect_events()])
        decided_in = time.process_time() - start
        start = time.process_time()
        for events in placed:
            for event in events:
                mapper.to_stored_event(event)
        encoded_in = time.process_time() - start
        gc.enable()
        deciding.append(decided_in)
        encoding.append(encoded_in)
    count = len(captured)
    print(
        f"decide {1e6 * min(deciding) / count:.1f} us, encode {1e6 * min(encoding) / count:.1f}"
        f" us per placement (best of {args.rounds}, {count} placements, collector paused)"
    )


if __name__ == "__main__":
    main()
