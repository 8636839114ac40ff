"""Worker processes of ``secondbox-scheduler bench``.

A :class:`WorkerPool` starts W processes (``multiprocessing``, spawn) once and hands
each of them one job per measurement. A worker opens its own application on the
database URL of the job, prepares everything untimed (requests built, runners loaded
into its aggregate cache), waits at a barrier with the other workers, then runs the
timed loop and times every call with ``time.perf_counter``. The parent aggregates.
``perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process, so the
parent can take the span from the earliest start to the latest finish.

The raw baseline is a tiny eventsourcing application of its own
(:class:`RawBaseline`): new aggregates with one event each, saved one or two per
transaction, on the same database (PostgreSQL: its own events table in the same
database and schema; SQLite, which has one events table per file: a sibling file).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import random
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, Protocol
from uuid import UUID

from eventsourcing.application import Application
from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.errors import (
    HomeRunnerUnavailableError,
    SchedulerError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.infrastructure.gc_tuning import tune_gc
from secondbox_scheduler.infrastructure.settings import DATABASE_URL, settings_from_url
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError, BenchWorkerError
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    REQUESTED,
    bench_requirements,
    schedule_request,
)
from secondbox_scheduler.infrastructure.tools.bench.process_cpu import (
    database_backends,
    database_name,
    machine_cpu_seconds,
    used_since,
)
from secondbox_scheduler.infrastructure.tools.bench.timing import percentile

PAYLOAD = "x" * 256  # the raw event's payload: a small event, as a placement's are a few KB
WARM_UP_SAVES = 3
BARRIER_TIMEOUT = 900.0  # seconds a worker waits for the others to finish preparing
LATE_MS = 5.0  # open loop: a call sent this long after its arrival found every caller busy


class RawRecord(Aggregate):
    """One new aggregate with one event: what the raw baseline saves."""

    class Created(Aggregate.Created):
        worker: int
        sequence: int
        payload: str

    def __init__(self, worker: int, sequence: int, payload: str) -> None:
        self.worker = worker
        self.sequence = sequence
        self.payload = payload


class RawBaseline(Application[UUID]):
    """The eventsourcing application of the raw baseline (no cache, no snapshots)."""


def raw_env(scheduler_env: dict[str, str]) -> dict[str, str]:
    """Settings of the raw baseline on the scheduler's database."""
    env = {k: v for k, v in scheduler_env.items() if k != DATABASE_URL}
    env.update(settings_from_url(scheduler_env[DATABASE_URL]))
    if env["PERSISTENCE_MODULE"] == "eventsourcing.sqlite":
        path = Path(env["SQLITE_DBNAME"])
        env["SQLITE_DBNAME"] = str(path.with_name(path.stem + "-raw" + path.suffix))
    return env


# -- jobs and results ---------------------------------------------------------


@dataclass(frozen=True)
class RawJob:
    """Save new RawRecords, ``per_transaction`` per save, for ``seconds``."""

    env: dict[str, str]
    per_transaction: int
    seconds: float


@dataclass(frozen=True)
class ScheduleJob:
    """Schedule each sandbox in turn (until ``seconds`` have passed, if given), from
    ``threads`` concurrent callers of one application (its batcher groups them)."""

    env: dict[str, str]
    pool_name: str
    sandbox_ids: tuple[str, ...]
    warm_runner_ids: tuple[str, ...]
    seconds: float | None
    seed: int
    serialization_retry_limit: int
    threads: int = 1
    # open loop: requests arrive at this rate (a Poisson process, seeded) whether or not
    # earlier ones were answered, and each is timed from its arrival, not from when a
    # caller thread got to it (so a backlog shows in the latency); None: closed loop
    offered_per_second: float | None = None
    # the new-sandbox path: each call creates its sandbox (create_sandbox chooses the
    # home over the pool), then schedules it; timed from the creation
    create_first: bool = False


@dataclass(frozen=True)
class RowLockJob:
    """The row-lock peer: place each sandbox with one SERIALIZABLE transaction that locks
    its home runner's row (:mod:`.row_lock_peer`), until ``seconds`` have passed."""

    conninfo: str
    schema: str
    placements: tuple[tuple[str, str], ...]  # (sandbox id, home runner id)
    seconds: float


