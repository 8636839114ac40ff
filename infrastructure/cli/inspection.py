"""The inspection commands ``runners`` and ``assignments``, and their tables and JSON."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot
from secondbox_scheduler.infrastructure.cells.config import load_cells
from secondbox_scheduler.infrastructure.cli.cells import CellsFile, open_router
from secondbox_scheduler.infrastructure.cli.common import (
    GIB,
    DatabaseUrl,
    JsonOutput,
    format_time,
    gib,
    open_store,
    print_json,
    reported_errors,
    say_error,
    shown,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.exit_codes import EXIT_STORE_UNAVAILABLE
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError

# This module's top-level commands; the package's __init__ adds them to the app `cli`.
commands = typer.Typer()


def _pair(reserved: int, allocatable: int, scale: int = 1) -> str:
    if scale == 1:
        return f"{reserved}/{allocatable}"
    return f"{gib(reserved)}/{gib(allocatable)}"


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


@commands.command(
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
    cells: CellsFile = None,
) -> None:
    if cells is not None:
        _runners_of_cells(cells, pool, json_output)
        return
    with reported_errors():
        app = open_store(database_url)
        try:
            with store_errors(database_url):
                snapshots = app.runner_snapshots(pool)
        finally:
            app.close()
    if json_output:
        print_json([snapshot.model_dump(mode="json") for snapshot in snapshots])
        return
    stdout().print(runner_table(snapshots, pool))


def _runners_of_cells(cells: Path, pool: str | None, json_output: bool) -> None:
    """``runners --cells``: every cell's runners, each row naming its cell; a cell that
    does not answer is one error line (the others are still listed) and exit 4."""
    with reported_errors():
        config = load_cells(cells)
        with open_router(config) as router:
            found = router.runner_snapshots_across(pool)
    rows = [(row.cell, snapshot) for row in found.rows for snapshot in row.value]
    if json_output:
        print_json([{"cell": cell, **s.model_dump(mode="json")} for cell, s in rows])
    else:
        stdout().print(runner_table([s for _, s in rows], pool, cells=[cell for cell, _ in rows]))
    report_unavailable(found.unavailable)


def report_unavailable(unavailable: Mapping[str, CellUnavailableError]) -> None:
    """One line on stderr per cell that did not answer, then exit 4 (if any)."""
    for error in unavailable.values():
        say_error(shown(str(error)))
    if unavailable:
        raise typer.Exit(EXIT_STORE_UNAVAILABLE)


def runner_table(
    snapshots: list[RunnerSnapshot], pool: str | None = None, cells: list[str] | None = None
) -> Table:
    title = f"Runners of pool {shown(pool)}" if pool else "Runners"
    table = Table(title=f"{title} ({len(snapshots)})", box=box.SIMPLE_HEAD, title_justify="left")
    if cells is not None:
        table.add_column("cell")
    for name in ("id", "pool", "arch", "backend", "drain", "last heartbeat"):
        table.add_column(name)
    for name in ("vCPU", "memory GiB", "instances"):
        table.add_column(name, justify="right")
    for index, runner in enumerate(snapshots):
        reserved, allocatable = runner.reserved, runner.allocatable
        table.add_row(
            *([shown(cells[index])] if cells is not None else []),
            shown(runner.id),
            shown(runner.pool_name),
            shown(runner.architecture),
            shown(runner.backend_kind or "-"),
            shown(runner.drain_phase),
            format_time(runner.last_heartbeat_at),
            _pair(reserved.vcpu_count, allocatable.vcpu_count),
            _pair(reserved.memory_bytes, allocatable.memory_bytes, GIB),
            _pair(reserved.instances, allocatable.instances),
        )
    return table


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


@commands.command(
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
    cells: CellsFile = None,
) -> None:
    if (sandbox is None) == (runner is None):
        raise typer.BadParameter(
            "give exactly one of --sandbox ID or --runner ID",
            param_hint="'--sandbox' / '--runner'",
        )
    if cells is not None:
        _assignments_of_cells(cells, sandbox, runner, json_output)
        return
    with reported_errors():
        app = open_store(database_url)
        try:
            with store_errors(database_url):
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
        print_json([assignment_json(assignment) for assignment in found])
        return
    stdout().print(assignment_table(found, f"{title} ({len(found)})"))


def _assignments_of_cells(
    cells: Path, sandbox: str | None, runner: str | None, json_output: bool
) -> None:
    """``assignments --cells``: the sandbox's or runner's cell is found by the router
    (its id directory); the rows name it."""
    with reported_errors(), open_router(load_cells(cells)) as router:
        if sandbox is not None:
            cell = router.cell_of_sandbox(sandbox)
            found = router.call(cell, lambda app: app.assignments(sandbox))
            title = f"Assignments of sandbox {sandbox} in cell {cell}"
        else:
            assert runner is not None
            cell = router.cell_of_runner(runner)
            found = router.call(cell, lambda app: app.runner_assignments(runner))
            title = f"Assignments holding runner {runner} in cell {cell}"
    if json_output:
        print_json([{"cell": cell, **assignment_json(assignment)} for assignment in found])
        return
    stdout().print(assignment_table(found, f"{title} ({len(found)})"))


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
            shown(assignment.sandbox_id),
            str(assignment.generation),
            shown(assignment.state),
            shown(assignment.runner_id),
            assignment.fencing_token.hex()[:16] + "…",
            str(assignment.capacity.vcpu_count),
            gib(assignment.capacity.memory_bytes),
            f"{assignment.retry_count}/{assignment.retry_limit}",
            format_time(assignment.created_at),
            format_time(assignment.updated_at),
        )
    return table
