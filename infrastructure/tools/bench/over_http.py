"""The ``http`` section of ``secondbox-scheduler bench``: ``schedule`` over HTTP.

W ``secondbox-scheduler serve`` processes (replicas) run on the benchmark's database;
each of the W worker processes is the HTTP client of one of them (httpx, one
keep-alive connection) and schedules its sandboxes one after another for the
placement run's duration, exactly as the in-process placement run does (same fleet
shape, same requests): the difference between the two rows is what the service adds
(loopback HTTP, uvicorn, FastAPI, JSON both ways). Latency is measured by the client,
from sending a request to having parsed its answer; requests are prepared before the
run, and each is given fresh times and encoded just before its timer starts (the
scheduler's clock checks the times).

Untimed: starting the replicas, and warming each replica's aggregate cache with one
heartbeat per runner it will place on (the same evidence as registered, so nothing
or a liveness renewal is written), as a long-running replica has them cached.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.synchronize import Barrier
from typing import Any

from secondbox_scheduler.domain.values import ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.tools.bench.database import settle
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    MATERIALIZATION,
    RUNTIME,
    bench_requirements,
    create_homed_sandboxes,
    fresh_times,
    register_fleet,
    roomy_fleet,
    schedule_request,
)
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.timing import now
from secondbox_scheduler.infrastructure.tools.bench.workers import (
    BARRIER_TIMEOUT,
    WorkerPool,
    WorkerResult,
    _cpu_window,
    machine_cpu_seconds,
    summarize,
)

SERIALIZATION_RETRY_LIMIT = 8
START_TIMEOUT = 120.0  # seconds for a replica to say where it listens
CLI = "secondbox_scheduler.infrastructure.cli"
PLACED, REPLAYED, CONTENTION = "placed", "replayed", "contention_error"


def http_body(request: ScheduleRequest) -> bytes:
    """The request as the HTTP API takes it (hex token, seconds, no sandbox id)."""
    fields = request.model_dump(
        mode="json", exclude={"sandbox_id", "fencing_token", "heartbeat_timeout"}
    )
    fields["fencing_token"] = request.fencing_token.hex()
    fields["heartbeat_timeout_seconds"] = request.heartbeat_timeout.total_seconds()
    return json.dumps(fields).encode()


def _counter(text: str, name: str) -> float:
    """A counter's value in a Prometheus text scrape (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


@dataclass(frozen=True)
class HttpScheduleJob:
    """Schedule each sandbox in turn through the replica at ``base_url`` for ``seconds``."""

    base_url: str
    pool_name: str
    sandbox_ids: tuple[str, ...]
    warm_runner_ids: tuple[str, ...]
    seconds: float
    seed: int

    def run(self, index: int, barrier: Barrier) -> WorkerResult:
        import httpx

        prepared = time.perf_counter()
        requirements = bench_requirements(self.pool_name)
        headers = {"content-type": "application/json"}
        evidence = {
            "artifact_digests": [RUNTIME],  # as roomy_fleet registers them
            "materializations": [MATERIALIZATION.to_record()],
        }
        requests = [
            schedule_request(
                sandbox_id,
                requirements,
                datetime.now(UTC),
                seed=self.seed,
                serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            )
            for sandbox_id in self.sandbox_ids
        ]
        with httpx.Client(base_url=self.base_url, timeout=60.0) as client:
            for runner_id in self.warm_runner_ids:
                beat = {"at": datetime.now(UTC).isoformat(), **evidence}
                client.post(f"/v1/runners/{runner_id}/heartbeat", json=beat).raise_for_status()
            scrape = client.get("/metrics").text
            retries_before = _counter(scrape, "secondbox_scheduler_contention_retries_total")
            errors_before = _counter(scrape, "secondbox_scheduler_contention_errors_total")
            prepare_seconds = time.perf_counter() - prepared
            outcomes: Counter[str] = Counter()
            latencies: list[float] = []
            barrier.wait(BARRIER_TIMEOUT)
            cpu_before = machine_cpu_seconds()
            started = finished = time.perf_counter()
            deadline = started + self.seconds
            for request in requests:
                body = http_body(fresh_times(request))
                path = f"/v1/sandboxes/{request.sandbox_id}/schedule"
                before = time.perf_counter()
                response = client.post(path, content=body, headers=headers)
                answer = response.json()
                finished = time.perf_counter()
                if response.status_code == 201:
                    outcome = PLACED
                    latencies.append((finished - before) * 1000.0)
                elif response.status_code == 200:
                    outcome = REPLAYED
                elif response.status_code == 503:
                    outcome = CONTENTION
                else:
                    outcome = str(answer.get("code", response.status_code))
                outcomes[outcome] += 1
                if finished >= deadline:
                    break
            cpu = _cpu_window(index, cpu_before)
            scrape = client.get("/metrics").text
        return WorkerResult(
            worker=index,
            started=started,
            finished=finished,
            calls=sum(outcomes.values()),
            latencies_ms=latencies,
            outcomes=dict(outcomes),
            contention_retries=int(
                _counter(scrape, "secondbox_scheduler_contention_retries_total") - retries_before
            ),
            contention_errors=int(
                _counter(scrape, "secondbox_scheduler_contention_errors_total") - errors_before
            ),
            prepare_seconds=prepare_seconds,
            machine_cpu=cpu,
        )


@contextmanager
def replicas(database_url: str, count: int) -> Iterator[list[str]]:
    """``count`` serve processes on the database; their base URLs."""
    command = [sys.executable, "-m", CLI, "serve", "--port", "0", "--json"]
    command += ["--database-url", database_url]
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    try:
        urls = []
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line:
                _, err = process.communicate(timeout=START_TIMEOUT)
                raise BenchError(f"a serve process did not start: {err.strip()[-2000:]}")
            urls.append(str(json.loads(line)["url"]))
        yield urls
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


def measure_http(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    expected_rate: float,
    progress: Progress,
) -> dict[str, Any]:
    rng = random.Random(settings.seed + 2)
    pool_name = "http"
    at = now()
    count = math.ceil(expected_rate * settings.placement_seconds * 1.5) + 50 * settings.workers
    progress(f"http: registering {settings.runners:,} runners, creating {count:,} sandboxes")
    fleet = roomy_fleet(pool_name, settings.runners, instances=100_000)
    snapshots = register_fleet(app, fleet, at)
    runner_ids = [spec.runner_id for spec in fleet]
    homes = {f"http-{index:07d}": rng.choice(runner_ids) for index in range(count)}
    create_homed_sandboxes(
        app,
        [(sandbox_id, snapshots[home]) for sandbox_id, home in homes.items()],
        bench_requirements(pool_name),
        at,
    )
    progress(f"http: starting {settings.workers} serve processes")
    with replicas(env[DATABASE_URL], settings.workers) as urls:
        progress(
            f"http: {settings.workers} clients, one per serve process, for "
            f"{settings.placement_seconds:g}s"
        )
        ids = list(homes)
        jobs = [
            HttpScheduleJob(
                base_url=urls[index],
                pool_name=pool_name,
                sandbox_ids=tuple(ids[index :: settings.workers]),
                warm_runner_ids=tuple(sorted({homes[i] for i in ids[index :: settings.workers]})),
                seconds=settings.placement_seconds,
                seed=settings.seed,
            )
            for index in range(settings.workers)
        ]
        progress(f"http: settling the database ({settle(env)})")
        summary = summarize(pool.run(jobs))
    summary["runners"] = settings.runners
    summary["replicas"] = settings.workers
    summary["sandboxes_prepared"] = count
    return summary
