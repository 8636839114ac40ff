"""The ``bench`` command group: the scheduler benchmark, and ``bench history``, runner load cost."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from secondbox_scheduler.infrastructure.cli.common import (
    JsonOutput,
    fail,
    needs_extra,
    print_json,
    reported_errors,
    stdout,
    store_env,
    store_errors,
)
from secondbox_scheduler.infrastructure.exit_codes import EXIT_VIOLATION
from secondbox_scheduler.infrastructure.settings import DATABASE_URL, redact_url

BENCH_HELP = (
    "Benchmarks that print figures (never timed tests). See docs/performance.md.\n\n"
    "Without a subcommand: the scheduler benchmark. It creates a fresh database (a new "
    "database on the local PostgreSQL server, or a new schema in the database of "
    "--database-url, or a new SQLite file), dropped at the end unless --keep, and "
    "measures, by section (--only): raw, the eventsourcing baseline, new aggregates saved "
    "one, two and 32 per transaction by W worker processes (the ceiling of group commit); "
    "placement, W workers scheduling over R runners with spare capacity, one placement per "
    "transaction; contention, 3,000 sandboxes homed on 4 runners; batched, the same two "
    "with concurrent callers per worker whose placements the batcher commits together "
    "(batch sizes, CPU per placement), and an open loop: requests arriving at the goal's "
    "rate (1.5 x raw one-aggregate, needs the raw section), each timed from its arrival; "
    "row_lock, the state-based peer (runner rows, one "
    "SERIALIZABLE transaction per placement); http, the placement run through W serve "
    "processes, each from 10 keep-alive connections (8 with --quick), and a new sandbox "
    "(create, then schedule) over HTTP; selection, select_runner, create_sandbox and a new "
    "sandbox end to end (create, then schedule) over 100, 1,000 and 10,000 runners; "
    "history, loading a runner "
    "after 10, 1,000 and 100,000 events and a sandbox after many generations; replay, "
    "projection rebuild, audit verify and the what-if replay against the raw notification "
    "read rate. Prints a table per measurement and each goal as met or not met. Exits 1 "
    "when a run oversubscribed a runner, lost an acknowledged placement or failed its "
    "audit.\n\n"
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler bench\n"
    "  secondbox-scheduler bench --quick --json\n"
    "  secondbox-scheduler bench --quick --database-url sqlite:////tmp/bench-new.db\n"
    "  secondbox-scheduler bench --only raw,placement --workers 2\n"
    "  secondbox-scheduler bench --only raw,placement,batched,replay --chain off\n"
    "  secondbox-scheduler bench --only raw,batched --callers 4"
)

bench_cli = typer.Typer(help=BENCH_HELP, invoke_without_command=True)


@bench_cli.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help=(
                "Run elsewhere than in a new database on the local PostgreSQL server: "
                "postgresql://... (a new schema in that database) or sqlite:////new/file.db "
                "(a file that must not exist yet)."
            ),
        ),
    ] = None,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Worker processes (W).")] = 4,
    runners: Annotated[
        int | None,
        typer.Option(
            "--runners",
            min=1,
            help="Runners of the placement run (R): 1000, or 200 with --quick.",
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Smaller sizes and shorter runs (under a minute).")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of every random choice.")] = 7,
    seconds: Annotated[
        float | None,
        typer.Option(
            "--seconds", min=0.1, help="Length of the timed runs (raw baseline, placement)."
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help=(
                "Comma-separated sections: raw, placement, contention, batched, row_lock, "
                "http, selection, history, replay."
            ),
        ),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the benchmark's database for inspection.")
    ] = False,
    chain: Annotated[
        str,
        typer.Option(
            "--chain",
            help=(
                "on: the hash chain over the stored events, as in production; off: without "
                "it, to measure what it costs (run both, back to back)."
            ),
        ),
    ] = "on",
    callers: Annotated[
        int | None,
        typer.Option(
            "--callers",
            min=1,
            max=1024,  # threads per worker process: more only exhausts the machine
            help=(
                "Concurrent schedule callers per worker in the batched runs: 10, or 8 with "
                "--quick (1 to 1,024). Fewer: smaller batches, shorter waits; more: the "
                "opposite (past 10, only longer waits: docs/performance.md)."
            ),
        ),
    ] = None,
    http_connections: Annotated[
        int | None,
        typer.Option(
            "--http-connections",
            min=1,
            max=256,
            help=(
                "Keep-alive connections per serve process in the http section: 10, or 8 "
                "with --quick (1 to 256). Fewer: shorter waits, smaller batches."
            ),
        ),
    ] = None,
    cells: Annotated[
        int | None,
        typer.Option(
            "--cells",
            min=2,
            max=16,
            help=(
                "Instead of the sections: batched placements through cell routers over 1 "
                "and N cells (a fresh database each on the local server), with the CPU "
                "per placement of the scheduler processes and of PostgreSQL."
            ),
        ),
    ] = None,
    as_json: JsonOutput = False,
) -> None:
    needs_extra("bench", "bench")
    if ctx.invoked_subcommand is not None:
        return
    if cells is not None:
        _bench_cells(cells, quick, workers, runners, seed, seconds, keep, as_json)
        return
    from secondbox_scheduler.infrastructure.tools.bench import (
        SECTIONS,
        BenchError,
        BenchSettings,
        print_report,
        run_bench,
    )

    sections = SECTIONS if only is None else tuple(p.strip() for p in only.split(",") if p.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        fail(f"--only takes sections among {', '.join(SECTIONS)}; got {only!r}")
    if chain not in ("on", "off"):
        fail(f"--chain takes on or off; got {chain!r}")
    settings = BenchSettings.make(
        quick=quick, workers=workers, runners=runners, seed=seed, seconds=seconds,
        sections=sections, chain=chain == "on", callers=callers,
        http_connections=http_connections,
    )  # fmt: skip
    err = Console(stderr=True, highlight=False)
    try:
        with reported_errors():
            report = run_bench(
                settings,
                database_url,
                keep=keep,
                progress=(lambda _: None) if as_json else (lambda m: err.print(f"[dim]{m}…[/dim]")),
            )
    except BenchError as error:
        fail(escape(str(error)), error.exit_code)
    if as_json:
        print_json(report)
    else:
        print_report(report, stdout())
    if report["failures"]:  # a run broke an invariant: figures or not, the bench fails
        for failure in report["failures"]:
            err.print(f"bench: {escape(failure)}")
        raise typer.Exit(EXIT_VIOLATION)


def _bench_cells(
    cells: int, quick: bool, workers: int, runners: int | None, seed: int,
    seconds: float | None, keep: bool, as_json: bool,
) -> None:  # fmt: skip
    import os
    import time

    from secondbox_scheduler.infrastructure.tools.bench import BenchError, BenchSettings
    from secondbox_scheduler.infrastructure.tools.bench.cells import measure_cells

    settings = BenchSettings.make(
        quick=quick, workers=workers, runners=runners, seed=seed, seconds=seconds,
        sections=("batched",), chain=True, callers=None,
    )  # fmt: skip
    err = Console(stderr=True, highlight=False)
    stamp = f"{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
    try:
        with reported_errors():
            report = measure_cells(
                settings, cells, stamp,
                (lambda _: None) if as_json else (lambda m: err.print(f"[dim]{m}…[/dim]")),
                keep=keep,
            )  # fmt: skip
    except BenchError as error:
        fail(escape(str(error)), error.exit_code)
    if as_json:
        print_json(report)
        return
    table = Table(
        title=f"Placements through cell routers ({workers} workers x 10 callers, "
        f"{report['cpu_cores']} cores)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for name in (
        "cells", "placements/s", "vs 1 cell", "p50 ms", "p99 ms", "scheduler CPU ms/pl",
        "PostgreSQL CPU ms/pl", "placements/core-s", "machine busy",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    for count, run in report["runs"].items():
        table.add_row(
            count,
            f"{run['per_second']:,.0f}",
            f"{run['scaling_vs_one_cell']:.2f}",
            f"{run['p50_ms']:.1f}",
            f"{run['p99_ms']:.1f}",
            f"{run['scheduler_cpu_ms_per_placement']:.3f}",
            f"{run['postgres_cpu_ms_per_placement']:.3f}",
            f"{run['placements_per_core_second']:,.0f}",
            f"{run['machine_cpu_busy']:.0%}" if run["machine_cpu_busy"] is not None else "-",
        )
    console = stdout()
    console.print(table)
    console.print(report["note"])


@bench_cli.command(
    "history",
    help=(
        "Time loading a runner whose stream holds 10, 1,000 and 100,000 events: cold "
        "(snapshot + tail), warm (aggregate cache, fast-forward) and full replay (no "
        "snapshots), with ratios against the smallest history.\n\n"
        "[bold]Example[/bold]\n\n"
        "  secondbox-scheduler bench history --database-url sqlite:////tmp/bench.db"
    ),
)
def bench_history(
    database_url: Annotated[
        str,
        typer.Option(
            "--database-url",
            envvar=DATABASE_URL,
            help="Store to build the histories in (new runners are added; nothing is removed).",
        ),
    ] = "sqlite:///secondbox-bench.db",
    sizes: Annotated[
        str, typer.Option("--sizes", help="Comma-separated history sizes, smallest first.")
    ] = "10,1000,100000",
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Loads timed per figure.")] = 15,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.tools.bench import measure_history

    try:
        wanted = [int(part) for part in sizes.split(",") if part.strip()]
    except ValueError:
        fail(f"--sizes must be comma-separated integers, got {sizes!r}")
    if not wanted or min(wanted) < 1:
        fail("--sizes needs at least one size of 1 or more")
    err = Console(stderr=True, highlight=False)
    with reported_errors(), store_errors(database_url):
        rows = measure_history(
            store_env(database_url),
            wanted,
            repeat,
            progress=(lambda _: None) if as_json else (lambda m: err.print(f"[dim]{m}…[/dim]")),
        )
    if as_json:
        print_json({"database_url": redact_url(database_url), "rows": [r.to_dict() for r in rows]})
        return
    table = Table(title=f"Runner load cost by history ({redact_url(database_url)})", box=box.SIMPLE)
    for column in (
        "events",
        "snapshot at",
        "tail",
        "cold ms",
        "ratio",
        "warm ms",
        "ratio",
        "replay ms",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row.events:,}",
            "-" if row.snapshot_version is None else f"{row.snapshot_version:,}",
            f"{row.tail_events:,}",
            f"{row.cold_ms:.2f}",
            f"{row.cold_ratio:.2f}",
            f"{row.warm_ms:.3f}",
            f"{row.warm_ratio:.2f}",
            f"{row.replay_ms:.1f}",
        )
    stdout().print(table)
