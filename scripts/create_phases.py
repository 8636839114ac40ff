"""Process CPU of each phase of the new-sandbox path (``create_sandbox`` then
``schedule``), per new sandbox.

    .venv/bin/python scripts/create_phases.py [--sandboxes 2000] [--batch 10]
        [--runners 1000] [--replicas 4]

A new database of the local PostgreSQL server, a roomy pool of ``--runners`` (as the
bench's new-sandbox run registers it: ``infrastructure/tools/bench/throughput.py``),
then in each of ``--replicas`` processes (the first one measured, the others started
with it over their own sandbox ids and stopped when it ends) one thread that, batch
after batch of ``--batch`` new sandbox ids, creates them as one creation batch
(``CreateBatch``, as the creation batcher's leader runs it) and then schedules them with
``schedule_many`` (one placement batch): the bench's closed loop of 10 callers per
worker without the threads' wake-ups. Each phase's functions are wrapped to add up their
own ``time.thread_time`` (a phase's figure excludes the wrapped phases it calls); the
total is ``time.process_time`` of the measured process (every thread). Also: the CPU of
the database's PostgreSQL backends (all replicas', per sandbox created by all), the
catch-ups of the runner snapshots view and the pages they lost to another replica, and
how many distinct home runners the measured process's creations chose.

Run it from another checkout's virtual environment to measure that checkout's code
(``cd <checkout> && .venv/bin/python <this checkout>/scripts/create_phases.py``): a
phase that does not exist there is skipped.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

spent: defaultdict[str, float] = defaultdict(float)
database_spent: defaultdict[str, float] = defaultdict(
    float
)  # --database-phases: the measured backends' CPU
calls: Counter[str] = Counter()
_local = threading.local()  # the wrapped phases under way in this thread
_backends: list[int] = []  # --database-phases: the measured process's backends
MEASURED = "create_phases_measured"  # their application_name


def _backends_cpu() -> float:
    """CPU seconds of the measured process's PostgreSQL backends (``schedstat``: ns)."""
    total = 0
    for pid in _backends:
        try:
            with open(f"/proc/{pid}/schedstat", "rb") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _wrap(owner: Any, name: str, label: str) -> None:
    function: Callable[..., Any] | None = getattr(owner, name, None)
    if function is None:
        print(f"  (no {owner.__name__}.{name} here)")
        return

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        inner: list[float] = _local.__dict__.setdefault("inner", [])
        inner_db: list[float] = _local.__dict__.setdefault("inner_db", [])
        db_start = _backends_cpu() if _backends else 0.0
        start = time.thread_time()
        inner.append(0.0)
        inner_db.append(0.0)
        try:
            return function(*args, **kwargs)
        finally:
            elapsed = time.thread_time() - start
            spent[label] += elapsed - inner.pop()
            calls[label] += 1
            if inner:
                inner[-1] += elapsed
            db_elapsed = _backends_cpu() - db_start if _backends else 0.0
            database_spent[label] += db_elapsed - inner_db.pop()
            if inner_db:
                inner_db[-1] += db_elapsed

    setattr(owner, name, timed)


def _wrap_iterator(owner: Any, name: str, label: str) -> None:
    """``_wrap`` for a generator function: each step of the iteration is timed."""
    function: Callable[..., Any] | None = getattr(owner, name, None)
    if function is None:
        print(f"  (no {name} here)")
        return

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        inner: list[float] = _local.__dict__.setdefault("inner", [])
        iterator = function(*args, **kwargs)
        calls[label] += 1
        while True:
            start = time.thread_time()
            inner.append(0.0)
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                elapsed = time.thread_time() - start
                spent[label] += elapsed - inner.pop()
                if inner:
                    inner[-1] += elapsed
            yield item

    setattr(owner, name, timed)


