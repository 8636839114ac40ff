"""``--cells FILE`` (``SECONDBOX_CELLS``): the commands over a deployment of cells.

Every command takes ``--cells`` (on the command, or before it: ``secondbox-scheduler
--cells FILE runners``). ``runners``, ``assignments``, ``audit verify``, ``audit
checkpoint``, ``serve`` and ``bench cells`` work over every cell through a
:class:`~secondbox_scheduler.infrastructure.cells.router.CellRouter`; the others act on
one store, so with a cells file they are refused (exit 2) naming what to pass instead
(``--database-url`` of the one cell). Without a cells file nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from secondbox_scheduler.infrastructure.cells.config import CELLS, CellsConfig, load_cells
from secondbox_scheduler.infrastructure.cells.router import CellRouter
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
CELL_COMMANDS = frozenset({"runners", "assignments", "audit", "serve", "bench"})


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
