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
4. **selection**: ``domain.placement.select_runner`` and end-to-end
   ``SchedulerApplication.create_sandbox`` over pools of 100, 1,000 and 10,000 runners;
5. **history**: loading a runner after 10, 1,000 and 100,000 of its events
   (:func:`infrastructure.history_benchmark.measure_history`);
6. **replay**: projection rebuild and ``audit verify`` events per second beside the
   raw rate of reading the same notifications with the recorder alone.

(Replay runs before history, so the log it replays holds the scheduler's own events
and not the history benchmark's synthetic reservation pairs.)

Setup (runners, heartbeats, sandboxes, requests, warm caches) is never timed. Every
random choice comes from ``--seed``. ``--quick`` uses smaller sizes and shorter runs.
Figures are printed as tables (or JSON) with each goal as met or not met.
"""

from __future__ import annotations

import math
import os
import platform
import random
import sqlite3
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from secondbox_scheduler.domain.placement import select_runner
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.bench_fleet import (
    HEARTBEAT_TIMEOUT,
    PROFILE,
    FleetRunner,
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    runner_snapshots,
    varied_fleet,
)
from secondbox_scheduler.infrastructure.bench_workers import (
    BenchError,
    RawBaseline,
    RawJob,
    ScheduleJob,
    WorkerPool,
    raw_env,
    summarize,
)
from secondbox_scheduler.infrastructure.settings import DATABASE_URL, settings_from_url

SECTIONS = ("raw", "placement", "contention", "selection", "history", "replay")
HOT_RUNNERS = 4
HOT_FILL = 0.95  # hot runners hold room for this share of the contention sandboxes
SERIALIZATION_RETRY_LIMIT = 8
DEFAULT_RATE = 1000.0  # schedules/s assumed when no raw baseline was measured
LOCAL_SERVER = {"host": "127.0.0.1", "port": "5432", "user": "postgres", "password": ""}

GOAL_PLACEMENT = 0.5
GOAL_CONTENTION = 0.3
GOAL_SELECTION = 3.0
GOAL_HISTORY = 2.0
GOAL_REPLAY = 0.5


@dataclass(frozen=True)
class BenchSettings:
    """Sizes and durations of one run (``full`` or ``quick``)."""

    workers: int = 4
    runners: int = 1000
    quick: bool = False
    seed: int = 7
    raw_seconds: float = 10.0
    placement_seconds: float = 15.0
    contention_sandboxes: int = 3000  # a fixed amount of work, comparable across runs
    selection_sizes: tuple[int, ...] = (100, 1_000, 10_000)
    select_calls: tuple[int, ...] = (50, 20, 5)
    create_calls: tuple[int, ...] = (20, 10, 5)
    history_sizes: tuple[int, ...] = (10, 1_000, 100_000)
    history_repeat: int = 15
    sections: tuple[str, ...] = SECTIONS

    @classmethod
    def make(
        cls,
        *,
        quick: bool = False,
        workers: int = 4,
        runners: int | None = None,
        seed: int = 7,
        seconds: float | None = None,
        sections: tuple[str, ...] = SECTIONS,
    ) -> BenchSettings:
        if quick:
            base = cls(
                workers=workers,
                runners=runners or 200,
                quick=True,
                seed=seed,
                raw_seconds=1.5,
                placement_seconds=2.0,
                contention_sandboxes=400,
                selection_sizes=(30, 300, 3_000),
                select_calls=(20, 10, 5),
                create_calls=(5, 5, 3),
                history_sizes=(10, 1_000, 10_000),
                history_repeat=7,
                sections=sections,
            )
        else:
            base = cls(workers=workers, runners=runners or 1000, seed=seed, sections=sections)
        if seconds is not None:
            base = cls(
                **{
                    **asdict(base),
                    "raw_seconds": seconds,
                    "placement_seconds": seconds,
                }
            )
        return base

    def to_dict(self) -> dict[str, Any]:
        return {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(self).items()}


# -- the fresh database --------------------------------------------------------


@dataclass
class FreshDatabase:
    """Where the run writes: ``url`` for the applications, ``shown`` for people."""

    url: str
    shown: str
    backend: str
    drop: Callable[[], None] = field(repr=False)


def _server_settings() -> dict[str, str]:
    """The local server: POSTGRES_HOST/PORT/USER/PASSWORD if set, else 127.0.0.1:5432."""
    keys = {"host": "POSTGRES_HOST", "port": "POSTGRES_PORT", "user": "POSTGRES_USER"}
    found = {name: os.environ.get(var) or LOCAL_SERVER[name] for name, var in keys.items()}
    found["password"] = os.environ.get("POSTGRES_PASSWORD", "")
    return found


def _conninfo(server: dict[str, str], dbname: str) -> str:
    return make_conninfo(
        dbname=dbname,
        host=server["host"],
        port=server["port"],
        user=server["user"],
        password=server["password"] or None,
        connect_timeout=10,
    )


def _url(server: dict[str, str], dbname: str, schema: str | None = None) -> str:
    password = f":{server['password']}" if server["password"] else ""
    url = f"postgresql://{server['user']}{password}@{server['host']}:{server['port']}/{dbname}"
    return url + (f"?schema={schema}" if schema else "")


@contextmanager
def fresh_database(database_url: str | None, stamp: str, *, keep: bool) -> Iterator[FreshDatabase]:
    """A database nobody else writes to, removed at the end unless ``keep``.

    - no URL: a new database ``bench_<stamp>`` on the local PostgreSQL server;
    - a ``postgresql://`` URL: a new schema ``bench_<stamp>`` in that database;
    - a ``sqlite:///`` URL: a file that must not exist yet (and its ``-raw`` sibling).
    """
    name = f"bench_{stamp}"
    if database_url is None:
        server = _server_settings()
        admin = _conninfo(server, "postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

        def drop_database() -> None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )

        url = _url(server, name)
        fresh = FreshDatabase(
            url, _url({**server, "password": ""}, name), "postgresql", drop_database
        )
    else:
        settings = settings_from_url(database_url)
        if settings["PERSISTENCE_MODULE"] == "eventsourcing.sqlite":
            fresh = _fresh_sqlite(database_url, settings["SQLITE_DBNAME"])
        else:
            server = {
                "host": settings["POSTGRES_HOST"],
                "port": settings["POSTGRES_PORT"],
                "user": settings["POSTGRES_USER"],
                "password": settings["POSTGRES_PASSWORD"],
            }
            dbname = settings["POSTGRES_DBNAME"]
            conninfo = _conninfo(server, dbname)
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))

            def drop_schema() -> None:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(
                        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                    )

            fresh = FreshDatabase(
                _url(server, dbname, name),
                _url({**server, "password": ""}, dbname, name),
                "postgresql",
                drop_schema,
            )
    try:
        yield fresh
    finally:
        if not keep:
            fresh.drop()


def _fresh_sqlite(database_url: str, dbname: str) -> FreshDatabase:
    if dbname.startswith("file:") or dbname == ":memory:":
        raise BenchError("bench needs a SQLite file that worker processes can open, not memory")
    path = Path(dbname)
    raw = Path(raw_env({DATABASE_URL: database_url})["SQLITE_DBNAME"])
    for candidate in (path, raw):
        if candidate.exists():
            raise BenchError(f"{candidate} exists: bench writes a fresh database, give a new path")
    path.parent.mkdir(parents=True, exist_ok=True)

    def remove() -> None:
        for base in (path, raw):
            for suffix in ("", "-wal", "-shm", "-journal"):
                with suppress(FileNotFoundError):
                    Path(str(base) + suffix).unlink()

    return FreshDatabase(database_url, database_url, "sqlite", remove)


def machine_info(fresh: FreshDatabase) -> dict[str, Any]:
    """nproc, memory, CPU model, versions: what the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    database = f"SQLite {sqlite3.sqlite_version}"
    if fresh.backend == "postgresql":
        settings = settings_from_url(fresh.url)
        server = {
            "host": settings["POSTGRES_HOST"],
            "port": settings["POSTGRES_PORT"],
            "user": settings["POSTGRES_USER"],
            "password": settings["POSTGRES_PASSWORD"],
        }
        with psycopg.connect(_conninfo(server, settings["POSTGRES_DBNAME"])) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        database = f"PostgreSQL {row[0] if row else '?'}"
    return {
        "nproc": os.cpu_count(),
        "memory_gib": memory_gib,
        "cpu": cpu,
        "python": platform.python_version(),
        "eventsourcing": metadata.version("eventsourcing"),
        "database": database,
    }


# -- measurements -------------------------------------------------------------

Progress = Callable[[str], None]


def _now() -> datetime:
    return datetime.now(UTC)


def measure_raw(pool: WorkerPool, env: dict[str, str], settings: BenchSettings) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, per_transaction in (("one_aggregate", 1), ("two_aggregates", 2)):
        jobs: list[RawJob | ScheduleJob] = [
            RawJob(env, per_transaction, settings.raw_seconds) for _ in range(pool.workers)
        ]
        summary = summarize(pool.run(jobs), count="saved")
        summary["aggregates_per_transaction"] = per_transaction
        summary["transactions_per_second"] = summary.pop("per_second")
        found[key] = summary
    return found


def _spread(ids: list[str], workers: int) -> list[list[str]]:
    return [ids[index::workers] for index in range(workers)]


def measure_placement(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    expected_rate: float,
    progress: Progress,
) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    pool_name = "place"
    at = _now()
    count = math.ceil(expected_rate * settings.placement_seconds * 1.5) + 50 * settings.workers
    progress(f"placement: registering {settings.runners:,} runners, creating {count:,} sandboxes")
    fleet = roomy_fleet(pool_name, settings.runners, instances=100_000)
    snapshots = register_fleet(app, fleet, at)
    runner_ids = [spec.runner_id for spec in fleet]
    homes = {f"place-{index:07d}": rng.choice(runner_ids) for index in range(count)}
    create_homed_sandboxes(
        app,
        [(sandbox_id, snapshots[home]) for sandbox_id, home in homes.items()],
        bench_requirements(pool_name),
        at,
    )
    progress(f"placement: {settings.workers} workers for {settings.placement_seconds:g}s")
    jobs: list[RawJob | ScheduleJob] = [
        ScheduleJob(
            env=env,
            pool_name=pool_name,
            sandbox_ids=tuple(ids),
            warm_runner_ids=tuple(sorted({homes[i] for i in ids})),
            seconds=settings.placement_seconds,
            seed=settings.seed,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
        )
        for ids in _spread(list(homes), settings.workers)
    ]
    summary = summarize(pool.run(jobs))
    summary["runners"] = settings.runners
    summary["sandboxes_prepared"] = count
    return summary


def measure_contention(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    progress: Progress,
) -> dict[str, Any]:
    rng = random.Random(settings.seed + 1)
    pool_name = "hot"
    at = _now()
    count = settings.contention_sandboxes
    room = math.ceil(count * HOT_FILL / HOT_RUNNERS)
    progress(f"contention: {count:,} sandboxes on {HOT_RUNNERS} runners with room for {room:,}")
    fleet = roomy_fleet(pool_name, HOT_RUNNERS, instances=room)
    snapshots = register_fleet(app, fleet, at)
    runner_ids = [spec.runner_id for spec in fleet]
    sandbox_ids = [f"hot-{index:07d}" for index in range(count)]
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
    jobs: list[RawJob | ScheduleJob] = [
        ScheduleJob(
            env=env,
            pool_name=pool_name,
            sandbox_ids=tuple(ids),
            warm_runner_ids=tuple(runner_ids),
            seconds=None,
            seed=settings.seed,
            serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
        )
        for ids in _spread(sandbox_ids, settings.workers)
    ]
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


def _median_ms(operation: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        operation()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


def _selection_row(
    app: SchedulerApplication,
    pool_name: str,
    fleet: list[FleetRunner],
    select_calls: int,
    create_calls: int,
) -> dict[str, Any]:
    """Time select_runner over the pool in memory, then create_sandbox over it in the
    store (registration, read model catch-up and one warm-up call untimed)."""
    requirements = bench_requirements(pool_name)
    at = _now()
    snapshots = runner_snapshots(fleet, at)
    select_ms = _median_ms(
        lambda: select_runner(requirements, snapshots, _now(), HEARTBEAT_TIMEOUT), select_calls
    )
    register_fleet(app, fleet, at)
    app.runner_snapshots(pool_name)  # the read models catch up
    serial = iter(range(create_calls + 1))

    def create() -> str:
        sandbox_id = f"{pool_name}-sandbox-{next(serial)}"
        return app.create_sandbox(
            sandbox_id=sandbox_id,
            workspace_id=f"ws-{sandbox_id}",
            profile_revision_id=PROFILE,
            requirements=requirements,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )

    create()  # warm-up
    create_ms = _median_ms(create, create_calls)
    return {
        "runners": len(fleet),
        "select_runner_ms": round(select_ms, 3),
        "select_runner_calls": select_calls,
        "create_sandbox_ms": round(create_ms, 3),
        "create_sandbox_calls": create_calls,
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
        rows.append(_selection_row(app, pool_name, fleet, select_calls, create_calls))
    for row, previous in zip(rows[1:], rows, strict=False):
        row["select_runner_ratio"] = round(
            row["select_runner_ms"] / previous["select_runner_ms"], 2
        )
        row["create_sandbox_ratio"] = round(
            row["create_sandbox_ms"] / previous["create_sandbox_ms"], 2
        )
    return {"rows": rows}


def measure_replay(app: SchedulerApplication, progress: Progress) -> dict[str, Any]:
    from secondbox_scheduler.infrastructure.audit_replay import verify
    from secondbox_scheduler.projections.read_models import rebuild

    if app.read_models is None:
        raise BenchError("replay needs read models (SQLite or PostgreSQL)")
    progress("replay: projection rebuild")
    rebuilt = rebuild(app.read_models).to_dict()
    progress("replay: audit verify")
    audit = verify(app)
    audited = audit.to_dict()
    violations = audited.pop("violations")
    audited["violations"] = len(violations)
    if "ratio_to_raw_read" not in audited:
        audited["ratio_to_raw_read"] = (
            round(audit.events_per_second / audit.raw_events_per_second, 3)
            if audit.raw_events_per_second
            else None
        )
    return {"rebuild": rebuilt, "audit_verify": audited}


def measure_history_section(
    env: dict[str, str], settings: BenchSettings, progress: Progress
) -> dict[str, Any]:
    from secondbox_scheduler.infrastructure.history_benchmark import measure_history

    rows = measure_history(env, settings.history_sizes, settings.history_repeat, progress)
    return {"rows": [row.to_dict() for row in rows]}


# -- goals --------------------------------------------------------------------


def _goal(target: str, value: float | None, met: bool | None, detail: str) -> dict[str, Any]:
    return {"target": target, "value": value, "met": met, "detail": detail}


def _skipped(target: str) -> dict[str, Any]:
    return _goal(target, None, None, "not measured in this run")


def evaluate_goals(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    goals: dict[str, dict[str, Any]] = {}
    raw, placement = report.get("raw_baseline"), report.get("placement")
    target = f">= {GOAL_PLACEMENT} x two-aggregate raw baseline"
    if raw and placement:
        baseline = raw["two_aggregates"]["transactions_per_second"]
        ratio = placement["per_second"] / baseline if baseline else 0.0
        goals["placement_throughput"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_PLACEMENT,
            f"{placement['per_second']:,.0f} schedules/s vs {baseline:,.0f} two-aggregate "
            "transactions/s",
        )
    else:
        goals["placement_throughput"] = _skipped(target)

    contention = report.get("contention")
    target = f">= {GOAL_CONTENTION} x uncontended throughput, no oversubscription"
    if contention and placement:
        ratio = (
            contention["goodput_per_second"] / placement["per_second"]
            if placement["per_second"]
            else 0.0
        )
        state = contention["hot_runner_state"]
        clean = state["oversubscribed_runners"] == 0 and state["reservations_match_placements"]
        goals["contention_goodput"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_CONTENTION and clean,
            f"{contention['goodput_per_second']:,.0f} placements/s vs "
            f"{placement['per_second']:,.0f}; {state['oversubscribed_runners']} hot runners "
            f"oversubscribed; {contention['contention_errors']} contention errors",
        )
    else:
        goals["contention_goodput"] = _skipped(target)

    selection = report.get("selection")
    target = f"create_sandbox at 10x the runners <= {GOAL_SELECTION} x the cost"
    if selection and len(selection["rows"]) >= 2:
        small, large = selection["rows"][-2], selection["rows"][-1]
        ratio = large["create_sandbox_ms"] / small["create_sandbox_ms"]
        goals["selection_scaling"] = _goal(
            target,
            round(ratio, 2),
            ratio <= GOAL_SELECTION,
            f"{large['runners']:,} runners {large['create_sandbox_ms']:.1f} ms vs "
            f"{small['runners']:,} runners {small['create_sandbox_ms']:.1f} ms",
        )
    else:
        goals["selection_scaling"] = _skipped(target)

    history = report.get("history")
    target = f"largest history load <= {GOAL_HISTORY} x smallest (cold and warm)"
    if history and history["rows"]:
        first, last = history["rows"][0], history["rows"][-1]
        worst = max(last["cold_ratio"], last["warm_ratio"])
        goals["history_growth"] = _goal(
            target,
            round(worst, 2),
            worst <= GOAL_HISTORY,
            f"{last['events']:,} events: cold {last['cold_ms']:.2f} ms "
            f"({last['cold_ratio']:.2f}x), warm {last['warm_ms']:.3f} ms "
            f"({last['warm_ratio']:.2f}x) vs {first['events']:,} events",
        )
    else:
        goals["history_growth"] = _skipped(target)

    replay = report.get("replay")
    for key, name, label in (
        ("audit_replay", "audit_verify", "audit verify"),
        ("projection_rebuild", "rebuild", "projection rebuild"),
    ):
        target = f">= {GOAL_REPLAY} x raw notification read rate"
        if replay:
            figures = replay[name]
            ratio = figures["ratio_to_raw_read"] or 0.0
            goals[key] = _goal(
                target,
                round(ratio, 3),
                ratio >= GOAL_REPLAY,
                f"{label} {figures['events_per_second']:,.0f} events/s vs raw read "
                f"{figures['raw_read_events_per_second']:,.0f} events/s",
            )
        else:
            goals[key] = _skipped(target)
    return goals


# -- the run ------------------------------------------------------------------


def store_env(url: str) -> dict[str, str]:
    env = {DATABASE_URL: url}
    if "POSTGRES_CONNECT_TIMEOUT" not in os.environ:
        env["POSTGRES_CONNECT_TIMEOUT"] = "10"
    return env


def run_bench(
    settings: BenchSettings,
    database_url: str | None = None,
    *,
    keep: bool = False,
    progress: Progress = lambda _: None,
) -> dict[str, Any]:
    """Run every section of ``settings`` on a fresh database; the report as a dict."""
    unknown = set(settings.sections) - set(SECTIONS)
    if unknown:
        raise BenchError(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    started = time.perf_counter()
    stamp = f"{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
    wanted = set(settings.sections)
    report: dict[str, Any] = {"settings": settings.to_dict()}
    with fresh_database(database_url, stamp, keep=keep) as fresh:
        report["database"] = fresh.shown
        report["kept"] = keep
        report["machine"] = machine_info(fresh)
        env = store_env(fresh.url)
        progress(f"fresh database {fresh.shown}")
        app = SchedulerApplication(env=env)  # creates the tables before any worker starts
        RawBaseline(env=raw_env(env)).close()
        try:
            needs_workers = bool(wanted & {"raw", "placement", "contention"})
            with WorkerPool(settings.workers if needs_workers else 1) as pool:
                rate = DEFAULT_RATE
                if "raw" in wanted:
                    progress(
                        f"raw baseline: {settings.workers} workers, 2 x {settings.raw_seconds:g}s"
                    )
                    report["raw_baseline"] = measure_raw(pool, env, settings)
                    rate = report["raw_baseline"]["two_aggregates"]["transactions_per_second"]
                if "placement" in wanted:
                    report["placement"] = measure_placement(
                        pool, app, env, settings, rate, progress
                    )
                if "contention" in wanted:
                    report["contention"] = measure_contention(pool, app, env, settings, progress)
            if "selection" in wanted:
                report["selection"] = measure_selection(app, settings, progress)
            if "replay" in wanted:
                report["replay"] = measure_replay(app, progress)
                report["replay"]["events_in_log"] = app.event_count()
        finally:
            app.close()
        if "history" in wanted:
            report["history"] = measure_history_section(env, settings, progress)
    report["goals"] = evaluate_goals(report)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    return report
