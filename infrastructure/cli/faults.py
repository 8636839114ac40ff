"""The ``verify`` command: the fault-injection check of the scheduler's promises on PostgreSQL."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from secondbox_scheduler.infrastructure.cli.common import (
    JsonOutput,
    print_json,
    reported_errors,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.exit_codes import CommandError
from secondbox_scheduler.infrastructure.settings import DATABASE_URL

# This module's top-level commands; the package's __init__ adds them to the app `cli`.
commands = typer.Typer()


@commands.command(
    "verify",
    help=(
        "Jepsen-style check of the scheduler's promises on PostgreSQL: N worker processes "
        "schedule, release, drain, heartbeat and reconcile concurrently over one fleet with "
        "hot spots, journaling every acknowledged result; random workers are SIGKILLed and "
        "restarted (--kill-workers), PostgreSQL may be restarted mid-run "
        "(--restart-postgres: only the cluster of this machine that --database-url names, "
        "proved by its data_directory, port and postmaster; otherwise refused with exit 2 "
        "before anything runs). Then: audit verify is clean, every acknowledged schedule is "
        "in the store unchanged, interrupted requests retried get the same assignment, and "
        "the read models equal a rebuild. Runs in a fresh database it creates (and drops "
        "unless --keep). Exits 1 on any violation: an exception in a worker that is neither "
        "a typed refusal nor the store's fault (a bug, even if the run carried on), or a "
        "worker that exits non-zero when not killed on purpose, is one. --profile "
        "adversarial: runners tight on all five capacity dimensions, and clients that "
        "misbehave on purpose (stale and "
        "forged tokens, early advances, duplicate and proof-less releases, deregistering "
        "busy runners, drains during placement, heartbeats out of order), each of which "
        "must be refused with its documented error and write nothing; the aggregates' own "
        "guards and the audit's checks are probed on the live state too. --profile "
        "failover: two cells on this machine, each a primary and a standby from the local "
        "PostgreSQL binaries (--replication sync, the default, or async), managed by "
        "Patroni over a local etcd (--promote patroni, the default; "
        "scripts/failover-deps.sh installs both) or promoted with pg_ctl (--promote "
        "manual); workers place through cell routers over both cells while cell a's "
        "leader is SIGKILLed (its standby cut off for the 3 s before); then no "
        "acknowledged placement lost (async: how many, and "
        "whether the checkpoint check saw it), no runner oversubscribed, each cell's audit "
        "clean against a checkpoint taken before the failover, the other cell placing "
        "during the outage. It ignores --database-url and removes its clusters at the end, "
        "also when interrupted.\n\n"
        "[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler verify --workers 4 --duration 60 --kill-workers 3\n"
        "  secondbox-scheduler verify --workers 4 --duration 300 --kill-workers 10 "
        "--restart-postgres\n"
        "  secondbox-scheduler verify --batching off --workers 4 --duration 60 "
        "--kill-workers 3\n"
        "  secondbox-scheduler verify --profile adversarial --workers 3 --duration 60 "
        "--kill-workers 2\n"
        "  secondbox-scheduler verify --profile failover --duration 60 --json\n"
        "  secondbox-scheduler verify --profile failover --promote manual --replication "
        "async --duration 20"
    ),
)
def verify_command(
    database_url: Annotated[
        str,
        typer.Option(
            "--database-url",
            envvar=DATABASE_URL,
            help="A PostgreSQL server (any database on it): the run creates its own database.",
        ),
    ] = "postgresql://postgres@127.0.0.1:5432/postgres",
    workers: Annotated[int, typer.Option("--workers", min=1)] = 4,
    duration: Annotated[float, typer.Option("--duration", min=1.0, help="Seconds.")] = 30.0,
    kill_workers: Annotated[
        int | None,
        typer.Option(
            "--kill-workers", min=0, help="Workers SIGKILLed mid-run (0; failover profile: 2)."
        ),
    ] = None,
    restart_postgres: Annotated[bool, typer.Option("--restart-postgres")] = False,
    runners: Annotated[int, typer.Option("--runners", min=2)] = 6,
    sandboxes: Annotated[int, typer.Option("--sandboxes", min=1)] = 120,
    seed: Annotated[int, typer.Option("--seed")] = 7,
    profile: Annotated[
        str,
        typer.Option(
            "--profile",
            help=(
                "standard (well-behaved clients, roomy runners), adversarial, or failover "
                "(two cells, a leader lost mid-run)."
            ),
        ),
    ] = "standard",
    batching: Annotated[
        str,
        typer.Option(
            "--batching",
            help=(
                "on: each worker schedules groups of its sandboxes at once, committed "
                "together by the placement batcher (as in production); off: one placement "
                "per transaction."
            ),
        ),
    ] = "on",
    keep: Annotated[bool, typer.Option("--keep", help="Keep the database afterwards.")] = False,
    log_dir: Annotated[
        str | None,
        typer.Option(
            "--log-dir",
            "--journal-dir",
            help=(
                "Where the workers' journals and logs go (default: a new temporary "
                "directory; the run prints where)."
            ),
        ),
    ] = None,
    promote: Annotated[
        str,
        typer.Option(
            "--promote",
            help="failover profile: patroni (Patroni over etcd promotes) or manual (pg_ctl).",
        ),
    ] = "patroni",
    replication: Annotated[
        str,
        typer.Option(
            "--replication", help="failover profile: sync (synchronous standbys) or async."
        ),
    ] = "sync",
    as_json: JsonOutput = False,
) -> None:
    from pathlib import Path

    if profile == "failover":
        kills = 2 if kill_workers is None else kill_workers
        failover(duration, workers, kills, promote, replication, seed, log_dir, as_json)
        return

    from secondbox_scheduler.infrastructure.tools.fault_injection import (
        FaultRunConfig,
        run_fault_injection,
    )

    err = Console(stderr=True, highlight=False)
    if batching not in ("on", "off"):
        raise CommandError(f"--batching must be on or off, not {batching!r}")
    config = FaultRunConfig(
        database_url=database_url, workers=workers, duration=duration, runners=runners,
        sandboxes=sandboxes, kill_workers=kill_workers or 0, restart_postgres=restart_postgres,
        seed=seed, keep=keep, log_dir=Path(log_dir) if log_dir else None, profile=profile,
        batching=batching == "on",
    )  # fmt: skip
    with reported_errors(), store_errors(database_url):
        try:
            report = run_fault_injection(config, say=(lambda _: None) if as_json else err.print)
        except ValueError as error:
            raise CommandError(str(error)) from None
    if as_json:
        print_json(report.to_dict())
    else:
        console = stdout()
        for key, value in report.to_dict().items():
            if key != "violations":
                console.print(f"{key:<24} {value}")
        for violation in report.violations:
            console.print(f"[red]violation[/red] {escape(violation)}")
        console.print("[green]OK[/green]" if report.ok else "[red]FAILED[/red]")
    if not report.ok:
        raise typer.Exit(1)


def failover(
    duration: float, workers: int, kill_workers: int, promote: str, replication: str,
    seed: int, log_dir: str | None, as_json: bool,
) -> None:  # fmt: skip
    """``verify --profile failover`` (infrastructure/tools/fault_injection/failover_run.py)."""
    from pathlib import Path

    from secondbox_scheduler.infrastructure.tools.fault_injection.failover_run import (
        PROMOTIONS,
        REPLICATIONS,
        FailoverConfig,
        run_failover,
    )

    if promote not in PROMOTIONS:
        raise CommandError(f"--promote must be one of {', '.join(PROMOTIONS)}, not {promote!r}")
    if replication not in REPLICATIONS:
        raise CommandError(
            f"--replication must be one of {', '.join(REPLICATIONS)}, not {replication!r}"
        )
    err = Console(stderr=True, highlight=False)
    config = FailoverConfig(
        duration=duration, workers=max(2, workers), kill_workers=kill_workers,
        promote=promote, replication=replication, seed=seed,
        log_dir=Path(log_dir) if log_dir else None,
    )  # fmt: skip
    with reported_errors():
        try:
            report = run_failover(config, say=(lambda _: None) if as_json else err.print)
        except RuntimeError as error:  # a missing binary, a cluster that did not start
            raise CommandError(str(error)) from None
    if as_json:
        print_json(report.to_dict())
    else:
        console = stdout()
        for key, value in report.to_dict().items():
            if key not in ("violations", "audit", "lost"):
                console.print(f"{key:<38} {value}", highlight=False)
        for name, audit in report.audit.items():
            console.print(f"audit of cell {name:<24} {'ok' if audit['ok'] else audit}")
        for violation in report.violations:
            console.print(f"[red]violation[/red] {escape(violation)}")
        console.print("[green]OK[/green]" if report.ok else "[red]FAILED[/red]")
    if not report.ok:
        raise typer.Exit(1)
