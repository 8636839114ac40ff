"""The ``http`` section of ``secondbox-scheduler bench``: ``schedule`` over HTTP.

W ``secondbox-scheduler serve`` processes (replicas) run on the benchmark's database;
each of the W worker processes is the HTTP client of one of them and drives it from
``http_connections`` concurrent keep-alive connections (:mod:`.http_client`), each
sending its next request when it has its answer: the closed loop of the in-process
batched run, whose concurrent callers the replica's batcher groups in the same way
(same fleet shape, same requests). The difference between the two rows is what the
service adds (loopback HTTP, uvicorn, FastAPI, JSON both ways). Latency is measured by
the client, from sending a request to having parsed its answer; the bodies are prepared
before the run, and each is given fresh times and encoded just before its timer starts
(the scheduler's clock checks the times). Worker 0 also measures the CPU the serve
processes and the database's PostgreSQL backends used over its run (:mod:`.process_cpu`).

Then the new-sandbox path over HTTP (:func:`measure_http_new_sandbox`): each call
creates its sandbox (``POST /v1/sandboxes``: the home chosen over the pool) and
schedules it.

Untimed: starting the replicas, and warming each replica's aggregate cache with one
heartbeat per runner it will place on (the same evidence as registered, so nothing
or a liveness renewal is written), as a long-running replica has them cached.
Every acknowledged placement (201 or 200) is then looked for on its runner
(:mod:`.ledger`).
"""

from __future__ import annotations

import asyncio
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.synchronize import Barrier
from typing import Any
from urllib.parse import urlsplit

from secondbox_scheduler.domain.values import ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
)
from secondbox_scheduler.infrastructure.tools.bench.database import settle
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.fleet import (
    CLAIM_AHEAD,
    DEADLINE_AHEAD,
    MATERIALIZATION,
    RUNTIME,
    bench_requirements,
    create_homed_sandboxes,
    register_fleet,
    roomy_fleet,
    schedule_request,
)
from secondbox_scheduler.infrastructure.tools.bench.http_client import KeepAliveConnection
from secondbox_scheduler.infrastructure.tools.bench.ledger import acknowledged_homes, check_ledger
from secondbox_scheduler.infrastructure.tools.bench.process_cpu import (
    database_backends,
    database_name,
    machine_cpu_seconds,
    processes_cpu,
    used_since,
)
from secondbox_scheduler.infrastructure.tools.bench.serve_metrics import (
    SpeedProbe,
    difference,
    scrape_figures,
    serve_summary,
    task_difference,
    task_figures,
)
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.timing import now
from secondbox_scheduler.infrastructure.tools.bench.workers import (
    BARRIER_TIMEOUT,
    Job,
    WorkerPool,
    WorkerResult,
    _cpu_window,
    summarize,
)

SERIALIZATION_RETRY_LIMIT = 8
START_TIMEOUT = 120.0  # seconds for a replica to say where it listens
CLI = "secondbox_scheduler.infrastructure.cli"
PLACED, REPLAYED, CONTENTION = "placed", "replayed", "contention_error"


def http_fields(request: ScheduleRequest) -> dict[str, Any]:
    """The request as the HTTP API takes it (hex token, seconds, no sandbox id)."""
    fields = request.model_dump(
        mode="json", exclude={"sandbox_id", "fencing_token", "heartbeat_timeout"}
    )
    fields["fencing_token"] = request.fencing_token.hex()
    fields["heartbeat_timeout_seconds"] = request.heartbeat_timeout.total_seconds()
    return fields


def http_body(request: ScheduleRequest) -> bytes:
    """:func:`http_fields` encoded."""
    return json.dumps(http_fields(request)).encode()


def _counter(text: str, name: str) -> float:
    """A counter's value in a Prometheus text scrape (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def _dumps(fields: dict[str, Any]) -> bytes:
    try:
        import orjson
    except ImportError:  # pragma: no cover - the [server] extra brings orjson
        return json.dumps(fields).encode()
    return orjson.dumps(fields)


def _creation_fields(request: ScheduleRequest) -> dict[str, Any]:
    """``POST /v1/sandboxes`` for the request's sandbox (the new-sandbox path)."""
    return {
        "sandbox_id": request.sandbox_id,
        "workspace_id": request.workspace_id,
        "profile_revision_id": request.profile_revision_id,
        "requirements": request.requirements.model_dump(mode="json"),
        "heartbeat_timeout_seconds": request.heartbeat_timeout.total_seconds(),
    }