class ExternalJob(Protocol):
    """A job that runs itself (``bench/over_http.py``): set up untimed, wait at the
    barrier, run the timed loop, return the worker's result."""

    def run(self, index: int, barrier: Barrier) -> WorkerResult: ...


Job = RawJob | ScheduleJob | RowLockJob | ExternalJob


@dataclass
class WorkerResult:
    worker: int
    started: float
    finished: float
    calls: int
    latencies_ms: list[float]  # of the successful calls (saves, placements)
    outcomes: dict[str, int] = field(default_factory=dict)
    contention_retries: int = 0
    contention_errors: int = 0
    prepare_seconds: float = 0.0
    machine_cpu: tuple[float, float] = (0.0, 0.0)  # busy and total CPU seconds, run window
    batch_sizes: dict[int, int] = field(default_factory=dict)  # placement batches by size
    late_starts: int = 0  # open loop: calls sent more than LATE_MS after their arrival
    deferred: int = 0  # placements a batch handed back (their runner held by a rival)
    acknowledged: tuple[str, ...] = ()  # sandboxes whose placement a caller was answered
    serve_cpu_seconds: float | None = None  # over HTTP, worker 0: the serve processes'
    # over HTTP and in process (schedule runs), worker 0: the database's PostgreSQL backends'
    database_cpu_seconds: float | None = None
    # schedule runs in process: this worker process's own CPU (all its threads) in its run
    own_cpu_seconds: float | None = None
    # over HTTP: what the worker's replica's /metrics counted over the run (batches...)
    serve_figures: dict[str, float] = field(default_factory=dict)
    # over HTTP, worker 0: the serve processes' threads (main's CPU, context switches)
    serve_tasks: dict[str, float] | None = None
    client_cpu_seconds: float | None = None  # over HTTP: this client process's own CPU


def _cpu_window(index: int, before: tuple[float, float]) -> tuple[float, float]:
    """Worker 0 measures the machine's CPU over its run window (the others run alongside)."""
    if index != 0:
        return 0.0, 0.0
    after = machine_cpu_seconds()
    return after[0] - before[0], after[1] - before[1]


class _WorkerState:
    """Applications a worker keeps open across jobs (and so their caches)."""

    def __init__(self) -> None:
        self.apps: dict[tuple[str, tuple[tuple[str, str], ...]], Application[UUID]] = {}

    def app(self, kind: type[Application[UUID]], env: dict[str, str]) -> Application[UUID]:
        """The worker's application of ``kind`` on ``env``; the parent made the tables
        (concurrent CREATE statements of several processes can fail on PostgreSQL)."""
        key = (kind.__name__, tuple(sorted(env.items())))
        if key not in self.apps:
            self.apps[key] = kind(env={**env, "CREATE_TABLE": "n"})
        return self.apps[key]

    def close(self) -> None:
        for app in self.apps.values():
            app.close()


def _run_raw(index: int, job: RawJob, state: _WorkerState, barrier: Barrier) -> WorkerResult:
    prepared = time.perf_counter()
    app = state.app(RawBaseline, raw_env(job.env))
    sequence = 0

    def batch() -> list[RawRecord]:
        nonlocal sequence
        records = [
            RawRecord(worker=index, sequence=sequence + n, payload=PAYLOAD)
            for n in range(job.per_transaction)
        ]
        sequence += job.per_transaction
        return records

    for _ in range(WARM_UP_SAVES):
        app.save(*batch())
    prepare_seconds = time.perf_counter() - prepared
    latencies: list[float] = []
    barrier.wait(BARRIER_TIMEOUT)
    cpu_before = machine_cpu_seconds()
    started = finished = time.perf_counter()
    deadline = started + job.seconds
    while finished < deadline:
        records = batch()
        before = time.perf_counter()
        app.save(*records)
        finished = time.perf_counter()
        latencies.append((finished - before) * 1000.0)
    return WorkerResult(
        worker=index,
        started=started,
        finished=finished,
        calls=len(latencies),
        latencies_ms=latencies,
        outcomes={"saved": len(latencies)},
        prepare_seconds=prepare_seconds,
        machine_cpu=_cpu_window(index, cpu_before),
    )


