"""How ``audit verify`` scales (section ``audit`` of ``secondbox-scheduler bench``): its
peak memory on a steady fleet's log at two lengths, and its rate on one runner holding
many live reservations.

Each history is written to a new SQLite file of its own (:mod:`.audit_history`), then
verified by ``secondbox-scheduler audit verify --json`` in a child process, whose peak
resident memory (``ru_maxrss``, from ``os.wait4``) is the memory figure: the whole
process (interpreter and imports included), as an operator sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.tools.bench.audit_history import (
    one_runner_history,
    steady_history,
)
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress


def verify_in_child(url: str) -> dict[str, Any]:
    """``audit verify`` of ``url`` in a child process: its report, wall seconds and
    peak resident memory (MB)."""
    started = time.perf_counter()
    child = subprocess.Popen(
        [str(Path(sys.executable).with_name("secondbox-scheduler")), "audit", "verify", "--json"],
        env={**os.environ, DATABASE_URL: url},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert child.stdout is not None
    output = child.stdout.read()
    _, _, usage = os.wait4(child.pid, 0)
    child.returncode = 0
    report = json.loads(output)
    return {
        "events": report["events_checked"],
        "violations": len(report["violations"]),
        "events_per_second": report["events_per_second"],
        "wall_seconds": round(time.perf_counter() - started, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # kilobytes on Linux
    }


def measure_audit_scale(settings: BenchSettings, progress: Progress) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="secondbox-audit-bench-") as directory:
        for size in settings.audit_sizes:
            url = f"sqlite:///{Path(directory) / f'steady-{size}.db'}"
            app = SchedulerApplication(env={DATABASE_URL: url})
            started = time.perf_counter()
            try:
                progress(f"audit: a steady fleet's log of {size:,} events")
                steady_history(app, size, progress=progress)
            finally:
                app.close()
            written = round(time.perf_counter() - started, 1)
            progress(f"audit: verify {size:,} events")
            rows.append({"target_events": size, "write_seconds": written, **verify_in_child(url)})
        url = f"sqlite:///{Path(directory) / 'one-runner.db'}"
        app = SchedulerApplication(env={DATABASE_URL: url})
        started = time.perf_counter()
        try:
            progress(f"audit: one runner with {settings.audit_reservations:,} reservations")
            one_runner_history(app, settings.audit_reservations, progress=progress)
        finally:
            app.close()
        written = round(time.perf_counter() - started, 1)
        one = {
            "reservations": settings.audit_reservations,
            "write_seconds": written,
            **verify_in_child(url),
        }
    first, last = rows[0], rows[-1]
    return {
        "steady": rows,
        "memory_ratio": round(last["peak_rss_mb"] / first["peak_rss_mb"], 3),
        "one_runner": one,
    }
