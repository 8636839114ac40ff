"""The ``simulate`` command: a seeded fleet simulation, and the summary it prints."""

from __future__ import annotations

from collections.abc import Callable
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

from secondbox_scheduler.infrastructure.cli.common import (
    GIB,
    DatabaseUrl,
    JsonOutput,
    gib,
    open_store,
    print_json,
    reported_errors,
    stdout,
    store_env,
    store_errors,
)
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL
from secondbox_scheduler.infrastructure.tools.simulation import (
    ATTEMPTS_PER_CYCLE,
    HEARTBEAT_TIMEOUT,
    DimensionUse,
    SimulationConfig,
    SimulationResult,
    run_simulation,
)
from secondbox_scheduler.infrastructure.tools.simulation.store_guard import (
    APPEND,
    FRESH,
    REPLACE,
    delete_store,
    inspect_store,
    mark_store,
    plan_run,
)

# This module's top-level commands; the package's __init__ adds them to the app `cli`.
commands = typer.Typer()


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
    "events written and the wall time. Defaults finish in well under a minute on SQLite. "
    "Exits 1 when the run's reservations differ from the store's (the ledger check).\n\n"
    "[bold]The store[/bold]: simulate never deletes or writes into a store it did not "
    "create. A new or empty store becomes simulate's (marked so); a SQLite file an earlier "
    "simulate created is replaced (--append keeps it and prefixes this run's ids), a "
    "PostgreSQL store it created is appended to. Any other store that holds events is "
    "refused (exit 2) unless --fresh, which says what it deletes (the SQLite file and its "
    "journals; on PostgreSQL the schema the URL names, never public) and then deletes it."
)
EXAMPLES_SIMULATE = (
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler simulate\n"
    "  secondbox-scheduler simulate --seed 11 --runners 12 --sandboxes 40 --json\n"
    "  secondbox-scheduler simulate --database-url sqlite:////tmp/fleet.db --append\n"
    "  secondbox-scheduler simulate --database-url 'postgresql://postgres@127.0.0.1/db?schema=sim' "
    "--fresh"
)


@commands.command(
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
            "--fresh",
            help=(
                "Delete the store first, even one simulate did not create, after saying "
                "what is deleted: the SQLite file and its journals, or the PostgreSQL "
                "schema the URL names (?schema=NAME; public is never dropped)."
            ),
        ),
    ] = False,
    append: Annotated[
        bool,
        typer.Option(
            "--append",
            help=(
                "Keep what an earlier simulate wrote to this SQLite file and add this run "
                "under a run prefix (ids never collide); PostgreSQL stores simulate created "
                "are always appended to."
            ),
        ),
    ] = False,
    json_output: JsonOutput = False,
) -> None:
    config = SimulationConfig(
        database_url=database_url,
        seed=seed,
        runners=runners,
        sandboxes=sandboxes,
        cycles=cycles,
        fresh=False,  # prepare_store deletes what may be deleted, and says so
    )
    err = Console(stderr=True, highlight=False)
    with reported_errors():
        with store_errors(database_url):

            def say(line: str) -> None:
                err.print(line, soft_wrap=True)

            prepare_store(database_url, fresh=fresh, append=append, say=say)
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

            with store_errors(database_url):
                result = run_simulation(config, progress=advance, env=store_env(database_url))
    if json_output:
        print_json(result.to_dict())
    else:
        print_summary(result, stdout())
    if not result.ledger_matches_store:
        # The run's own ledger of reservations and the store disagree: a failed run.
        err.print("error: the simulation's reservations DIFFER from the store")
        raise typer.Exit(1)


def prepare_store(
    database_url: str, *, fresh: bool, append: bool, say: Callable[[str], None]
) -> None:
    """Check that simulate may write into the store, and make it simulate's
    (:mod:`~secondbox_scheduler.infrastructure.tools.simulation.store_guard`)."""
    plan = plan_run(inspect_store(database_url), fresh=fresh, append=append)
    if plan.note:
        say(f"note: {escape(plan.note)}")
    if plan.action in (FRESH, REPLACE):
        delete_store(database_url)
    if plan.action != APPEND:
        mark_store(database_url, lambda: open_store(database_url, must_exist=False).close())


def _use_cell(use: DimensionUse, scale: int = 1) -> str:
    """``reserved/allocatable percent``, then ``^peak%`` when the peak was higher."""
    if scale == 1:
        cell = f"{use.reserved}/{use.allocatable}"
    else:
        cell = f"{gib(use.reserved)}/{gib(use.allocatable)}"
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
