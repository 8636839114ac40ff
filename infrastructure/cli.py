"""The ``secondbox-scheduler`` command line: simulate a fleet, inspect runners and assignments.

Every command reads the store named by ``--database-url`` (or the
``SECONDBOX_DATABASE_URL`` environment variable), prints rich tables for people or,
with ``--json``, JSON only on stdout. A refusal of the scheduler (any
:class:`~domain.errors.SchedulerError`) or an unreachable store is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import typer
from eventsourcing.persistence import PersistenceError
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

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    DEFAULT_SQLITE_URL,
    POSTGRES_MODULE,
    settings_from_url,
)
from secondbox_scheduler.infrastructure.simulation import (
    ATTEMPTS_PER_CYCLE,
    HEARTBEAT_TIMEOUT,
    DimensionUse,
    SimulationConfig,
    SimulationResult,
    run_simulation,
    sqlite_path,
)
from secondbox_scheduler.projections.read_models import (
    ProjectionStatus,
    ReadModels,
    projection_runners,
    rebuild,
)

GIB = 2**30
EXIT_REFUSED = 2
PIPE_WIDTH = 160
CONNECT_TIMEOUT = "POSTGRES_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_SECONDS = "10"

cli = typer.Typer(
    name="secondbox-scheduler",
    help=(
        "Event-sourced scheduler of the SecondBox sandbox platform: placement, capacity "
        "reservation and fenced assignment authority.\n\n"
        "Start with [bold]secondbox-scheduler simulate[/bold] to fill ./secondbox.db with a "
        "seeded fleet, then look at it with [bold]runners[/bold] and [bold]assignments[/bold]."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)

DatabaseUrl = Annotated[
    str,
    typer.Option(
        "--database-url",
        envvar=DATABASE_URL,
        help=(
            "Store to use: sqlite:///relative.db, sqlite:////absolute/path.db or "
            "postgresql://user:pass@host:port/db."
        ),
    ),
]
JsonOutput = Annotated[
    bool,
    typer.Option("--json", help="Print machine-readable JSON on stdout and nothing else."),
]


class CommandError(Exception):
    """A problem of the command's input or environment, reported as one line."""


def _fail(message: str) -> NoReturn:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/bold red] {message}", markup=True
    )
    raise typer.Exit(EXIT_REFUSED)


@contextmanager
def _reported_errors() -> Iterator[None]:
    """Turn expected failures into one line on stderr and exit code 2 (no traceback)."""
    try:
        yield
    except (SchedulerError, CommandError) as error:
        _fail(escape(str(error)))
    except PersistenceError as error:
        _fail(escape(f"database error: {type(error).__name__}: {error}"))


@contextmanager
def _store_errors(database_url: str) -> Iterator[None]:
    """Name the store (password hidden) in a database error."""
    try:
        yield
    except PersistenceError as error:
        detail = f"{type(error).__name__}: {error}".strip()
        raise CommandError(f"database error on {redact(database_url)}: {detail}") from None


def redact(database_url: str) -> str:
    """The URL with its password replaced by ***."""
    parts = urlsplit(database_url)
    if not parts.password:
        return database_url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def store_env(database_url: str) -> dict[str, str]:
    """Application settings for the store; a PostgreSQL connect timeout unless one is set."""
    env = {DATABASE_URL: database_url}
    if CONNECT_TIMEOUT not in os.environ:
        env[CONNECT_TIMEOUT] = DEFAULT_CONNECT_TIMEOUT_SECONDS
    return env


