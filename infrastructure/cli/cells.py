"""``--cells FILE`` (``SECONDBOX_CELLS``): the commands over a deployment of cells.

Every command takes ``--cells`` (on the command, or before it: ``secondbox-scheduler
--cells FILE runners``). ``runners``, ``assignments``, ``audit verify``, ``audit
checkpoint``, ``serve`` and ``bench cells`` work over every cell through a
:class:`~secondbox_scheduler.infrastructure.cells.router.CellRouter`; the others act on
one store, so with a cells file they are refused (exit 2) naming what to pass instead
(``--database-url`` of the one cell). Without a cells file nothing changes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from secondbox_scheduler.infrastructure.cells.config import CELLS, CellsConfig, load_cells
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.cli.common import (
    print_json,
    reported_errors,
    shown,
    stdout,
)
from secondbox_scheduler.infrastructure.exit_codes import EXIT_USAGE, CommandError
from secondbox_scheduler.infrastructure.settings import READ_MODELS

CellsFile = Annotated[
    Path | None,
    typer.Option(
        "--cells",
        envvar=CELLS,
        help=(
            "A cells file (TOML: [cells.NAME] database_url, pools): work over every cell "
            "it names instead of one --database-url store (docs/operations.md, 'Cells')."
        ),
        show_default=False,
    ),
]
# The commands that work over cells (the others refuse a cells file).
CELL_COMMANDS = frozenset({"runners", "assignments", "audit", "serve", "bench", "cells"})


def cells_config(cells: Path | None) -> CellsConfig | None:
    """The cells file given (None: none); its refusal names the field."""
    return None if cells is None else load_cells(cells)


def open_router(
    config: CellsConfig, *, read_models: bool = True, env: Mapping[str, str] | None = None
) -> CellRouter:
    """A router over the cells (read models off for the audit, as ``open_store``)."""
    settings = dict(env or {})
    if not read_models:
        settings[READ_MODELS] = "off"
    return CellRouter(config, env=settings)


def refuse_cells(command: str, cells: Path | None) -> None:
    """Exit 2 when a command that acts on one store is given a cells file."""
    if cells is not None:
        raise CommandError(
            f"{command} acts on one store: give --database-url of one cell, not a cells file "
            f"({cells}; unset {CELLS})",
            EXIT_USAGE,
        )


def _refusing(path: str) -> Any:
    def refuse(context: Any, parameter: Any, value: object) -> None:
        if value is not None:
            raise typer.BadParameter(
                f"{path} acts on one store: give --database-url of one cell, not a cells "
                f"file ({value}; unset {CELLS})",
                context,
                parameter,
            )

    return refuse


def add_cells_option(group: TyperGroup) -> None:
    """Give every command of ``group`` (and of its groups) a ``--cells`` option: the
    cell-aware ones have theirs; on the others it refuses a cells file (exit 2) naming
    the command, rather than being an unknown option or, from the environment, ignored.
    The option is a copy of a cell-aware command's own (so it reads ``SECONDBOX_CELLS``
    alike), that passes nothing to the command."""
    template = next(_cells_options(group), None)
    if template is not None:
        _add_refusals(group, template, "")


def _cells_options(group: TyperGroup) -> Iterator[Any]:
    for command in group.commands.values():
        if isinstance(command, TyperGroup):
            yield from _cells_options(command)
        else:
            yield from (p for p in command.params if "--cells" in getattr(p, "opts", ()))


def _add_refusals(group: TyperGroup, template: Any, path: str) -> None:
    for name, command in group.commands.items():
        full = f"{path} {name}".strip()
        if isinstance(command, TyperGroup):
            _add_refusals(command, template, full)
        elif not any("--cells" in getattr(p, "opts", ()) for p in command.params):
            refusal = copy.copy(template)
            refusal.callback = _refusing(full)
            refusal.expose_value = False
            refusal.help = "Refused: this command acts on one store (--database-url)."
            command.params.append(refusal)


class CellsGroup(TyperGroup):
    """The root group: before it runs, every command has its ``--cells`` option."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        add_cells_option(self)
        return super().main(*args, **kwargs)


cells_cli = typer.Typer(
    help="Deployments of several cells (docs/operations.md, 'Cells').", no_args_is_help=True
)


@cells_cli.command(
    "claim",
    help=(
        "Write the id claims of every runner and sandbox the cells already hold (ids "
        "written before the cells file have none), so that no other cell can create them. "
        "Exits 1 listing each id another cell holds too.\n\n[bold]Example[/bold]\n\n"
        "  secondbox-scheduler cells claim --cells cells.toml"
    ),
)
def cells_claim(
    cells: Annotated[
        Path,
        typer.Option("--cells", envvar=CELLS, help="The cells file.", show_default=False),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")
    ] = False,
) -> None:
    from secondbox_scheduler.infrastructure.cells.backfill import claim_existing

    with reported_errors(), open_router(load_cells(cells), read_models=False) as router:
        reports = claim_existing(router)
    conflicts = [item for report in reports.values() for item in report.conflicts]
    if as_json:
        print_json({name: report.to_dict() for name, report in reports.items()})
    else:
        console = stdout()
        for name, report in reports.items():
            console.print(
                f"cell {shown(name)}: {report.claimed:,} claimed, {report.already:,} already "
                f"claimed, {report.passed_over:,} deregistered runners passed over, "
                f"{len(report.conflicts):,} held by another cell"
            )
            for conflict in report.conflicts:
                console.print(f"[red]conflict[/red] cell {shown(name)}: {shown(conflict)}")
    if conflicts:
        raise typer.Exit(1)