def _run_schedule(
    index: int, job: ScheduleJob, state: _WorkerState, barrier: Barrier
) -> WorkerResult:
    from secondbox_scheduler.infrastructure.application import SchedulerApplication

    prepared = time.perf_counter()
    app = state.app(SchedulerApplication, job.env)
    assert isinstance(app, SchedulerApplication)
    requirements = bench_requirements(job.pool_name)
    for runner_id in job.warm_runner_ids:  # a long-running replica has its runners cached
        app.repository.get(runner_uuid(runner_id))
        app.repository.get(lease_uuid(runner_id))
    retries_before = app.metrics.contention_retries
    errors_before = app.metrics.contention_errors
    deferred_before = app.metrics.placements_deferred
    batches_before = dict(app.metrics.batch_sizes)
    prepare_seconds = time.perf_counter() - prepared
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    acknowledged: list[str] = []
    lock = threading.Lock()
    remaining = deque(job.sandbox_ids)
    # open loop: every request's arrival, seconds after the start
    arrivals = (
        deque(_arrivals(job.offered_per_second, len(job.sandbox_ids), job.seed + index))
        if job.offered_per_second
        else None
    )
    late = [0]
    database = database_name(job.env) if index == 0 else None
    barrier.wait(BARRIER_TIMEOUT)
    cpu_before = machine_cpu_seconds()
    database_before = database_backends(database) if database else {}
    own_before = time.process_time()
    started = time.perf_counter()
    deadline = math.inf if job.seconds is None else started + job.seconds
    last = [started]

    def next_call() -> tuple[str, float] | None:
        """The next sandbox and when its request arrives (now, in a closed loop)."""
        with lock:
            if not remaining:
                return None
            due = time.perf_counter() if arrivals is None else started + arrivals.popleft()
            if due >= deadline:
                return None
            return remaining.popleft(), due

    def caller() -> None:
        while (call := next_call()) is not None:
            sandbox_id, due = call
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            elif arrivals is not None and -wait * 1000.0 > LATE_MS:
                with lock:
                    late[0] += 1
            # built when sent, as a client does: its times are checked against the clock
            request = schedule_request(
                sandbox_id, requirements, datetime.now(UTC), seed=job.seed,
                serialization_retry_limit=job.serialization_retry_limit,
            )  # fmt: skip
            if arrivals is None:  # closed loop: timed from the send
                due = time.perf_counter()
            try:
                if job.create_first:
                    app.create_sandbox(
                        sandbox_id=sandbox_id, workspace_id=request.workspace_id,
                        profile_revision_id=request.profile_revision_id,
                        requirements=requirements, heartbeat_timeout=request.heartbeat_timeout,
                    )  # fmt: skip
                _, created = app.schedule(request)
                outcome = "placed" if created else "replayed"
            except SerializationContentionError:
                outcome = "contention_error"
            except HomeRunnerUnavailableError:
                outcome = "refused"
            except SchedulerError as error:
                outcome = type(error).__name__
            finished = time.perf_counter()
            with lock:
                outcomes[outcome] += 1
                if outcome in ("placed", "replayed"):
                    acknowledged.append(sandbox_id)
                if outcome == "placed":
                    latencies.append((finished - due) * 1000.0)
                last[0] = max(last[0], finished)

    threads = [threading.Thread(target=caller) for _ in range(max(1, job.threads))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    own_cpu = time.process_time() - own_before
    database_cpu = used_since(database_before, database_backends(database)) if database else None
    batches = Counter(app.metrics.batch_sizes)
    batches.subtract(batches_before)
    return WorkerResult(
        worker=index,
        started=started,
        finished=last[0],
        calls=sum(outcomes.values()),
        latencies_ms=latencies,
        outcomes=dict(outcomes),
        contention_retries=app.metrics.contention_retries - retries_before,
        contention_errors=app.metrics.contention_errors - errors_before,
        prepare_seconds=prepare_seconds,
        machine_cpu=_cpu_window(index, cpu_before),
        batch_sizes={size: count for size, count in batches.items() if count},
        late_starts=late[0],
        deferred=app.metrics.placements_deferred - deferred_before,
        acknowledged=tuple(acknowledged),
        database_cpu_seconds=database_cpu,
        own_cpu_seconds=own_cpu,
    )


def _arrivals(per_second: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times (seconds from the start) of a Poisson process of rate
    ``per_second``: exponential gaps, seeded, so runs are repeatable."""
    rng = random.Random(seed)
    at, times = 0.0, []
    for _ in range(count):
        at += rng.expovariate(per_second)
        times.append(at)
    return times


def _run_row_lock(
    index: int, job: RowLockJob, state: _WorkerState, barrier: Barrier
) -> WorkerResult:
    from secondbox_scheduler.infrastructure.tools.bench.row_lock_peer import RowLockPeer

    prepared = time.perf_counter()
    peer = RowLockPeer(job.conninfo, job.schema, REQUESTED)
    try:
        prepare_seconds = time.perf_counter() - prepared
        outcomes: Counter[str] = Counter()
        latencies: list[float] = []
        barrier.wait(BARRIER_TIMEOUT)
        cpu_before = machine_cpu_seconds()
        started = finished = time.perf_counter()
        deadline = started + job.seconds
        for sandbox_id, runner_id in job.placements:
            before = time.perf_counter()
            outcome = peer.place(sandbox_id, runner_id)
            finished = time.perf_counter()
            outcomes[outcome] += 1
            if outcome == "placed":
                latencies.append((finished - before) * 1000.0)
            if finished >= deadline:
                break
        return WorkerResult(
            worker=index,
            started=started,
            finished=finished,
            calls=sum(outcomes.values()),
            latencies_ms=latencies,
            outcomes=dict(outcomes),
            contention_retries=peer.retries,
            prepare_seconds=prepare_seconds,
            machine_cpu=_cpu_window(index, cpu_before),
        )
    finally:
        peer.close()


def worker_main(
    index: int,
    inbox: multiprocessing.Queue[Job | None],
    results: multiprocessing.Queue[tuple[int, WorkerResult | str]],
    barrier: Barrier,
) -> None:
    """Entry point of one worker process: run jobs until ``None`` arrives (its garbage
    collector tuned as the scheduler's processes are, for every kind of job)."""
    tune_gc()
    state = _WorkerState()
    try:
        while (job := inbox.get()) is not None:
            try:
                if isinstance(job, RawJob):
                    result: WorkerResult | str = _run_raw(index, job, state, barrier)
                elif isinstance(job, RowLockJob):
                    result = _run_row_lock(index, job, state, barrier)
                elif isinstance(job, ScheduleJob):
                    result = _run_schedule(index, job, state, barrier)
                else:
                    result = job.run(index, barrier)
            except Exception as error:
                barrier.abort()
                result = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            results.put((index, result))
    finally:
        state.close()


class WorkerPool:
    """W spawned worker processes, each running one job per :meth:`run`."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise BenchError("at least one worker is needed")
        context = multiprocessing.get_context("spawn")
        self.workers = workers
        self._barrier = context.Barrier(workers)
        self._results: multiprocessing.Queue[tuple[int, WorkerResult | str]] = context.Queue()
        self._inboxes: list[multiprocessing.Queue[Job | None]] = [
            context.Queue() for _ in range(workers)
        ]
        self._processes: list[BaseProcess] = [
            context.Process(
                target=worker_main,
                args=(index, self._inboxes[index], self._results, self._barrier),
                name=f"bench-worker-{index}",
                daemon=True,
            )
            for index in range(workers)
        ]
        for process in self._processes:
            process.start()

    def run(self, jobs: Sequence[Job], timeout: float = 3600.0) -> list[WorkerResult]:
        """Give job i to worker i; wait for every result (in worker order)."""
        if len(jobs) != self.workers:
            raise BenchError(f"{len(jobs)} jobs for {self.workers} workers")
        if self._barrier.broken:
            self._barrier.reset()
        for inbox, job in zip(self._inboxes, jobs, strict=True):
            inbox.put(job)
        found: dict[int, WorkerResult] = {}
        failures: list[str] = []
        give_up = time.monotonic() + timeout
        while len(found) + len(failures) < self.workers:
            try:
                index, result = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self._processes if not p.is_alive()]
                if dead:
                    raise BenchWorkerError(f"worker process(es) died: {', '.join(dead)}") from None
                if time.monotonic() > give_up:
                    raise BenchWorkerError(
                        f"workers did not finish within {timeout:.0f}s"
                    ) from None
                continue
            if isinstance(result, str):
                failures.append(f"worker {index}: {result}")
            else:
                found[index] = result
        if failures:
            raise BenchWorkerError("a worker failed:\n" + "\n".join(failures))
        return [found[index] for index in range(self.workers)]

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for process in self._processes:
            process.join(timeout=30)
        for process in self._processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summarize(results: list[WorkerResult], *, count: str = "placed") -> dict[str, Any]:
    """Throughput and latency of one run over every worker."""
    started = min(r.started for r in results)
    finished = max(r.finished for r in results)
    seconds = finished - started
    outcomes: Counter[str] = Counter()
    for r in results:
        outcomes.update(r.outcomes)
    latencies = [sample for r in results for sample in r.latencies_ms]
    calls = sum(r.calls for r in results)
    done = outcomes.get(count, 0)
    retries = sum(r.contention_retries for r in results)
    batch_sizes: Counter[int] = Counter()
    for r in results:
        batch_sizes.update(r.batch_sizes)
    busy, total = results[0].machine_cpu
    ncpu = os.cpu_count() or 1
    busy_share = busy / total if total > 0 else None
    return {
        "workers": len(results),
        "seconds": round(seconds, 3),
        "calls": calls,
        count: done,
        "per_second": round(done / seconds, 1) if seconds > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 0.50), 2),
        "p95_ms": round(percentile(latencies, 0.95), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "outcomes": dict(sorted(outcomes.items())),
        "contention_retries": retries,
        "retries_per_call": round(retries / calls, 4) if calls else 0.0,
        "contention_errors": sum(r.contention_errors for r in results),
        "deferred_per_call": (round(sum(r.deferred for r in results) / calls, 4) if calls else 0.0),
        "prepare_seconds_max": round(max(r.prepare_seconds for r in results), 2),
        # the whole machine (workers, database server, anything else) during the run
        "machine_cpu_busy": None if busy_share is None else round(busy_share, 3),
        "machine_cpu_ms_per_call": (
            round(busy_share * ncpu * seconds * 1000 / calls, 3)
            if busy_share is not None and calls
            else None
        ),
        **_batches(batch_sizes),
        **_process_cpu(results, done),
    }


def _process_cpu(results: list[WorkerResult], done: int) -> dict[str, Any]:
    """CPU per placement of the scheduler (the worker processes, every thread) and of
    the database's PostgreSQL backends (worker 0's window), apart from the rest of a
    shared machine (schedule runs in process; empty for the others)."""
    own = [r.own_cpu_seconds for r in results if r.own_cpu_seconds is not None]
    if not own or not done:
        return {}
    database = results[0].database_cpu_seconds
    return {
        "scheduler_cpu_ms_per_placement": round(sum(own) * 1000 / done, 3),
        "database_cpu_ms_per_placement": (
            None if database is None else round(database * 1000 / done, 3)
        ),
    }


def _batches(sizes: Counter[int]) -> dict[str, Any]:
    """The distribution of placement batch sizes (empty when there were none)."""
    if not sizes:
        return {}
    batches = sum(sizes.values())
    requests = sum(size * count for size, count in sizes.items())
    ordered = sorted(size for size, count in sizes.items() for _ in range(count))
    return {
        "batches": batches,
        "batch_size_mean": round(requests / batches, 2),
        "batch_size_p50": percentile([float(s) for s in ordered], 0.50),
        "batch_size_p95": percentile([float(s) for s in ordered], 0.95),
        "batch_size_max": ordered[-1],
    }
