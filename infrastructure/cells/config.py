"""The cells file: a deployment's cells, each a name, a store and the pools it owns.

TOML, one table per cell under ``cells``::

    [cells.east]
    database_url = "postgresql://app@pg-east-1:5432,pg-east-2:5432/scheduler?target_session_attrs=read-write"
    pools = ["general", "gpu"]

    [cells.west]
    database_url = "postgresql://app@pg-west-1/scheduler"
    pools = ["edge"]
    directory = false   # optional: a cell added later keeps no id claims (see below)

A pool belongs to exactly one cell: a file that gives a pool twice is refused, naming
both cells; so is an unknown key, a cell without pools, a bad name or URL. TOML itself
refuses a cell named twice. ``directory`` (default true) says whether the cell keeps
part of the id directory (domain/cell_claims.py): the directory cells must stay the
same for the life of the deployment, so a cell added later says ``directory = false``.
No file means one cell, the ``--database-url`` store, and today's behaviour.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.settings import redact_url, settings_from_url

CELLS = "SECONDBOX_CELLS"  # the environment variable naming the cells file
CELL_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
MAX_CELLS = 256
CELL_KEYS = frozenset({"database_url", "pools", "directory"})


@dataclass(frozen=True)
class Cell:
    """One cell: its name, its store's URL (maybe naming several hosts) and its pools."""

    name: str
    database_url: str
    pools: frozenset[str]
    directory: bool = True

    @property
    def shown_url(self) -> str:
        return redact_url(self.database_url)


@dataclass(frozen=True)
class CellsConfig:
    """Every cell of a deployment, in the file's order; each pool's cell."""

    cells: tuple[Cell, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.cells:
            raise InvalidRequestError("cells", "a cells file names at least one cell")
        if not any(cell.directory for cell in self.cells):
            raise InvalidRequestError("cells", "at least one cell keeps the id directory")
        owners: dict[str, str] = {}
        names: set[str] = set()
        for cell in self.cells:
            if cell.name in names:
                raise InvalidRequestError("cells", f"cell {cell.name!r} is named twice")
            names.add(cell.name)
            for pool in sorted(cell.pools):
                if pool in owners:
                    raise InvalidRequestError(
                        f"cells.{cell.name}.pools",
                        f"pool {pool!r} is given to two cells, {owners[pool]!r} and "
                        f"{cell.name!r}: a pool belongs to exactly one cell",
                    )
                owners[pool] = cell.name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(cell.name for cell in self.cells)

    @property
    def directory_cells(self) -> tuple[str, ...]:
        return tuple(cell.name for cell in self.cells if cell.directory)

    def cell(self, name: str) -> Cell:
        for cell in self.cells:
            if cell.name == name:
                return cell
        raise InvalidRequestError("cell", f"no cell {name!r} (cells: {', '.join(self.names)})")

    def cell_of_pool(self, pool_name: str, field: str = "pool_name") -> Cell:
        """The cell that owns ``pool_name``; an InvalidRequestError naming ``field`` when
        no cell does."""
        for cell in self.cells:
            if pool_name in cell.pools:
                return cell
        raise InvalidRequestError(
            field, f"no cell owns pool {pool_name!r} (cells: {', '.join(self.names)})", pool_name
        )

    @classmethod
    def single(cls, database_url: str, name: str = "default") -> CellsConfig:
        """One cell owning every pool: the deployment without a cells file."""
        return cls((Cell(name, database_url, frozenset()),), source="")


def _cell(name: str, table: object) -> Cell:
    field = f"cells.{name}"
    if not CELL_NAME.fullmatch(name):
        raise InvalidRequestError(
            field, "a cell's name is 1 to 63 of a-z, 0-9, '-' and '_', starting alphanumeric"
        )
    if not isinstance(table, Mapping):
        raise InvalidRequestError(field, "must be a table (database_url, pools)")
    unknown = sorted(set(table) - CELL_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"{field}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(CELL_KEYS))})"
        )
    url = table.get("database_url")
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{field}.database_url", "must be a database URL")
    try:
        settings_from_url(url)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"{field}.database_url", error.rule) from None
    pools = table.get("pools")
    if (
        not isinstance(pools, list)
        or not pools
        or not all(isinstance(pool, str) and pool for pool in pools)
    ):
        raise InvalidRequestError(f"{field}.pools", "must be a list of pool names, one or more")
    if len(set(pools)) != len(pools):
        raise InvalidRequestError(f"{field}.pools", "names a pool twice")
    directory = table.get("directory", True)
    if not isinstance(directory, bool):
        raise InvalidRequestError(f"{field}.directory", "must be true or false")
    return Cell(name, url, frozenset(pools), directory)


def parse_cells(text: str, source: str = "") -> CellsConfig:
    """The cells of a cells file's text; an InvalidRequestError naming the field."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InvalidRequestError("cells", f"not a TOML document: {error}") from None
    unknown = sorted(set(document) - {"cells"})
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown key (a cells file holds [cells.NAME])")
    cells = document.get("cells")
    if not isinstance(cells, Mapping) or not cells:
        raise InvalidRequestError("cells", "a cells file names at least one [cells.NAME]")
    if len(cells) > MAX_CELLS:
        raise InvalidRequestError("cells", f"at most {MAX_CELLS} cells")
    return CellsConfig(tuple(_cell(name, table) for name, table in cells.items()), source)


def load_cells(path: str | Path) -> CellsConfig:
    """The cells file at ``path``; an InvalidRequestError when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidRequestError("cells", f"cannot read the cells file {path}: {error}") from None
    return parse_cells(text, str(path))