def _fresh(fields: dict[str, Any]) -> bytes:
    """A prepared schedule body with its times moved to now (as :func:`fresh_times`)."""
    at = datetime.now(UTC)
    stamp = at.isoformat()
    fields["now"] = fields["effect_started_at"] = fields["plan_ready_at"] = stamp
    fields["claim_expires_at"] = (at + CLAIM_AHEAD).isoformat()
    fields["operation_deadline"] = (at + DEADLINE_AHEAD).isoformat()
    return _dumps(fields)


@dataclass
class _Run:
    """What the connections of one client process found (one asyncio loop: no lock)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    acknowledged: list[str] = field(default_factory=list)
    finished: float = 0.0


@dataclass(frozen=True)
class HttpScheduleJob:
    """Schedule the sandboxes through the replica at ``base_url`` for ``seconds``, from
    ``connections`` concurrent keep-alive connections (each sends its next request when
    it has its answer: the closed loop of the in-process batched run, whose callers the
    batcher groups). ``create_first``: the new-sandbox path, ``POST /v1/sandboxes`` then
    ``schedule`` (the sandboxes do not exist yet; timed from the creation's send).
    Worker 0 also measures the CPU of ``serve_pids`` and of the PostgreSQL backends of
    ``database_name`` over its run window."""

    base_url: str
    pool_name: str
    sandbox_ids: tuple[str, ...]
    warm_runner_ids: tuple[str, ...]
    seconds: float
    seed: int
    connections: int = 1
    create_first: bool = False
    serve_pids: tuple[int, ...] = ()
    database_name: str | None = None

    def run(self, index: int, barrier: Barrier) -> WorkerResult:
        import httpx

        prepared = time.perf_counter()
        requirements = bench_requirements(self.pool_name)
        evidence = {
            "artifact_digests": [RUNTIME],  # as roomy_fleet registers them
            "materializations": [MATERIALIZATION.to_record()],
        }
        at = datetime.now(UTC)
        requests = [
            schedule_request(
                sandbox_id, requirements, at, seed=self.seed,
                serialization_retry_limit=SERIALIZATION_RETRY_LIMIT,
            )
            for sandbox_id in self.sandbox_ids
        ]  # fmt: skip
        bodies = [(r.sandbox_id, http_fields(r), _creation_fields(r)) for r in requests]
        with httpx.Client(base_url=self.base_url, timeout=60.0) as client:
            for runner_id in self.warm_runner_ids:
                beat = {"at": datetime.now(UTC).isoformat(), **evidence}
                client.post(f"/v1/runners/{runner_id}/heartbeat", json=beat).raise_for_status()
            scrape = client.get("/metrics").text
            retries_before = _counter(scrape, "secondbox_scheduler_contention_retries_total")
            errors_before = _counter(scrape, "secondbox_scheduler_contention_errors_total")
            figures_before = scrape_figures(scrape)
            prepare_seconds = time.perf_counter() - prepared
            barrier.wait(BARRIER_TIMEOUT)
            cpu_before = machine_cpu_seconds()
            serve_before = processes_cpu(self.serve_pids) if index == 0 else {}
            tasks_before = task_figures(self.serve_pids) if index == 0 else None
            client_before = time.process_time()
            database_before = (
                database_backends(self.database_name) if index == 0 and self.database_name else {}
            )
            started = time.perf_counter()
            found = asyncio.run(self._drive(bodies, started + self.seconds))
            cpu = _cpu_window(index, cpu_before)
            client_cpu = time.process_time() - client_before
            serve_cpu = database_cpu = tasks = None
            if index == 0:
                serve_cpu = used_since(serve_before, processes_cpu(self.serve_pids))
                if tasks_before is not None:
                    tasks = task_difference(tasks_before, task_figures(self.serve_pids))
                if self.database_name:
                    after = database_backends(self.database_name)
                    database_cpu = used_since(database_before, after)
            scrape = client.get("/metrics").text
        return WorkerResult(
            worker=index,
            started=started,
            finished=found.finished or started,
            calls=sum(found.outcomes.values()),
            latencies_ms=found.latencies,
            outcomes=dict(found.outcomes),
            contention_retries=int(
                _counter(scrape, "secondbox_scheduler_contention_retries_total") - retries_before
            ),
            contention_errors=int(
                _counter(scrape, "secondbox_scheduler_contention_errors_total") - errors_before
            ),
            prepare_seconds=prepare_seconds,
            machine_cpu=cpu,
            acknowledged=tuple(found.acknowledged),
            serve_cpu_seconds=serve_cpu,
            database_cpu_seconds=database_cpu,
            serve_figures=difference(figures_before, scrape_figures(scrape)),
            serve_tasks=tasks,
            client_cpu_seconds=client_cpu,
        )

    async def _drive(
        self, bodies: list[tuple[str, dict[str, Any], dict[str, Any]]], deadline: float
    ) -> _Run:
        host, port = _host_port(self.base_url)
        found = _Run()
        queue = iter(bodies)

        async def connection() -> None:
            conn = KeepAliveConnection(host, port)
            try:
                for sandbox_id, fields, creation in queue:
                    if time.perf_counter() >= deadline:
                        break
                    await self._call(conn, sandbox_id, fields, creation, found)
            finally:
                await conn.close()

        await asyncio.gather(*(connection() for _ in range(max(1, self.connections))))
        return found

    async def _call(
        self,
        conn: KeepAliveConnection,
        sandbox_id: str,
        fields: dict[str, Any],
        creation: dict[str, Any],
        found: _Run,
    ) -> None:
        before = time.perf_counter()
        if self.create_first:
            status, answer = await conn.post("/v1/sandboxes", _dumps(creation))
            if status not in (200, 201):
                found.outcomes[f"create:{_code(answer, status)}"] += 1
                found.finished = max(found.finished, time.perf_counter())
                return
        path = f"/v1/sandboxes/{sandbox_id}/schedule"
        status, answer = await conn.post(path, _fresh(fields))
        parsed = json.loads(answer)  # the client reads its answer, as any client must
        finished = time.perf_counter()
        if status == 201:
            outcome = PLACED
            found.latencies.append((finished - before) * 1000.0)
            found.acknowledged.append(sandbox_id)
        elif status == 200:
            outcome = REPLAYED
            found.acknowledged.append(sandbox_id)
        elif status == 503:
            outcome = CONTENTION
        else:
            outcome = str(parsed.get("code", status)) if isinstance(parsed, dict) else str(status)
        found.outcomes[outcome] += 1
        found.finished = max(found.finished, finished)


def _code(answer: bytes, status: int) -> str:
    try:
        parsed = json.loads(answer)
    except ValueError:
        return str(status)
    return str(parsed.get("code", status)) if isinstance(parsed, dict) else str(status)


def _host_port(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise BenchError(f"the bench's HTTP client needs http://host:port, not {base_url!r}")
    return parts.hostname, parts.port


@dataclass
class Replicas:
    """The serve processes of a run: their base URLs and process ids."""

    urls: list[str]
    pids: list[int]


@contextmanager
def replicas(database_url: str, count: int) -> Iterator[Replicas]:
    """``count`` serve processes on the database."""
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
        yield Replicas(urls, [process.pid for process in processes])
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


def _with_cpu(summary: dict[str, Any], results: list[WorkerResult]) -> dict[str, Any]:
    """The serve processes' and PostgreSQL's CPU per placement (worker 0's window)."""
    first, placed = results[0], summary.get("placed", 0)
    for key, seconds in (
        ("serve_cpu_ms_per_placement", first.serve_cpu_seconds),
        ("database_cpu_ms_per_placement", first.database_cpu_seconds),
    ):
        summary[key] = round(seconds * 1000 / placed, 3) if seconds is not None and placed else None
    summary.update(
        serve_summary(
            [r.serve_figures for r in results],
            [r.outcomes.get(PLACED, 0) for r in results],
            first.serve_tasks,
            first.serve_cpu_seconds,
        )
    )
    summary.update(_shares(summary, results))
    return summary


def _shares(summary: dict[str, Any], results: list[WorkerResult]) -> dict[str, Any]:
    """The clients' CPU per placement, and the machine's CPU over worker 0's window by
    whose it was: serve's, PostgreSQL's backends', the clients', and the rest (other
    processes of a shared machine, the database server's own processes, the kernel)."""
    placed = summary.get("placed", 0)
    clients = [r.client_cpu_seconds for r in results if r.client_cpu_seconds is not None]
    found: dict[str, Any] = {}
    if clients and placed:
        found["client_cpu_ms_per_placement"] = round(sum(clients) * 1000 / placed, 3)
    busy, total = results[0].machine_cpu
    serve, database = results[0].serve_cpu_seconds, results[0].database_cpu_seconds
    if total <= 0 or serve is None or not clients:
        return found
    ours = serve + (database or 0.0) + sum(clients)
    found["machine_cpu_shares"] = {
        "serve": round(serve / total, 3),
        "postgresql_backends": round((database or 0.0) / total, 3),
        "clients": round(sum(clients) / total, 3),
        "rest": round(max(0.0, busy - ours) / total, 3),
        "idle": round((total - busy) / total, 3),
    }
    return found


def measure_http(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    expected_rate: float,
    progress: Progress,
) -> dict[str, Any]:
    """The placement run over HTTP: W serve processes, each driven by one client process
    of ``settings.http_connections`` keep-alive connections."""
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
    connections = settings.http_connections
    progress(f"http: starting {settings.workers} serve processes")
    with replicas(env[DATABASE_URL], settings.workers) as served:
        progress(
            f"http: {settings.workers} clients x {connections} keep-alive connections, one "
            f"client per serve process, for {settings.placement_seconds:g}s"
        )
        ids = list(homes)
        jobs: list[Job] = [
            HttpScheduleJob(
                base_url=served.urls[index],
                pool_name=pool_name,
                sandbox_ids=tuple(ids[index :: settings.workers]),
                warm_runner_ids=tuple(sorted({homes[i] for i in ids[index :: settings.workers]})),
                seconds=settings.placement_seconds,
                seed=settings.seed,
                connections=connections,
                serve_pids=tuple(served.pids),
                database_name=database_name(env),
            )
            for index in range(settings.workers)
        ]
        progress(f"http: settling the database ({settle(env)})")
        with SpeedProbe() as probe:
            results = pool.run(jobs)
    summary = _with_cpu(summarize(results), results)
    summary["speed_probe_us"] = probe.median_us()
    summary["steal_share"] = probe.steal_share
    summary["runners"] = settings.runners
    summary["replicas"] = settings.workers
    summary["connections_per_replica"] = connections
    summary["sandboxes_prepared"] = count
    summary["ledger"] = check_ledger(env, acknowledged_homes(results, homes))
    return summary


def measure_http_new_sandbox(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    expected_rate: float,
    progress: Progress,
) -> dict[str, Any]:
    """The new-sandbox path over HTTP: each call creates its sandbox
    (``POST /v1/sandboxes``, the home chosen over the pool) and schedules it."""
    pool_name = "httpnew"
    at = now()
    count = math.ceil(expected_rate * settings.placement_seconds * 1.5) + 50 * settings.workers
    progress(f"http new sandboxes: registering {settings.runners:,} runners")
    fleet = roomy_fleet(pool_name, settings.runners, instances=100_000)
    register_fleet(app, fleet, at)
    app.runner_snapshots(pool_name)  # the read models caught up, untimed
    runner_ids = tuple(spec.runner_id for spec in fleet)
    ids = [f"{pool_name}-{index:07d}" for index in range(count)]
    connections = settings.http_connections
    with replicas(env[DATABASE_URL], settings.workers) as served:
        progress(
            f"http new sandboxes: {settings.workers} clients x {connections} connections, "
            f"create then schedule, for {settings.placement_seconds:g}s"
        )
        jobs: list[Job] = [
            HttpScheduleJob(
                base_url=served.urls[index],
                pool_name=pool_name,
                sandbox_ids=tuple(ids[index :: settings.workers]),
                warm_runner_ids=runner_ids,
                seconds=settings.placement_seconds,
                seed=settings.seed,
                connections=connections,
                create_first=True,
                serve_pids=tuple(served.pids),
                database_name=database_name(env),
            )
            for index in range(settings.workers)
        ]
        progress(f"http new sandboxes: settling the database ({settle(env)})")
        with SpeedProbe() as probe:
            results = pool.run(jobs)
    summary = _with_cpu(summarize(results), results)
    summary["speed_probe_us"] = probe.median_us()
    summary["steal_share"] = probe.steal_share
    summary["runners"] = settings.runners
    summary["replicas"] = settings.workers
    summary["connections_per_replica"] = connections
    summary["ledger"] = check_ledger(env, acknowledged_homes(results, None), runner_ids)
    return summary