def _phases() -> list[tuple[Any, str, str]]:
    from secondbox_scheduler.infrastructure import queries
    from secondbox_scheduler.infrastructure.creating import batch as create_batch
    from secondbox_scheduler.infrastructure.placing import batch, runner_locks
    from secondbox_scheduler.infrastructure.store import (
        application_store,
        chained_postgres,
        encoding,
    )
    from secondbox_scheduler.projections import candidates, read_models, sql_view

    gate: list[tuple[Any, str, str]] = []
    try:  # a checkout without the catch-up gate measures without it
        from secondbox_scheduler.projections import catch_up_gate

        gate = [(catch_up_gate.CatchUpGate, "_take", "catch-up: the gate (take, wait)")]
        gate.append((catch_up_gate.CatchUpGate, "_release", "catch-up: the gate (release)"))
    except ImportError:
        pass
    return [
        *gate,
        (create_batch.CreateBatch, "run", "create: the batch (its own: load the sandboxes)"),
        (create_batch.CreateBatch, "_create", "create: decide (its own: Sandbox.create)"),
        (create_batch.CreateBatch, "_save", "create: save (its own)"),
        (read_models.ReadModels, "_catch_up", "catch-up (its own: positions, head)"),
        (sql_view.SqlView, "apply", "catch-up: apply (write rows and position)"),
        (queries.SchedulerQueries, "home_candidates", "create: home_candidates (its own)"),
        (queries, "unmatched_candidates", "create: the unmatched index"),
        (queries, "home_candidates", "create: candidate paging (its own: decide)"),
        (candidates, "first_candidates", "create: candidate query (first page)"),
        (candidates, "candidate_page", "create: candidate query (later pages)"),
        (queries, "checked_home_decision", "create: home check (its own: decide)"),
        (queries.SchedulerQueries, "fold_runner", "create: home check, fold the runner"),
        (queries.SchedulerQueries, "fold_runner_snapshots", "create: fold the whole pool"),
        (batch.PlacementBatch, "run_deferring", "schedule: the batch (its own)"),
        (batch.PlacementBatch, "_sandboxes", "schedule: load the sandboxes"),
        (batch.PlacementBatch, "_runners", "schedule: load the runners and leases"),
        (batch.PlacementBatch, "_decide_one", "schedule: decide (the domain)"),
        (batch.PlacementBatch, "_commit", "schedule: commit (its own)"),
        (encoding.EventMapper, "to_stored_event", "encode the events"),
        (application_store.StoredApplication, "_snapshots_due", "take the snapshots"),
        (chained_postgres.ChainedPostgresRecorder, "_appended", "the append (dump, execute)"),
        (runner_locks.RunnerLocks, "_take", "schedule: take the runner locks"),
        (runner_locks.RunnerLocks, "_release", "schedule: release the runner locks"),
    ]


def _loop(
    url: str, pool_name: str, prefix: str, count: int, size: int, stop: Any, ready: Any
) -> tuple[int, Counter[str], int, int]:
    """Create then schedule ``count`` sandboxes in batches of ``size`` (until ``stop``
    is set, when given): (sandboxes placed, their homes, catch-ups, pages lost)."""
    from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
    from secondbox_scheduler.infrastructure.application import SchedulerApplication
    from secondbox_scheduler.infrastructure.creating.batch import CreateBatch, CreateRequest
    from secondbox_scheduler.infrastructure.tools.bench.fleet import (
        HEARTBEAT_TIMEOUT,
        PROFILE,
        bench_requirements,
        schedule_request,
    )
    from secondbox_scheduler.projections import read_models

    lost = [0]
    catch_ups = [0]
    catch_up = read_models.ReadModels._catch_up

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        catch_ups[0] += 1
        try:
            return catch_up(self, *args, **kwargs)
        except Exception:
            lost[0] += 1
            raise

    read_models.ReadModels._catch_up = counted  # type: ignore[method-assign]
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url, "CREATE_TABLE": "n"})
    requirements = bench_requirements(pool_name)
    for snapshot in app.runner_snapshots(pool_name):  # a replica has its runners cached
        app.repository.get(runner_uuid(snapshot.id))
        app.repository.get(lease_uuid(snapshot.id))
    homes: Counter[str] = Counter()
    placed = 0
    for first in range(-2 * size, count, size):  # two batches to warm up, then the run
        if first == 0:
            ready.wait()
            homes.clear()
            placed = catch_ups[0] = lost[0] = 0
        if stop is not None and stop.is_set():
            break
        ids = [f"{prefix}-{n:07d}" for n in range(first, min(count, first + size))]
        creations = [
            CreateRequest.checked(s, f"ws-{s}", PROFILE, requirements, HEARTBEAT_TIMEOUT, None)
            for s in ids
        ]
        for home in CreateBatch(app).run(creations):
            homes[str(home)] += 1
        now = datetime.now(UTC)
        requests = [
            schedule_request(s, requirements, now, seed=7, serialization_retry_limit=10)
            for s in ids
        ]
        for outcome in app.schedule_many(requests):
            if isinstance(outcome, tuple):
                placed += 1
    if stop is None:
        ready.end()
    app.close()
    return placed, homes, catch_ups[0], lost[0]


