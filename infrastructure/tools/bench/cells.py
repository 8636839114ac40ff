"""``bench --cells N``: batched placements through cell routers over 1 and N cells.

Each cell is a fresh database on the local PostgreSQL server with its own pool of
roomy runners and sandboxes homed on them (their id claims saved in their directory
cells, as ``create_sandbox`` through a router makes them). W worker processes each run
a :class:`CellRouter` over every cell (its id cache warm for its sandboxes, as a
long-running replica's is) and schedule from concurrent callers, spread over every
cell's pool. Besides placements/s the run measures the CPU spent per placement by the
scheduler processes (the workers' own CPU time) and by PostgreSQL (every ``postgres``
process of the server, the exited backends through the postmaster's children time),
which is what projects the rate of N cells on N machines: a cell's rate is bounded by
the CPU of its own database server and of its own scheduler replicas. On one machine
the cells share its cores, so N cells cannot place N times one cell's rate there.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.synchronize import Barrier
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from secondbox_scheduler.domain.cell_claims import KIND_SANDBOX, CellClaim
from secondbox_scheduler.domain.errors import SchedulerError, SerializationContentionError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.config import Cell, CellsConfig
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.settings import DATABASE_URL, settings_from_url
from secondbox_scheduler.infrastructure.tools.bench.database import bench_database, settle
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    bench_requirements,
    chunks,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    schedule_request,
)
from secondbox_scheduler.infrastructure.tools.bench.process_cpu import machine_cpu_seconds
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.workers import (
    BARRIER_TIMEOUT,
    WorkerPool,
    WorkerResult,
    summarize,
)

CALLERS = 10  # concurrent callers per worker: the batched runs' default
SERIALIZATION_RETRY_LIMIT = 8


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) of process ``pid`` so far; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backend_cpu(url: str, dbnames: list[str]) -> dict[int, float]:
    """The PostgreSQL backends serving ``dbnames`` (by pid) and their CPU seconds so
    far: the server's work for these cells alone (the server is shared with others; its
    WAL writer and checkpointer are not counted)."""
    settings = settings_from_url(url)
    conninfo = make_conninfo(
        host=settings["POSTGRES_HOST"], port=settings["POSTGRES_PORT"],
        user=settings["POSTGRES_USER"], password=settings["POSTGRES_PASSWORD"] or None,
        dbname=settings["POSTGRES_DBNAME"],
    )  # fmt: skip
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
            (dbnames,),
        ).fetchall()
    found = {int(row[0]): process_cpu_seconds(int(row[0])) for row in rows}
    return {pid: cpu for pid, cpu in found.items() if cpu is not None}


@dataclass(frozen=True)
class CellsScheduleJob:
    """One worker: a router over every cell, scheduling its sandboxes (sandbox id, cell)
    from ``threads`` callers for ``seconds``."""

    cells: tuple[tuple[str, str, str], ...]  # (name, database URL, pool)
    sandboxes: tuple[tuple[str, str, str], ...]  # (sandbox id, cell, pool)
    seconds: float
    seed: int
    threads: int

    def run(self, index: int, barrier: Barrier) -> WorkerResult:
        config = CellsConfig(
            tuple(Cell(name, url, frozenset({pool})) for name, url, pool in self.cells)
        )
        router = CellRouter(config)
        try:
            return self._run(index, barrier, router)
        finally:
            router.close()

    def _run(self, index: int, barrier: Barrier, router: CellRouter) -> WorkerResult:
        prepared = time.perf_counter()
        for name in router.names:
            router.application(name)
        for sandbox_id, cell, _ in self.sandboxes:
            router.remember(KIND_SANDBOX, sandbox_id, cell)
        requirements = {pool: bench_requirements(pool) for _, _, pool in self.cells}
        apps = list(router.applications().values())
        batches_before = [dict(app.metrics.batch_sizes) for app in apps]
        prepare_seconds = time.perf_counter() - prepared
        outcomes: Counter[str] = Counter()
        latencies: list[float] = []
        lock = threading.Lock()
        remaining = deque(self.sandboxes)
        url = self.cells[0][1]
        dbnames = [settings_from_url(u)["POSTGRES_DBNAME"] for _, u, _ in self.cells]
        barrier.wait(BARRIER_TIMEOUT)
        backends_before = backend_cpu(url, dbnames) if index == 0 else {}
        cpu_before = machine_cpu_seconds()
        process_before = time.process_time()
        started = time.perf_counter()
        deadline = started + self.seconds
        last = [started]

        def caller() -> None:
            while True:
                with lock:
                    if not remaining or time.perf_counter() >= deadline:
                        return
                    sandbox_id, _, pool = remaining.popleft()
                request = schedule_request(
                    sandbox_id, requirements[pool], datetime.now(UTC), seed=self.seed,
                    serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
                )  # fmt: skip
                sent = time.perf_counter()
                try:
                    _, created = router.schedule(request)
                    outcome = "placed" if created else "replayed"
                except SerializationContentionError:
                    outcome = "contention_error"
                except SchedulerError as error:
                    outcome = type(error).__name__
                finished = time.perf_counter()
                with lock:
                    outcomes[outcome] += 1
                    if outcome == "placed":
                        latencies.append((finished - sent) * 1000.0)
                    last[0] = max(last[0], finished)

        threads = [threading.Thread(target=caller) for _ in range(max(1, self.threads))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        process_cpu = time.process_time() - process_before
        postgres_cpu = 0.0
        if index == 0:
            backends_after = backend_cpu(url, dbnames)
            postgres_cpu = sum(
                cpu - backends_before.get(pid, 0.0) for pid, cpu in backends_after.items()
            )
        batches: Counter[int] = Counter()
        for app, before in zip(apps, batches_before, strict=True):
            batches.update(app.metrics.batch_sizes)
            batches.subtract(before)
        after = machine_cpu_seconds()
        return WorkerResult(
            worker=index,
            started=started,
            finished=last[0],
            calls=sum(outcomes.values()),
            latencies_ms=latencies,
            outcomes={
                **dict(outcomes),
                "_process_cpu_ms": round(process_cpu * 1000),
                "_postgres_cpu_ms": round(postgres_cpu * 1000),
            },
            prepare_seconds=prepare_seconds,
            machine_cpu=(
                (after[0] - cpu_before[0], after[1] - cpu_before[1]) if index == 0 else (0.0, 0.0)
            ),
            batch_sizes={size: count for size, count in batches.items() if count},
        )


def _prepare_cell(
    app: SchedulerApplication, directory: dict[str, SchedulerApplication], pool: str,
    settings: BenchSettings, count: int, router: CellRouter, cell: str,
) -> list[str]:  # fmt: skip
    """A roomy pool and ``count`` sandboxes homed on it, their claims in their directory
    cells; the sandbox ids."""
    at = datetime.now(UTC)
    fleet = roomy_fleet(pool, settings.runners, instances=100_000)
    snapshots = register_fleet(app, fleet, at)
    runner_ids = [spec.runner_id for spec in fleet]
    ids = [f"{pool}-{index:07d}" for index in range(count)]
    create_homed_sandboxes(
        app,
        [
            (sandbox_id, snapshots[runner_ids[n % len(runner_ids)]])
            for n, sandbox_id in enumerate(ids)
        ],
        bench_requirements(pool),
        at,
    )
    by_directory: dict[str, list[CellClaim]] = {}
    for sandbox_id in ids:
        claim = CellClaim.claim(kind=KIND_SANDBOX, subject_id=sandbox_id, cell=cell, at=at)
        by_directory.setdefault(router.directory_of(KIND_SANDBOX, sandbox_id), []).append(claim)
    for name, claims in by_directory.items():
        for part in chunks(claims, 500):
            directory[name].save(*part)
    return ids


@contextmanager
def _databases(count: int, stamp: str, keep: bool) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(bench_database(None, f"{stamp}_c{n}", keep=keep)).url
            for n in range(count)
        ]


def measure_cells(
    settings: BenchSettings, cells: int, stamp: str, progress: Progress, *, keep: bool = False
) -> dict[str, Any]:
    """Placements/s and CPU per placement for 1 and ``cells`` cells."""
    runs: dict[str, Any] = {}
    counts = sorted({1, cells})
    for count in counts:
        progress(f"cells: {count} cell(s), {settings.workers} workers x {CALLERS} callers")
        with _databases(count, f"{stamp}_{count}", keep) as urls:
            runs[str(count)] = _run(settings, urls, progress)
    one = runs["1"]["per_second"]
    for count in counts:
        run = runs[str(count)]
        run["scaling_vs_one_cell"] = round(run["per_second"] / one, 2) if one else None
    return {
        "runs": runs,
        "cpu_cores": os.cpu_count(),
        "note": (
            "the cells share this machine's cores: N cells here cannot place N times one "
            "cell's rate; the CPU per placement (scheduler and PostgreSQL) projects N cells "
            "on N machines"
        ),
    }


def _run(settings: BenchSettings, urls: list[str], progress: Progress) -> dict[str, Any]:
    names = [f"c{n}" for n in range(len(urls))]
    pools = [f"pool-{name}" for name in names]
    config = CellsConfig(
        tuple(Cell(n, u, frozenset({p})) for n, u, p in zip(names, urls, pools, strict=True))
    )
    per_cell = math.ceil(2500 * settings.placement_seconds * 1.5 / len(urls)) + 200
    sandboxes: list[tuple[str, str, str]] = []
    with CellRouter(config) as router:
        apps = {name: router.application(name) for name in names}
        for name, pool in zip(names, pools, strict=True):
            progress(f"cells: {name}: {settings.runners:,} runners, {per_cell:,} sandboxes")
            ids = _prepare_cell(apps[name], apps, pool, settings, per_cell, router, name)
            sandboxes.extend((sandbox_id, name, pool) for sandbox_id in ids)
    # interleave the cells, then deal the sandboxes out to the workers
    sandboxes.sort(key=lambda s: (s[0].rsplit("-", 1)[1], s[1]))
    cells = tuple(zip(names, urls, pools, strict=True))
    jobs = [
        CellsScheduleJob(
            cells=cells,
            sandboxes=tuple(sandboxes[index :: settings.workers]),
            seconds=settings.placement_seconds,
            seed=settings.seed,
            threads=CALLERS,
        )
        for index in range(settings.workers)
    ]
    for url in urls:
        settle({DATABASE_URL: url})
    with WorkerPool(settings.workers) as workers:
        results = workers.run(jobs)
    scheduler_cpu = sum(r.outcomes.pop("_process_cpu_ms", 0) for r in results) / 1000.0
    postgres_cpu = sum(r.outcomes.pop("_postgres_cpu_ms", 0) for r in results) / 1000.0
    summary = summarize(results)
    placed = summary["placed"] or 1
    summary["cells"] = len(urls)
    summary["scheduler_cpu_ms_per_placement"] = round(scheduler_cpu * 1000 / placed, 3)
    summary["postgres_cpu_ms_per_placement"] = round(postgres_cpu * 1000 / placed, 3)
    cpu_ms = summary["scheduler_cpu_ms_per_placement"] + summary["postgres_cpu_ms_per_placement"]
    summary["placements_per_core_second"] = round(1000 / cpu_ms, 1) if cpu_ms else None
    return summary
