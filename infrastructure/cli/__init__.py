"""The ``secondbox-scheduler`` command line: simulate a fleet, inspect runners and assignments.

Every command reads the store named by ``--database-url`` (or the
``SECONDBOX_DATABASE_URL`` environment variable), prints rich tables for people or,
with ``--json``, JSON only on stdout. A refusal of the scheduler (any
:class:`~domain.errors.SchedulerError`) or an unreachable store is one line on
stderr and exit code 2.

This module builds the typer app ``cli`` from the command groups, one module each:
``simulate``, ``inspection`` (``runners``, ``assignments``), ``faults`` (``verify``),
``lifecycle`` (``reconcile``, ``release``), ``serve`` (the HTTP service),
``projections``, ``audit``, ``bench``, ``db`` and ``tokens`` (access tokens);
``common`` holds what they share.
"""

from __future__ import annotations

import os
import sys

import typer

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.acting import acting_as, command_line_actor
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
from secondbox_scheduler.infrastructure.cli.common import EXIT_REFUSED, say_error, shown
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
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


@cli.callback()
def _actor(context: typer.Context) -> None:
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
    """Console-script entry point (``secondbox-scheduler``). Whatever goes wrong, the
    answer is one line on stderr, never a traceback (``SECONDBOX_DEBUG=1`` shows it):
    an expected failure is reported by the command itself (exit 2); anything else is a
    fault of ours, said as such (exit 2 too). The process's garbage collector is tuned
    first (:mod:`~secondbox_scheduler.infrastructure.gc_tuning`)."""
    try:
        tune_gc()
    except SchedulerError as error:  # a bad SECONDBOX_GC_THRESHOLD
        say_error(shown(str(error)))
        sys.exit(EXIT_REFUSED)
    try:
        cli()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:
        if os.environ.get("SECONDBOX_DEBUG"):
            raise
        say_error(
            shown(
                f"unexpected {type(error).__name__}: {error} (a fault of the scheduler: "
                "please report it; SECONDBOX_DEBUG=1 shows the traceback)"
            )
        )
        sys.exit(EXIT_REFUSED)