def _replica(url: str, pool_name: str, index: int, size: int, stop: Any, ready: Any) -> None:
    _loop(url, pool_name, f"r{index}", 10**7, size, stop, ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--runners", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--database-phases",
        action="store_true",
        help="also add up the CPU of the measured process's PostgreSQL backends per phase "
        "(their /proc schedstat around each wrapped call: more overhead in the process)",
    )
    args = parser.parse_args()

    from secondbox_scheduler.infrastructure.application import SchedulerApplication
    from secondbox_scheduler.infrastructure.settings import settings_from_url
    from secondbox_scheduler.infrastructure.tools.bench.database import bench_database
    from secondbox_scheduler.infrastructure.tools.bench.fleet import register_fleet, roomy_fleet
    from secondbox_scheduler.infrastructure.tools.bench.process_cpu import database_backends

    pool_name = "newsbx"
    with bench_database(None, f"create_phases_{int(time.time())}", keep=False) as fresh:
        setup = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": fresh.url})
        register_fleet(
            setup, roomy_fleet(pool_name, args.runners, instances=100_000), datetime.now(UTC)
        )
        setup.runner_snapshots(pool_name)  # the read models caught up, untimed
        dbname = settings_from_url(fresh.url)["POSTGRES_DBNAME"]
        context = multiprocessing.get_context("spawn")
        stop, ready = context.Event(), context.Barrier(args.replicas)
        others = [
            context.Process(
                target=_replica, args=(fresh.url, pool_name, index, args.batch, stop, ready)
            )
            for index in range(1, args.replicas)
        ]
        for process in others:
            process.start()
        os.environ["PGAPPNAME"] = MEASURED  # the measured process's connections, by name
        for owner, name, label in _phases():
            _wrap(owner, name, label)
        from secondbox_scheduler.projections import event_decoder, read_models

        _wrap_iterator(read_models, "read_pages", "catch-up: read the notifications")
        _wrap(event_decoder.EventDecoder, "__call__", "catch-up: decode the events")
        state: dict[str, Any] = {}

        class Measured:
            def wait(self) -> None:
                ready.wait()
                if args.database_phases:
                    _backends[:] = _measured_backends(setup)
                spent.clear()
                database_spent.clear()
                calls.clear()
                state["database"] = database_backends(dbname)
                state["created"] = _created(setup, pool_name)
                state["cpu"] = time.process_time()
                state["wall"] = time.perf_counter()

            def end(self) -> None:
                state["cpu"] = time.process_time() - state["cpu"]
                state["wall"] = time.perf_counter() - state["wall"]
                after = database_backends(dbname)
                before = state["database"]
                state["database"] = sum(after[p] - before.get(p, 0.0) for p in after)
                state["created"] = _created(setup, pool_name) - state["created"]
                stop.set()

        placed, homes, catch_ups, lost = _loop(
            fresh.url, pool_name, "r0", args.sandboxes, args.batch, None, Measured()
        )
        for process in others:
            process.join()
        total, wall, database = state["cpu"], state["wall"], state["database"]
        created_by_all = state["created"]
        placed_runners = len(homes)
        table = _table_stats(setup)
        setup.close()
    print(
        f"measured process: {placed} new sandboxes placed in {wall:.1f} s, process CPU "
        f"{1000 * total / placed:.3f} ms per new sandbox; {catch_ups} catch-ups "
        f"({lost} lost to another replica); homes on {placed_runners} runners"
    )
    print(
        f"PostgreSQL backends (all {args.replicas} replicas): "
        f"{1000 * database / max(1, created_by_all):.3f} ms per new sandbox "
        f"({created_by_all} created by all)"
    )
    print(f"runner_snapshots at the end: {table}")
    if args.database_phases:
        print(
            f"the measured process's {len(_backends)} backends: "
            f"{1e3 * sum(database_spent.values()) / placed:.3f} ms per new sandbox in its phases"
        )
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        db = (
            f"  database {1e6 * database_spent[label] / placed:6.1f} us"
            if args.database_phases
            else ""
        )
        print(f"  {1e6 * seconds / placed:7.1f} us{db}  {label}  ({calls[label]} calls)")


def _measured_backends(app: Any) -> list[int]:
    """The backends of the measured process's connections (by their application_name)."""
    with app.recorder.datastore.transaction(commit=False) as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (MEASURED,))
        return [int(row["pid"]) for row in cursor.fetchall()]


def _table_stats(app: Any) -> str:
    """The runner snapshots table's size and updates (HOT or not) at the end."""
    with app.recorder.datastore.transaction(commit=False) as cursor:
        cursor.execute(
            "SELECT pg_relation_size(relid) / 8192 AS pages, n_tup_upd, n_tup_hot_upd, "
            "n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relname = 'runner_snapshots'"
        )
        row = cursor.fetchone()
    return ", ".join(f"{key} {value}" for key, value in row.items())


def _created(app: Any, pool_name: str) -> int:
    """New sandboxes recorded, by every replica (the Sandbox.Created events)."""
    from psycopg.sql import SQL, Identifier

    with app.recorder.datastore.transaction(commit=False) as cursor:
        table = Identifier(app.recorder.datastore.schema, app.recorder.events_table_name)
        cursor.execute(
            SQL("SELECT COUNT(*) AS n FROM {} WHERE topic LIKE %s").format(table),
            ("%Sandbox.Created",),
        )
        return int(cursor.fetchone()["n"])


if __name__ == "__main__":
    main()
