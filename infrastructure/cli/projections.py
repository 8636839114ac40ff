"""The ``projections`` command group: keep the read models current, show their lag, rebuild
them, verify them against a fold of the log."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    open_store,
    print_json,
    reported_errors,
    stdout,
    store_env,
    store_errors,
)
from secondbox_scheduler.infrastructure.exit_codes import CommandError
from secondbox_scheduler.infrastructure.read_model_verify import VerifyReport, verify_read_models
from secondbox_scheduler.infrastructure.settings import (
    DEFAULT_SQLITE_URL,
    POSTGRES_MODULE,
    settings_from_url,
)
from secondbox_scheduler.projections.read_models import (
    ProjectionStatus,
    ReadModels,
    projection_runners,
    rebuild,
)

projections_cli = typer.Typer(
    help=(
        "Read models (runner snapshots, assignments) kept in tables beside the events, "
        "each row change committed with its tracking position (applied exactly once). "
        "See docs/architecture.md."
    ),
    no_args_is_help=True,
)


def _read_models(database_url: str) -> tuple[SchedulerApplication, ReadModels]:
    app = open_store(database_url)
    if app.read_models is None:
        raise CommandError("read models need a SQLite or PostgreSQL store")
    return app, app.read_models


def _status_table(statuses: list[ProjectionStatus]) -> Table:
    """Position, head and lag of each projection; with a column of the events of unknown
    classes when some projection met any (by topic: not projected, see
    projections/unknown_events.py)."""
    unknown = any(status.unknown_events for status in statuses)
    errors = any(status.error for status in statuses)
    table = Table(title="Projections", box=box.SIMPLE)
    for column in ("projection", "position", "head", "lag (events)"):
        table.add_column(column, justify="left" if column == "projection" else "right")
    if unknown:
        table.add_column("unknown events (not projected)", style="red")
    if errors:
        table.add_column("error", style="red")
    for status in statuses:
        row = [status.name, f"{status.position:,}", f"{status.head:,}", f"{status.lag_events:,}"]
        if unknown:
            row.append(
                ", ".join(f"{topic} {n:,}" for topic, n in status.unknown_events.items()) or "-"
            )
        if errors:
            row.append(status.error or "-")
        table.add_row(*row)
    return table


@projections_cli.command(
    "status",
    help=(
        "Each projection's tracking position, the log's head, and how many events it has "
        "still to apply.\n\n[bold]Example[/bold]\n\n  secondbox-scheduler projections status"
    ),
)
def projections_status(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL, as_json: JsonOutput = False
) -> None:
    with reported_errors(), store_errors(database_url):
        app, read_models = _read_models(database_url)
        statuses = read_models.status()
        app.close()
    if as_json:
        print_json([status.to_dict() for status in statuses])
    else:
        stdout().print(_status_table(statuses))


@projections_cli.command(
    "verify",
    help=(
        "Compare every read model, row by row, with a fold of the log (the Runner and "
        "RunnerLease aggregates of every registered runner; every generation's assignment "
        "of every sandbox), after catching them up; name each difference (read model, "
        "runner or sandbox/generation, field, both values). Exits 0 when they are equal, 1 "
        "when a difference is found (repair: projections rebuild).\n\n"
        "[bold]Example[/bold]\n\n  secondbox-scheduler projections verify --json"
    ),
)
def projections_verify(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL, as_json: JsonOutput = False
) -> None:
    with reported_errors(), store_errors(database_url):
        app, read_models = _read_models(database_url)
        try:
            report = verify_read_models(app, read_models)
        finally:
            app.close()
    if as_json:
        print_json(report.to_dict())
    else:
        _print_verify(report)
    if not report.equal:
        raise typer.Exit(1)


def _print_verify(report: VerifyReport) -> None:
    console = stdout()
    compared = (
        f"{report.runners:,} runners and {report.assignments:,} assignments "
        f"(log head {report.head:,})"
    )
    if report.equal:
        console.print(f"read models equal the fold of the log: {compared}")
        return
    table = Table(title="Read model differences", box=box.SIMPLE)
    for column in ("read model", "row", "field", "read model value", "folded value"):
        table.add_column(column, overflow="fold")
    for difference in report.differences:
        table.add_row(
            difference.read_model,
            escape(difference.key),
            difference.field,
            escape(repr(difference.read_model_value)),
            escape(repr(difference.folded_value)),
        )
    console.print(table)
    console.print(
        f"{len(report.differences):,} differences over {compared}; "
        "repair: secondbox-scheduler projections rebuild"
    )


@projections_cli.command(
    "rebuild",
    help=(
        "Forget both read models and apply the whole log again from position zero, with "
        "progress; ends with events per second beside the raw rate of reading the same "
        "notifications with the recorder alone, measured in the same run.\n\n"
        "[bold]Example[/bold]\n\n  secondbox-scheduler projections rebuild"
    ),
)
def projections_rebuild(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL, as_json: JsonOutput = False
) -> None:
    with reported_errors(), store_errors(database_url):
        app, read_models = _read_models(database_url)
        total = app.event_count()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=as_json,
            transient=True,
        ) as bar:
            raw = bar.add_task("raw read", total=total)
            task = bar.add_task("rebuild", total=total)
            report = rebuild(
                read_models,
                progress=lambda n: bar.advance(task, n),
                raw_progress=lambda n: bar.advance(raw, n),
            )
        statuses = read_models.status()
        app.close()
    if as_json:
        print_json({**report.to_dict(), "projections": [s.to_dict() for s in statuses]})
        return
    console = stdout()
    console.print(
        f"rebuilt {len(statuses)} projections from {report.events:,} events in "
        f"{report.seconds:.2f}s: [bold]{report.events_per_second:,.0f} events/s[/bold]"
    )
    console.print(
        f"raw notification read of the same log: {report.raw_read_seconds:.2f}s, "
        f"{report.raw_events_per_second:,.0f} events/s "
        f"(rebuild at {report.to_dict()['ratio_to_raw_read']} of the raw rate)"
    )
    console.print(_status_table(statuses))


@projections_cli.command(
    "run",
    help=(
        "Keep the read models current until interrupted (Ctrl-C). On PostgreSQL it follows "
        "the log live with eventsourcing's ProjectionRunner (LISTEN/NOTIFY); SQLite has no "
        "subscriptions, so it catches up every --poll seconds. Run it when the applications "
        "use SECONDBOX_READ_MODELS=external.\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler projections run\n"
        "  secondbox-scheduler projections run --once"
    ),
)
def projections_run(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    poll: Annotated[
        float, typer.Option("--poll", min=0.01, help="SQLite: seconds between catch-ups.")
    ] = 0.5,
    once: Annotated[bool, typer.Option("--once", help="Catch up once, then exit.")] = False,
) -> None:
    err = Console(stderr=True, highlight=False)
    with reported_errors(), store_errors(database_url):
        app, read_models = _read_models(database_url)
        env = {**store_env(database_url), **settings_from_url(database_url)}
        try:
            if once:
                applied = read_models.catch_up()
                err.print(f"applied {applied:,} notifications; now at {read_models.status()}")
                return
            if env["PERSISTENCE_MODULE"] == POSTGRES_MODULE:
                read_models.catch_up()
                runners = projection_runners(SchedulerApplication, env)
                err.print("following the log live (Ctrl-C to stop)")
                try:
                    while True:
                        for runner in runners:
                            runner.run_forever(timeout=poll)
                finally:
                    for runner in runners:
                        runner.__exit__(None, None, None)
            err.print(f"catching up every {poll}s (Ctrl-C to stop)")
            while True:
                read_models.catch_up()
                time.sleep(poll)
        except KeyboardInterrupt:
            err.print("stopped")
        finally:
            app.close()
