"""The ``secondbox-scheduler`` command line: simulate a fleet, inspect runners and assignments.

Every command reads the store named by ``--database-url`` (or the
``SECONDBOX_DATABASE_URL`` environment variable), prints rich tables for people or,
with ``--json``, JSON only on stdout. An expected failure is one line on stderr and an
exit code that says its kind (:mod:`..exit_codes`, docs/spec.md (section 8.4)): 1 a
violation found, 2 a usage error, 3 refused by a rule, 4 the store unavailable, 70 a
fault of ours.

This module builds the typer app ``cli`` from the command groups, one module each:
``simulate``, ``inspection`` (``runners``, ``assignments``), ``faults`` (``verify``),
``lifecycle`` (``reconcile``, ``release``), ``serve`` (the HTTP service),
``projections``, ``audit``, ``bench``, ``db`` and ``tokens`` (access tokens);
``common`` holds what they share.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.acting import acting_as, command_line_actor
from secondbox_scheduler.infrastructure.cells.config import CELLS
from secondbox_scheduler.infrastructure.cli import (
    audit,
    bench,
    db,
    faults,
    inspection,
    lifecycle,
    projections,
    serve,
    simulate,
    tokens,
)
from secondbox_scheduler.infrastructure.cli.cells import CELL_COMMANDS, CellsFile
from secondbox_scheduler.infrastructure.cli.common import say_error, shown
from secondbox_scheduler.infrastructure.exit_codes import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    exit_code_of,
)
from secondbox_scheduler.infrastructure.gc_tuning import tune_gc

__all__ = ["cli", "main"]

cli = typer.Typer(
    name="secondbox-scheduler",
    help=(
        "Event-sourced scheduler of the SecondBox sandbox platform: placement, capacity "
        "reservation and fenced assignment authority.\n\n"
        "Start with [bold]secondbox-scheduler simulate[/bold] to fill ./secondbox.db with a "
        "seeded fleet, then look at it with [bold]runners[/bold] and [bold]assignments[/bold]."
    ),
    epilog=(
        "[bold]Exit codes[/bold]: 0 ok; 1 a violation found (verify, audit verify, "
        "projections verify, simulate's ledger check, audit whatif); 2 a usage error (a bad "
        "option or value, a store simulate may not write into, a missing extra of the "
        "installation); 3 refused by a rule of the scheduler (not found, stale fence, "
        "conflict, no compatible runner, contention); 4 the store unavailable; 70 an "
        "internal error (a fault: please report it). Shell completion: "
        "--install-completion."
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def _print_version(wanted: bool) -> None:
    if wanted:
        from secondbox_scheduler import __version__

        typer.echo(f"secondbox-scheduler {__version__}")
        raise typer.Exit()


@cli.callback()
def _root(
    context: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
    cells: CellsFile = None,
) -> None:
    """The options of the command line itself (see --help)."""
    if cells is not None:
        # ``--cells`` before the command: the command's own option reads it from there
        os.environ[CELLS] = str(cells)
        if context.invoked_subcommand not in CELL_COMMANDS:
            say_error(
                shown(
                    f"{context.invoked_subcommand} acts on one store: give --database-url of "
                    f"one cell, not a cells file ({cells}; unset {CELLS})"
                )
            )
            raise typer.Exit(EXIT_USAGE)
    # every command's events record `cli` and the OS user (docs/events.md, "The actor")
    context.with_resource(acting_as(command_line_actor()))


# The top-level commands, in the order --help lists them; then the command groups.
cli.registered_commands += [
    *simulate.commands.registered_commands,
    *inspection.commands.registered_commands,
    *faults.commands.registered_commands,
    *lifecycle.commands.registered_commands,
    *serve.commands.registered_commands,
]
cli.add_typer(projections.projections_cli, name="projections")
cli.add_typer(audit.audit_cli, name="audit")
cli.add_typer(bench.bench_cli, name="bench")
cli.add_typer(db.db_cli, name="db")
cli.add_typer(tokens.tokens_cli, name="tokens")


def main() -> None:
    """The command line (the console script's :mod:`..command_line` calls it). Whatever
    goes wrong, the answer is one line on stderr, never a traceback (``SECONDBOX_DEBUG=1``
    shows it): an expected failure is reported by the command itself, with the exit code
    of its kind (:mod:`..exit_codes`); anything else is a fault of ours, said as such
    (exit 70). The process's garbage collector is tuned first
    (:mod:`~secondbox_scheduler.infrastructure.gc_tuning`)."""
    try:
        tune_gc()
    except SchedulerError as error:  # a bad SECONDBOX_GC_THRESHOLD
        say_error(shown(str(error)))
        sys.exit(exit_code_of(error) or EXIT_USAGE)
    try:
        cli(prog_name="secondbox-scheduler")
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:
        if os.environ.get("SECONDBOX_DEBUG"):
            raise
        code = exit_code_of(error)  # an expected error that a command let through
        say_error(
            shown(
                f"{type(error).__name__}: {error}"
                if code is not None
                else f"unexpected {type(error).__name__}: {error} (a fault of the scheduler: "
                "please report it; SECONDBOX_DEBUG=1 shows the traceback)"
            )
        )
        sys.exit(EXIT_INTERNAL if code is None else code)
