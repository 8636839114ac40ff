"""``run_bench``: every section of one ``secondbox-scheduler bench`` run, in order, on a
fresh database; the report as a dict (settings, database, machine, the figures of each
section, goals, wall time)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import CHAIN, DATABASE_URL
from secondbox_scheduler.infrastructure.tools.bench.audit_scale import measure_audit_scale
from secondbox_scheduler.infrastructure.tools.bench.database import (
    bench_database,
    machine_info,
)
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.goals import GOAL_BATCHED, evaluate_goals
from secondbox_scheduler.infrastructure.tools.bench.history import measure_history_section
from secondbox_scheduler.infrastructure.tools.bench.ledger import failures
from secondbox_scheduler.infrastructure.tools.bench.merkle import measure_merkle, measure_since
from secondbox_scheduler.infrastructure.tools.bench.over_http import (
    measure_http,
    measure_http_new_sandbox,
)
from secondbox_scheduler.infrastructure.tools.bench.replay import measure_replay
from secondbox_scheduler.infrastructure.tools.bench.selection import measure_selection
from secondbox_scheduler.infrastructure.tools.bench.settings import (
    SECTIONS,
    BenchSettings,
    Progress,
)
from secondbox_scheduler.infrastructure.tools.bench.throughput import (
    measure_contention,
    measure_new_sandbox,
    measure_placement,
    measure_raw,
    measure_row_lock,
)
from secondbox_scheduler.infrastructure.tools.bench.workers import RawBaseline, WorkerPool, raw_env

DEFAULT_RATE = 1000.0  # schedules/s assumed when no raw baseline was measured


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the duration (processes started inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


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
    with (
        _environment(CHAIN, "on" if settings.chain else "off"),  # the serve processes too
        bench_database(database_url, stamp, keep=keep) as fresh,
    ):
        report["database"] = fresh.shown
        report["kept"] = keep
        report["machine"] = machine_info(fresh)
        env = {DATABASE_URL: fresh.url, CHAIN: "on" if settings.chain else "off"}
        progress(f"fresh database {fresh.shown}")
        app = SchedulerApplication(env=env)  # creates the tables before any worker starts
        RawBaseline(env=raw_env(env)).close()
        try:
            needs_workers = bool(
                wanted & {"raw", "placement", "contention", "batched", "row_lock", "http", "merkle"}
            )
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
                if "batched" in wanted:
                    report["batched"] = measure_placement(
                        pool, app, env, settings, 3 * rate, progress,
                        threads=settings.callers, pool_name="batched",
                    )  # fmt: skip
                    one = report.get("raw_baseline", {}).get("one_aggregate", {})
                    offered = GOAL_BATCHED * one.get("transactions_per_second", 0.0)
                    if offered > 0:  # latency at the goal's rate: needs the raw rate
                        report["batched_steady"] = measure_placement(
                            pool, app, env, settings, offered, progress,
                            threads=settings.open_loop_callers, pool_name="steady",
                            offered_per_second=offered,
                        )  # fmt: skip
                    report["contention_batched"] = measure_contention(
                        pool, app, env, settings, progress,
                        threads=settings.callers, pool_name="hotbatch",
                        sandboxes=settings.batched_contention_sandboxes,
                    )  # fmt: skip
                    report["new_sandbox"] = measure_new_sandbox(
                        pool, app, env, settings, report["batched"]["per_second"] or rate,
                        progress, threads=settings.callers,
                    )  # fmt: skip
                if "row_lock" in wanted:
                    report["row_lock"] = measure_row_lock(pool, env, settings, progress)
                if "merkle" in wanted:
                    report["merkle"] = measure_merkle(pool, app, env, settings, rate, progress)
                if "http" in wanted:
                    if "batched" in report:  # the rate it is held to
                        rate = report["batched"]["per_second"] or rate
                    elif "placement" in report:
                        rate = 3 * (report["placement"]["per_second"] or rate)
                    report["http"] = measure_http(pool, app, env, settings, rate, progress)
                    report["http_new_sandbox"] = measure_http_new_sandbox(
                        pool, app, env, settings, rate, progress
                    )
            if "selection" in wanted:
                report["selection"] = measure_selection(app, settings, progress)
            if "replay" in wanted:
                report["replay"] = measure_replay(app, progress)
                report["replay"]["events_in_log"] = app.event_count()
        finally:
            app.close()
        if "history" in wanted:
            report["history"] = measure_history_section(env, settings, progress)
        if "audit" in wanted:
            report["audit_scale"] = measure_audit_scale(settings, progress)
        if "since" in wanted:
            report["since"] = measure_since(settings, progress)
    report["goals"] = evaluate_goals(report)
    report["failures"] = failures(report)  # any: the bench exits 1 (:mod:`.ledger`)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    return report
