"""serve's CPU per ``schedule`` request spent outside the scheduler: the HTTP layer alone.

    .venv/bin/python scripts/http_layer_cpu.py [--seconds 8] [--connections 16] [--fastapi-route]

Sets up one runner and one sandbox in a new SQLite file, schedules it once, then serves
the application with its ``schedule_async`` replaced by one that returns that answer at
once (uvicorn on a free loopback port, in a child process, as ``serve`` runs), and
sends the same request from ``--connections`` keep-alive connections of the bench's
client for ``--seconds``. Prints requests/s and the serve process's CPU per request
(user and system time from ``/proc/<pid>/stat``). ``--fastapi-route``: without the
direct schedule route (``infrastructure/http/schedule_route.py``), to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.models import ScheduleBody
from secondbox_scheduler.infrastructure.http.server import listening_socket, make_server
from secondbox_scheduler.infrastructure.tools.bench.http_client import KeepAliveConnection

SANDBOX = "s1"
PATH = f"/v1/sandboxes/{SANDBOX}/schedule"


def _serve(info: Path, fastapi_route: bool) -> None:
    """The child: the stubbed service on a free port, written to ``info`` with the body."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.http_helpers import (
        api_client,
        heartbeat_body,
        runner_body,
        sandbox_body,
        schedule_body,
    )

    database = tempfile.mkdtemp()
    env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": f"{database}/s.db"}
    now = datetime.now(UTC)
    app = SchedulerApplication(env=env)
    with api_client(app) as client:
        client.post("/v1/runners", json=runner_body("r1")).raise_for_status()
        client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(now)).raise_for_status()
        client.post("/v1/sandboxes", json=sandbox_body(SANDBOX)).raise_for_status()
        body = schedule_body(SANDBOX, now)
        client.post(PATH, json=body).raise_for_status()
    answer = app.schedule(ScheduleBody.model_validate(body).to_request(SANDBOX))

    async def stored(request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        await asyncio.sleep(0)
        return answer

    app.schedule_async = stored  # type: ignore[method-assign]
    sock = listening_socket("127.0.0.1", 0)
    info.write_text(json.dumps({"port": sock.getsockname()[1], "body": body}))
    make_server(create_app(app, schedule_route=not fastapi_route), sock).run(sockets=[sock])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(port: int, body: bytes, seconds: float, connections: int) -> int:
    count = 0

    async def connection() -> None:
        nonlocal count
        conn = KeepAliveConnection("127.0.0.1", port)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                status, _ = await conn.post(PATH, body)
                if status != 200:
                    raise SystemExit(f"the stubbed service answered {status}")
                count += 1
        finally:
            await conn.close()

    await asyncio.gather(*(connection() for _ in range(connections)))
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--fastapi-route", action="store_true")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        _serve(args.serve, args.fastapi_route)
        return
    info = Path(tempfile.mkdtemp()) / "service.json"
    command = [sys.executable, __file__, "--serve", str(info)]
    child = subprocess.Popen([*command, *(["--fastapi-route"] if args.fastapi_route else [])])
    try:
        while not info.exists() or not info.stat().st_size:
            if child.poll() is not None:
                raise SystemExit("the service did not start")
            time.sleep(0.1)
        service: dict[str, Any] = json.loads(info.read_text())
        body = json.dumps(service["body"]).encode()
        asyncio.run(_drive(service["port"], body, 1.0, args.connections))  # warm up
        before, started = _cpu_seconds(child.pid), time.monotonic()
        count = asyncio.run(_drive(service["port"], body, args.seconds, args.connections))
        elapsed, used = time.monotonic() - started, _cpu_seconds(child.pid) - before
        route = "FastAPI route" if args.fastapi_route else "direct route"
        print(
            f"{route}: {count / elapsed:,.0f} requests/s, serve CPU "
            f"{used / count * 1e6:,.0f} us per request ({count:,} requests, "
            f"{args.connections} connections)"
        )
    finally:
        child.terminate()
        child.wait()


if __name__ == "__main__":
    main()
