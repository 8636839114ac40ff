"""``secondbox-scheduler bench``: the scheduler's throughput, scaling and replay figures.

One run creates a fresh database (by default a new database on the local PostgreSQL
server, dropped at the end), then measures, in this order:

1. **raw baseline**: a tiny eventsourcing application of its own on the same database
   saving new aggregates with one event each, one per transaction and two per
   transaction (what a placement writes: the Sandbox and the Runner), from W worker
   processes for a fixed time;
2. **placement**: W worker processes scheduling sandboxes homed over R runners with
   spare capacity, for a fixed time: schedules per second, latency percentiles,
   retries per schedule, and the ratio to the two-aggregate raw baseline;
3. **contention**: W workers scheduling a fixed number of sandboxes (3,000) all homed
   on 4 hot runners whose capacity runs out just before the sandboxes do (room for 95%):
   goodput, retries, contention errors, ratio to (2), and reserved <= allocatable on
   the hot runners at the end;
4. **http**: the placement run again, over HTTP: W ``serve`` processes, one client
   worker each (:mod:`.over_http`): schedules per second and client-side latency
   percentiles beside the in-process figures;
5. **selection**: ``domain.placement.select_runner`` and end-to-end
   ``SchedulerApplication.create_sandbox`` over pools of 100, 1,000 and 10,000 runners;
6. **history**: loading a runner after 10, 1,000 and 100,000 of its events
   (:func:`history.measure_history`);
7. **replay**: projection rebuild and ``audit verify`` events per second beside the
   raw rate of reading the same notifications with the recorder alone.

(Replay runs before history, so the log it replays holds the scheduler's own events
and not the history benchmark's synthetic reservation pairs.)

Setup (runners, heartbeats, sandboxes, requests, warm caches) is never timed. Every
random choice comes from ``--seed``. ``--quick`` uses smaller sizes and shorter runs.
Figures are printed as tables (or JSON) with each goal as met or not met.

Modules, by job: ``settings`` (sections, sizes), ``database`` (the fresh database,
machine info), ``fleet`` (setup), ``workers`` (worker processes, raw baseline),
``timing`` (median, percentile), ``throughput`` (1-3), ``over_http`` (4), ``selection``
(5), ``history`` (6), ``replay`` (7), ``goals``, ``report`` (the tables) and ``run``
(:func:`run_bench`).
"""

from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.goals import evaluate_goals
from secondbox_scheduler.infrastructure.tools.bench.history import HistoryRow, measure_history
from secondbox_scheduler.infrastructure.tools.bench.report import print_report
from secondbox_scheduler.infrastructure.tools.bench.run import run_bench
from secondbox_scheduler.infrastructure.tools.bench.settings import SECTIONS, BenchSettings

__all__ = [
    "SECTIONS",
    "BenchError",
    "BenchSettings",
    "HistoryRow",
    "evaluate_goals",
    "measure_history",
    "print_report",
    "run_bench",
]