def _open_store(database_url: str, *, must_exist: bool = True) -> SchedulerApplication:
    path = sqlite_path(database_url)
    if must_exist and path is not None and not path.exists():
        raise CommandError(
            f"no database at {path} ({database_url}); run `secondbox-scheduler simulate` "
            "first or pass --database-url"
        )
    with _store_errors(database_url):
        return SchedulerApplication(env=store_env(database_url))


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def _stdout() -> Console:
    """Tables for people: the terminal's width, or wide enough not to fold when piped."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, PIPE_WIDTH))
    return console


# -- simulate ----------------------------------------------------------------------------


SIMULATE_HELP = (
    "Run a seeded, deterministic fleet simulation and print what the scheduler did.\n\n"
    "Registers a fleet of runners (3 pools, x86_64 and aarch64; most fully capable, a few "
    "lacking a capability, a guest protocol or a materialization), heartbeats them on a "
    "simulated clock, creates sandboxes from a few profile revisions per pool and runs "
    "start/stop cycles with random arrivals: schedule (a fenced assignment), mark running, "
    "release with proof, advance the generation, schedule again.\n\n"
    "Part-way through one runner is drained (the drain is cancelled later) and another stops "
    "heartbeating, so restarts homed there are refused with the reason codes draining and "
    "heartbeat_stale.\n\n"
    "A reconciler runs every simulated minute: a few starts are never reported running, so "
    "it fails them with deadline_exceeded (redelivered while retries remain, then failed "
    "terminally); the stale runner's assignments become uncertain and keep their "
    "reservations; an operator releases failed and uncertain assignments by hand with "
    "proof. Half-way a second, scripted reconciler races it for claims.\n\n"
    "Prints placements, replays, refusals by error and by reason code, reconcile passes and "
    "actions, manual releases, assignments by final state, utilisation per pool and per "
    "runner (at the end and peak), contention retries, heartbeats recorded and coalesced, "
    "events written and the wall time. Defaults finish in well under a minute on SQLite."
)
EXAMPLES_SIMULATE = (
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler simulate\n"
    "  secondbox-scheduler simulate --seed 11 --runners 12 --sandboxes 40 --json\n"
    "  secondbox-scheduler simulate --database-url sqlite:////tmp/fleet.db --no-fresh"
)


@cli.command(
    help=SIMULATE_HELP,
    short_help="Run a seeded fleet simulation and summarise it.",
    epilog=EXAMPLES_SIMULATE,
)
def simulate(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    seed: Annotated[
        int, typer.Option(help="Seed of every random choice: same seed, same run.")
    ] = 7,
    runners: Annotated[
        int, typer.Option(min=3, help="Runners in the fleet, split over 3 pools.")
    ] = 36,
    sandboxes: Annotated[int, typer.Option(min=1, help="Sandboxes to create.")] = 200,
    cycles: Annotated[
        int,
        typer.Option(
            min=1,
            help=(
                "Start/stop cycles per sandbox: started this many times, released and moved "
                "to its next generation between starts, left running after the last."
            ),
        ),
    ] = 3,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh/--no-fresh",
            help=(
                "Delete the SQLite database file first, so reruns are reproducible. "
                "--no-fresh appends to the store; ids are then prefixed so they never collide."
            ),
        ),
    ] = True,
    json_output: JsonOutput = False,
) -> None:
    config = SimulationConfig(
        database_url=database_url,
        seed=seed,
        runners=runners,
        sandboxes=sandboxes,
        cycles=cycles,
        fresh=fresh,
    )
    err = Console(stderr=True, highlight=False)
    with _reported_errors():
        if fresh and not database_url.lower().startswith("sqlite"):
            err.print(
                "note: --fresh only deletes SQLite files; this store is appended to "
                "(ids get a run prefix when it is not empty)"
            )
        columns = (
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        show = not json_output and err.is_terminal
        with Progress(*columns, console=err, disable=not show, transient=True) as progress:
            task = progress.add_task("simulating start cycles", total=sandboxes * cycles)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            with _store_errors(database_url):
                result = run_simulation(config, progress=advance, env=store_env(database_url))
    if json_output:
        _print_json(result.to_dict())
    else:
        print_summary(result, _stdout())


def _gib(amount: int) -> str:
    return f"{amount / GIB:,.0f}"


def _use_cell(use: DimensionUse, scale: int = 1) -> str:
    """``reserved/allocatable percent``, then ``^peak%`` when the peak was higher."""
    if scale == 1:
        cell = f"{use.reserved}/{use.allocatable}"
    else:
        cell = f"{_gib(use.reserved)}/{_gib(use.allocatable)}"
    cell = f"{cell} {use.percent:3.0f}%"
    if use.peak > use.reserved:
        cell += f" ^{use.peak_percent:.0f}%"
    return cell


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def print_summary(result: SimulationResult, console: Console) -> None:
    """The human summary of one simulation."""
    console.print(
        f"[bold]SecondBox scheduler simulation[/bold]: seed {result.seed}, "
        f"{result.runners} runners, {result.sandboxes} sandboxes, {result.cycles} cycles, "
        f"{result.database_url}"
    )
    overview = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    overview.add_column("what", style="bold")
    overview.add_column("value")
    created = result.sandboxes_created
    heartbeats = result.heartbeats
    reconcile = result.reconcile
    actions = reconcile.actions
    rows = [
        (
            "simulated time",
            f"{_duration(result.simulated_seconds)} (heartbeat timeout "
            f"{HEARTBEAT_TIMEOUT.total_seconds():.0f}s)",
        ),
        (
            "sandboxes created",
            f"{created} of {result.sandboxes} ({result.sandboxes - created} refused)",
        ),
        ("start attempts", str(result.start_attempts)),
        ("placements", str(result.placements)),
        ("replays", f"{result.replays} (duplicate schedule requests answered idempotently)"),
        (
            "releases",
            f"{result.releases} reported by the runners "
            f"(generations advanced {result.generations_advanced})",
        ),
        ("transient failures", str(result.transient_failures)),
        ("late fences rejected", f"{result.late_fences_rejected} (stale generation or token)"),
        (
            "cycles abandoned",
            f"{result.cycles_abandoned} (start refused {ATTEMPTS_PER_CYCLE} times)",
        ),
        ("running at the end", str(result.running_at_end)),
        (
            "unreported starts",
            f"{result.starts_unreported} (never reported running within "
            f"{reconcile.operation_deadline_seconds:.0f}s; "
            f"{result.redelivered_starts_running} ran after a redelivery)",
        ),
        (
            "reconcile passes",
            f"{reconcile.passes} in {reconcile.rounds} rounds every "
            f"{reconcile.interval_seconds:.0f}s ({reconcile.due} due found)",
        ),
        (
            "assignments reconciled",
            f"{reconcile.reconciled} ("
            + ", ".join(f"{n} by {owner}" for owner, n in reconcile.reconciled_by.items())
            + ")",
        ),
        (
            "reconcile actions",
            f"deadline_exceeded {actions.get('deadline_exceeded', 0)} "
            f"({reconcile.redeliveries} redelivered, "
            f"{reconcile.terminal_failures} terminal failures), "
            f"uncertain {actions.get('uncertain', 0)}, none {actions.get('none', 0)}",
        ),
        (
            "reconcile claims",
            f"{reconcile.held_by_others} held by another reconciler, "
            f"{reconcile.claims_lost} lost before the commit",
        ),
        (
            "manual releases",
            f"{result.manual_releases} with operator proof ("
            + ", ".join(f"{n} {state}" for state, n in result.manual_releases_by_state.items())
            + ")",
        ),
        (
            "assignments by state",
            ", ".join(f"{state} {n}" for state, n in result.assignment_states.items()),
        ),
        (
            "drained runner",
            f"{result.drained_runner or '-'} "
            f"({'drain cancelled later' if result.drain_cancelled else 'still draining'})",
        ),
        ("stale runner", f"{result.stale_runner or '-'} (stopped heartbeating)"),
        ("contention retries", f"{result.contention_retries} ({result.contention_errors} gave up)"),
        (
            "heartbeats",
            f"{heartbeats.get('sent', 0)} sent: {heartbeats.get('recorded', 0)} "
            f"recorded, {heartbeats.get('coalesced', 0)} coalesced, "
            f"{heartbeats.get('stale', 0)} out of order",
        ),
        ("events written", f"{result.events_written} ({result.events_in_store} in the store)"),
        (
            "ledger check",
            "reservations match the store and the unreleased assignments"
            if result.ledger_matches_store
            else "[red]reservations DIFFER from the store[/red]",
        ),
        ("wall time", f"{result.wall_seconds:.2f}s"),
    ]
    for name, value in rows:
        overview.add_row(name, value)
    console.print(overview)

    refusals = Table(title="Refusals by error", box=box.SIMPLE_HEAD, title_justify="left")
    refusals.add_column("operation")
    refusals.add_column("error")
    refusals.add_column("count", justify="right")
    for operation, by_type in result.refusals.items():
        for error, count in by_type.items():
            refusals.add_row(operation, error, str(count))
    if not refusals.row_count:
        refusals.add_row("-", "none", "0")
    console.print(refusals)

    reasons = Table(title="Refusals by reason code", box=box.SIMPLE_HEAD, title_justify="left")
    reasons.add_column("reason code")
    reasons.add_column("schedule (home runner)", justify="right")
    reasons.add_column("create_sandbox (runners refusing)", justify="right")
    schedule = result.refusal_reasons.get("schedule", {})
    create = result.refusal_reasons.get("create_sandbox", {})
    for code in dict.fromkeys([*schedule, *create]):
        reasons.add_row(code, str(schedule.get(code, 0)), str(create.get(code, 0)))
    console.print(reasons)

    pools = Table(
        title="Utilisation per pool at the end (^ peak when higher)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for name in ("pool", "runners", "vCPU", "memory GiB", "instances"):
        pools.add_column(name, justify="left" if name == "pool" else "right")
    for pool in result.pools:
        pools.add_row(
            pool.pool_name,
            str(pool.runners),
            _use_cell(pool.vcpu_count),
            _use_cell(pool.memory_bytes, GIB),
            _use_cell(pool.instances),
        )
    console.print(pools)

    per_runner = Table(
        title="Utilisation per runner at the end (^ peak when higher)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for name in ("runner", "arch", "state"):
        per_runner.add_column(name)
    for name in ("vCPU", "memory GiB", "instances"):
        per_runner.add_column(name, justify="right")
    for use in result.runner_use:
        state = use.drain_phase if use.heartbeat == "live" else f"{use.drain_phase}, stale"
        per_runner.add_row(
            use.runner_id,
            use.architecture,
            state,
            _use_cell(use.vcpu_count),
            _use_cell(use.memory_bytes, GIB),
            _use_cell(use.instances),
        )
    console.print(per_runner)


# -- runners ------------------------------------------------------------------------------


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")


def _pair(reserved: int, allocatable: int, scale: int = 1) -> str:
    if scale == 1:
        return f"{reserved}/{allocatable}"
    return f"{_gib(reserved)}/{_gib(allocatable)}"


RUNNERS_HELP = (
    "List registered runners: pool, architecture, backend, drain phase, last heartbeat and "
    "reserved/allocatable vCPU, memory and instances.\n\n"
    "With --json each runner is a full RunnerSnapshot (capabilities, materializations, egress "
    "contexts, every capacity dimension)."
)
EXAMPLES_RUNNERS = (
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler runners\n"
    "  secondbox-scheduler runners --pool edge\n"
    "  secondbox-scheduler runners --json | jq '.[] | {id, drain_phase}'"
)


@cli.command(
    "runners",
    help=RUNNERS_HELP,
    short_help="List runners with drain phase, heartbeat and capacity.",
    epilog=EXAMPLES_RUNNERS,
)
def list_runners(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    pool: Annotated[
        str | None, typer.Option("--pool", help="Only the runners of this pool.")
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    with _reported_errors():
        app = _open_store(database_url)
        try:
            with _store_errors(database_url):
                snapshots = app.runner_snapshots(pool)
        finally:
            app.close()
    if json_output:
        _print_json([snapshot.model_dump(mode="json") for snapshot in snapshots])
        return
    _stdout().print(runner_table(snapshots, pool))


def runner_table(snapshots: list[RunnerSnapshot], pool: str | None = None) -> Table:
    title = f"Runners of pool {pool}" if pool else "Runners"
    table = Table(title=f"{title} ({len(snapshots)})", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("id", "pool", "arch", "backend", "drain", "last heartbeat"):
        table.add_column(name)
    for name in ("vCPU", "memory GiB", "instances"):
        table.add_column(name, justify="right")
    for runner in snapshots:
        reserved, allocatable = runner.reserved, runner.allocatable
        table.add_row(
            runner.id,
            runner.pool_name,
            runner.architecture,
            runner.backend_kind or "-",
            runner.drain_phase,
            _time(runner.last_heartbeat_at),
            _pair(reserved.vcpu_count, allocatable.vcpu_count),
            _pair(reserved.memory_bytes, allocatable.memory_bytes, GIB),
            _pair(reserved.instances, allocatable.instances),
        )
    return table


# -- assignments ----------------------------------------------------------------------------


def assignment_json(assignment: DurableAssignment) -> dict[str, Any]:
    """A DurableAssignment as JSON, the fencing token as hex."""
    data = assignment.model_dump(mode="json", exclude={"fencing_token"})
    return {
        name: assignment.fencing_token.hex() if name == "fencing_token" else data[name]
        for name in DurableAssignment.model_fields
    }


ASSIGNMENTS_HELP = (
    "Show the fenced assignments of one sandbox (every generation) or of one runner (those "
    "still holding its capacity). Give exactly one of --sandbox or --runner.\n\n"
    "With --json each assignment is a full DurableAssignment; the fencing token is hex."
)
EXAMPLES_ASSIGNMENTS = (
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler assignments --sandbox sbx-0001\n"
    "  secondbox-scheduler assignments --runner general-01 --json"
)


@cli.command(
    help=ASSIGNMENTS_HELP,
    short_help="Show the assignments of a sandbox or of a runner.",
    epilog=EXAMPLES_ASSIGNMENTS,
)
def assignments(
    sandbox: Annotated[
        str | None,
        typer.Option("--sandbox", help="Every generation's assignment of this sandbox."),
    ] = None,
    runner: Annotated[
        str | None,
        typer.Option("--runner", help="The assignments holding a reservation on this runner."),
    ] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    json_output: JsonOutput = False,
) -> None:
    if (sandbox is None) == (runner is None):
        raise typer.BadParameter(
            "give exactly one of --sandbox ID or --runner ID",
            param_hint="'--sandbox' / '--runner'",
        )
    with _reported_errors():
        app = _open_store(database_url)
        try:
            with _store_errors(database_url):
                if sandbox is not None:
                    found = app.assignments(sandbox)
                    title = f"Assignments of sandbox {sandbox}"
                else:
                    assert runner is not None
                    found = app.runner_assignments(runner)
                    title = f"Assignments holding runner {runner}"
        finally:
            app.close()
    if json_output:
        _print_json([assignment_json(assignment) for assignment in found])
        return
    _stdout().print(assignment_table(found, f"{title} ({len(found)})"))


def assignment_table(found: list[DurableAssignment], title: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("sandbox", "gen", "state", "runner", "fencing token"):
        table.add_column(name)
    for name in ("vCPU", "memory GiB", "retries"):
        table.add_column(name, justify="right")
    table.add_column("created")
    table.add_column("updated")
    for assignment in found:
        table.add_row(
            assignment.sandbox_id,
            str(assignment.generation),
            assignment.state,
            assignment.runner_id,
            assignment.fencing_token.hex()[:16] + "…",
            str(assignment.capacity.vcpu_count),
            _gib(assignment.capacity.memory_bytes),
            f"{assignment.retry_count}/{assignment.retry_limit}",
            _time(assignment.created_at),
            _time(assignment.updated_at),
        )
    return table


# -- projections ---------------------------------------------------------------------------

projections_cli = typer.Typer(
    help=(
        "Read models (runner snapshots, assignments) kept in tables beside the events, "
        "each row change committed with its tracking position (applied exactly once). "
        "See docs/architecture.md."
    ),
    no_args_is_help=True,
)
cli.add_typer(projections_cli, name="projections")


def _read_models(database_url: str) -> tuple[SchedulerApplication, ReadModels]:
    app = _open_store(database_url)
    if app.read_models is None:
        raise CommandError("read models need a SQLite or PostgreSQL store")
    return app, app.read_models


def _status_table(statuses: list[ProjectionStatus]) -> Table:
    table = Table(title="Projections", box=box.SIMPLE)
    for column in ("projection", "position", "head", "lag (events)"):
        table.add_column(column, justify="left" if column == "projection" else "right")
    for status in statuses:
        table.add_row(
            status.name, f"{status.position:,}", f"{status.head:,}", f"{status.lag_events:,}"
        )
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
    with _reported_errors(), _store_errors(database_url):
        app, read_models = _read_models(database_url)
        statuses = read_models.status()
        app.close()
    if as_json:
        _print_json([status.to_dict() for status in statuses])
    else:
        _stdout().print(_status_table(statuses))


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
    with _reported_errors(), _store_errors(database_url):
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
        _print_json({**report.to_dict(), "projections": [s.to_dict() for s in statuses]})
        return
    console = _stdout()
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
    with _reported_errors(), _store_errors(database_url):
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


# -- audit -------------------------------------------------------------------------------

audit_cli = typer.Typer(
    help=(
        "Audit replay of the scheduling history from the events alone: verify every "
        "invariant, show the state at any point, timelines, and why each placement was "
        "made. See docs/audit.md."
    ),
    no_args_is_help=True,
)
cli.add_typer(audit_cli, name="audit")
UntilOption = Annotated[
    str | None,
    typer.Option(
        "--until", help="Stop at a notification POSITION or at the first event after an ISO TIME."
    ),
]


@audit_cli.command(
    "verify",
    help=(
        "Replay the whole notification log through a pure fold (no cache, no projection) and "
        "check invariants 1 to 6 after every event, and every placement against the "
        "reconstructed runner state and its recorded evidence. Exits 1 listing each "
        "violation (position, aggregate, event, rule).\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler audit verify\n"
        "  secondbox-scheduler audit verify --until 2026-11-29T12:00:00Z --json"
    ),
)
def audit_verify(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    until: UntilOption = None,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit_replay import parse_until, verify

    with _reported_errors(), _store_errors(database_url):
        app = _open_store(database_url)
        limit = parse_until(until)
        total = app.event_count()
        with Progress(
            TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(stderr=True), disable=as_json, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("verify", total=total)
            report = verify(app, limit, progress=lambda n: bar.advance(task, n))
        app.close()
    if as_json:
        _print_json(report.to_dict())
    else:
        console = _stdout()
        for violation in report.violations:
            console.print(f"[red]violation[/red] {escape(str(violation))}")
        verdict = (
            "[green]OK[/green]"
            if report.ok
            else f"[red]{len(report.violations)} violation(s)[/red]"
        )
        console.print(
            f"{verdict}: {report.events:,} events checked up to position {report.position:,} in "
            f"{report.seconds:.2f}s ({report.events_per_second:,.0f} events/s; raw notification "
            f"read {report.raw_events_per_second:,.0f} events/s)"
        )
    if not report.ok:
        raise typer.Exit(1)


@audit_cli.command(
    "state",
    help=(
        "Every runner snapshot and assignment as they stood at a notification position or a "
        "time.\n\n[bold]Example[/bold]\n\n  secondbox-scheduler audit state --at 5000"
    ),
)
def audit_state(
    at: Annotated[str, typer.Option("--at", help="POSITION or ISO TIME.")],
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit_replay import parse_until, state_at

    with _reported_errors(), _store_errors(database_url):
        app = _open_store(database_url)
        state = state_at(app, parse_until(at))
        app.close()
    if as_json:
        _print_json({
            "position": state.position,
            "runners": [r.to_record() for r in state.runners],
            "assignments": [assignment_json(a) for a in state.assignments],
        })  # fmt: skip
        return
    console = _stdout()
    console.print(f"state at position {state.position:,}")
    console.print(runner_table(state.runners))
    console.print(assignment_table(state.assignments, f"Assignments ({len(state.assignments)})"))


@audit_cli.command(
    "timeline",
    help=(
        "One sandbox's history (with its refused placements) or one runner's (with its "
        "heartbeat lease), in time order.\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler audit timeline --sandbox sbx-0001\n"
        "  secondbox-scheduler audit timeline --runner general-01"
    ),
)
def audit_timeline(
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Sandbox id.")] = None,
    runner: Annotated[str | None, typer.Option("--runner", help="Runner id.")] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit_replay import timeline

    if (sandbox is None) == (runner is None):
        raise typer.BadParameter("give exactly one of --sandbox ID or --runner ID")
    with _reported_errors(), _store_errors(database_url):
        app = _open_store(database_url)
        entries = timeline(app, sandbox_id=sandbox, runner_id=runner)
        app.close()
    if as_json:
        _print_json([entry.to_dict() for entry in entries])
        return
    table = Table(
        title=f"Timeline of {'sandbox ' + str(sandbox) if sandbox else 'runner ' + str(runner)}",
        box=box.SIMPLE,
    )
    for column in ("time", "stream", "v", "event", "fields"):
        table.add_column(column)
    for entry in entries:
        fields = ", ".join(f"{k}={v}" for k, v in entry.fields.items())
        table.add_row(
            _time(entry.time), entry.stream, str(entry.version), entry.event, escape(fields)
        )
    _stdout().print(table)


@audit_cli.command(
    "explain",
    help=(
        "Why this sandbox's home runner, why each generation's runner, and why each refused "
        "placement: every candidate's reason codes and capacity shortfall, and a one-line "
        "summary in kube-scheduler's manner, from the evidence recorded at decision time."
        "\n\n[bold]Example[/bold]\n\n  secondbox-scheduler audit explain sbx-0001"
    ),
)
def audit_explain(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id.")],
    generation: Annotated[
        int | None, typer.Option("--generation", help="Only this generation.")
    ] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit_replay import explain

    with _reported_errors(), _store_errors(database_url):
        app = _open_store(database_url)
        explanation = explain(app, sandbox_id, generation)
        app.close()
    if as_json:
        _print_json(explanation.to_dict())
        return
    console = _stdout()
    console.print(f"[bold]sandbox {escape(sandbox_id)}[/bold]")
    for decision in explanation.decisions:
        console.print(
            f"\n[bold]{escape(decision.title)}[/bold] at {_time(decision.decided_at)} "
            f"(heartbeat timeout {decision.heartbeat_timeout_seconds:g}s)"
        )
        console.print(f"  {escape(decision.summary)}")
        for key, value in decision.detail.items():
            console.print(f"  {key}: {escape(str(value))}")
        for line in decision.candidates:
            reasons = "; ".join(
                r["code"] + (f" (short {r['shortfall']})" if r.get("shortfall") else "")
                for r in line.reasons
            )
            rank = ""
            if line.rank:
                rank = ", ".join(f"{k} {v:,}" for k, v in line.rank.items())
            console.print(f"  {line.runner_id:<16} {line.verdict:<26} {escape(reasons or rank)}")


# -- verify ------------------------------------------------------------------------------


@cli.command(
    "verify",
    help=(
        "Jepsen-style check of the scheduler's promises on PostgreSQL: N worker processes "
        "schedule, release, drain, heartbeat and reconcile concurrently over one fleet with "
        "hot spots, journaling every acknowledged result; random workers are SIGKILLed and "
        "restarted (--kill-workers), PostgreSQL may be restarted mid-run "
        "(--restart-postgres). Then: audit verify is clean, every acknowledged schedule is "
        "in the store unchanged, interrupted requests retried get the same assignment, and "
        "the read models equal a rebuild. Runs in a fresh database it creates (and drops "
        "unless --keep). Exits 1 on any violation.\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler verify --workers 4 --duration 60 --kill-workers 3\n"
        "  secondbox-scheduler verify --workers 4 --duration 300 --kill-workers 10 "
        "--restart-postgres"
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
    kill_workers: Annotated[int, typer.Option("--kill-workers", min=0)] = 0,
    restart_postgres: Annotated[bool, typer.Option("--restart-postgres")] = False,
    runners: Annotated[int, typer.Option("--runners", min=2)] = 6,
    sandboxes: Annotated[int, typer.Option("--sandboxes", min=1)] = 120,
    seed: Annotated[int, typer.Option("--seed")] = 7,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the database afterwards.")] = False,
    journal_dir: Annotated[
        str, typer.Option("--journal-dir", help="Where the workers' journals go.")
    ] = "verify-run",
    as_json: JsonOutput = False,
) -> None:
    from pathlib import Path

    from secondbox_scheduler.infrastructure.verify import VerifyConfig, run_verify

    err = Console(stderr=True, highlight=False)
    config = VerifyConfig(
        database_url=database_url, workers=workers, duration=duration, runners=runners,
        sandboxes=sandboxes, kill_workers=kill_workers, restart_postgres=restart_postgres,
        seed=seed, keep=keep, directory=Path(journal_dir),
    )  # fmt: skip
    with _reported_errors(), _store_errors(database_url):
        try:
            report = run_verify(config, say=(lambda _: None) if as_json else err.print)
        except ValueError as error:
            raise CommandError(str(error)) from None
    if as_json:
        _print_json(report.to_dict())
    else:
        console = _stdout()
        for key, value in report.to_dict().items():
            if key != "violations":
                console.print(f"{key:<24} {value}")
        for violation in report.violations:
            console.print(f"[red]violation[/red] {escape(violation)}")
        console.print("[green]OK[/green]" if report.ok else "[red]FAILED[/red]")
    if not report.ok:
        raise typer.Exit(1)


# -- lifecycle ---------------------------------------------------------------------------


@cli.command(
    "reconcile",
    help=(
        "Claim due assignments (from the assignments projection) and apply the reconcile "
        "policy: an assignment never reported running past its operation deadline fails "
        "with deadline_exceeded (redelivered while retries remain, else terminally failed); "
        "one whose home runner's heartbeat expired becomes uncertain (it keeps its "
        "reservation: its compute may still run). No relocation, no replacement. Then sets "
        "next_reconcile_at and releases the claim. Loops until interrupted; several "
        "reconcilers on one database never work the same assignment at the same time.\n\n"
        "[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler reconcile --once\n"
        "  secondbox-scheduler reconcile --owner reconciler-a --interval 30"
    ),
)
def reconcile(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    owner: Annotated[
        str | None, typer.Option("--owner", help="Claim owner name (default host-pid).")
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Reconcile until nothing is due, then exit.")
    ] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.001, help="Seconds until an assignment is due again."),
    ] = 60.0,
    claim_ttl: Annotated[
        float, typer.Option("--claim-ttl", min=0.001, help="Seconds a claim lasts.")
    ] = 30.0,
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            "--heartbeat-timeout",
            min=0.001,
            help="Seconds of heartbeat silence that make a runner's assignments uncertain.",
        ),
    ] = 30.0,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Due assignments per pass.")] = 100,
    poll: Annotated[
        float, typer.Option("--poll", min=0.01, help="Seconds between empty passes.")
    ] = 1.0,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.reconciler import Reconciler

    with _reported_errors(), _store_errors(database_url):
        app = _open_store(database_url)
        reconciler = Reconciler(
            app,
            owner,
            heartbeat_timeout=timedelta(seconds=heartbeat_timeout),
            claim_ttl=timedelta(seconds=claim_ttl),
            interval=timedelta(seconds=interval),
            batch=batch,
        )
        try:
            if once:
                reconciler.drain(poll=poll)
            else:
                reconciler.run(poll=poll)
        except KeyboardInterrupt:
            pass
        finally:
            app.close()
    report = reconciler.report.to_dict()
    if as_json:
        _print_json({"owner": reconciler.owner, **report})
    else:
        _stdout().print(f"reconciler {reconciler.owner}: {report}")


@cli.command(
    "release",
    help=(
        "Release an assignment's reservation by hand, with proof that its compute has "
        "stopped (for a failed or uncertain assignment whose runner will never report). "
        "Needs the current generation and fencing token; a repeat with the same proof "
        "changes nothing.\n\n[bold]Example[/bold]\n\n"
        "  secondbox-scheduler release --sandbox sbx-1 --generation 2 --token 3f… "
        "--proof operator=alice --proof reason=host-destroyed"
    ),
)
def release_by_hand(
    sandbox: Annotated[str, typer.Option("--sandbox", help="Sandbox id.")],
    generation: Annotated[int, typer.Option("--generation", help="Current generation.")],
    token: Annotated[str, typer.Option("--token", help="Fencing token, hex.")],
    proof: Annotated[
        list[str], typer.Option("--proof", help="Release proof entry KEY=VALUE (repeatable).")
    ],
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    entries = dict(item.split("=", 1) for item in proof if "=" in item)
    if len(entries) != len(proof):
        _fail("--proof takes KEY=VALUE")
    try:
        fencing_token = bytes.fromhex(token)
    except ValueError:
        _fail("--token must be hex")
    with _reported_errors(), _store_errors(database_url):
        app = _open_store(database_url)
        released = app.release(sandbox, generation, fencing_token, entries)
        app.close()
    if as_json:
        _print_json({"sandbox_id": sandbox, "generation": generation, "released": released})
    else:
        _stdout().print("released" if released else "already released with this proof")


# -- bench -------------------------------------------------------------------------------

BENCH_HELP = (
    "Benchmarks that print figures (never timed tests). See docs/performance.md.\n\n"
    "Without a subcommand: the scheduler benchmark. It creates a fresh database (a new "
    "database on the local PostgreSQL server, or a new schema in the database of "
    "--database-url, or a new SQLite file), dropped at the end unless --keep, and "
    "measures: (1) the raw eventsourcing baseline, new aggregates saved one and two per "
    "transaction by W worker processes; (2) placement throughput of W workers scheduling "
    "over R runners with spare capacity; (3) contention, 3,000 sandboxes homed on 4 runners; "
    "(4) select_runner and create_sandbox over 100, 1,000 and 10,000 runners; (5) loading "
    "a runner after 10, 1,000 and 100,000 events; (6) projection rebuild and audit verify "
    "against the raw notification read rate. Prints a table per measurement and each "
    "goal as met or not met.\n\n"
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler bench\n"
    "  secondbox-scheduler bench --quick --json\n"
    "  secondbox-scheduler bench --quick --database-url sqlite:////tmp/bench-new.db\n"
    "  secondbox-scheduler bench --only raw,placement --workers 2"
)

bench_cli = typer.Typer(help=BENCH_HELP, invoke_without_command=True)
cli.add_typer(bench_cli, name="bench")


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
            help="Comma-separated sections: raw,placement,contention,selection,history,replay.",
        ),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the benchmark's database for inspection.")
    ] = False,
    as_json: JsonOutput = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from secondbox_scheduler.infrastructure.bench import SECTIONS, BenchSettings, run_bench
    from secondbox_scheduler.infrastructure.bench_report import print_report
    from secondbox_scheduler.infrastructure.bench_workers import BenchError

    sections = SECTIONS if only is None else tuple(p.strip() for p in only.split(",") if p.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        _fail(f"--only takes sections among {', '.join(SECTIONS)}; got {only!r}")
    settings = BenchSettings.make(
        quick=quick, workers=workers, runners=runners, seed=seed, seconds=seconds,
        sections=sections,
    )  # fmt: skip
    err = Console(stderr=True, highlight=False)
    try:
        with _reported_errors():
            report = run_bench(
                settings,
                database_url,
                keep=keep,
                progress=(lambda _: None) if as_json else (lambda m: err.print(f"[dim]{m}…[/dim]")),
            )
    except BenchError as error:
        _fail(escape(str(error)))
    if as_json:
        _print_json(report)
    else:
        print_report(report, _stdout())


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
    from secondbox_scheduler.infrastructure.history_benchmark import measure_history

    try:
        wanted = [int(part) for part in sizes.split(",") if part.strip()]
    except ValueError:
        _fail(f"--sizes must be comma-separated integers, got {sizes!r}")
    if not wanted or min(wanted) < 1:
        _fail("--sizes needs at least one size of 1 or more")
    err = Console(stderr=True, highlight=False)
    with _reported_errors(), _store_errors(database_url):
        rows = measure_history(
            store_env(database_url),
            wanted,
            repeat,
            progress=(lambda _: None) if as_json else (lambda m: err.print(f"[dim]{m}…[/dim]")),
        )
    if as_json:
        _print_json({"database_url": redact(database_url), "rows": [r.to_dict() for r in rows]})
        return
    table = Table(title=f"Runner load cost by history ({redact(database_url)})", box=box.SIMPLE)
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
    _stdout().print(table)


def main() -> None:
    """Console-script entry point (``secondbox-scheduler``)."""
    cli()


if __name__ == "__main__":
    main()
