"""Audit over every cell: a report per cell, and the federation checkpoint.

Each cell is an event store of its own, with its own chain (docs/audit.md); the audit of
a deployment of cells is the audit of each cell. The **federation checkpoint** is the
cells' checkpoints together, one ``NAME=POSITION:DIGEST`` per cell, in the cells file's
order, joined by commas (``east=1204:9f…,west=377:01…``): ``audit checkpoint --cells
FILE`` prints it, and ``audit verify --cells FILE --checkpoint FEDERATION`` checks every
cell's log against its own entry, so that a cell rolled back (a restore to a point
before the checkpoint, a lost primary's acknowledged events) fails, naming the cell. A
cell whose log has no chained event yet is written ``NAME=none``. A federation
checkpoint that names a cell the file does not have, or lacks one the file has, is
refused (``InvalidRequestError`` on ``checkpoint``): a cell added after the checkpoint
was taken is verified without one only when the checkpoint says ``NAME=none``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from secondbox_scheduler.domain.audit.chain import Checkpoint
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import AuditReport, checkpoint, verify
from secondbox_scheduler.infrastructure.cells.router import CellRouter

_ENTRY = re.compile(r"([a-z0-9][a-z0-9_-]{0,62})=(none|\d{1,19}:[0-9a-fA-F]{64})")


@dataclass(frozen=True)
class FederationCheckpoint:
    """Every cell's checkpoint (None: no chained event yet), in the cells file's order."""

    cells: Mapping[str, Checkpoint | None]

    def __str__(self) -> str:
        return ",".join(
            f"{name}={'none' if head is None else head}" for name, head in self.cells.items()
        )

    @classmethod
    def parse(cls, text: str) -> FederationCheckpoint:
        """``NAME=POSITION:DIGEST`` or ``NAME=none`` per cell, comma-separated."""
        cells: dict[str, Checkpoint | None] = {}
        for entry in text.strip().split(","):
            match = _ENTRY.fullmatch(entry.strip())
            if match is None:
                raise InvalidRequestError(
                    "checkpoint",
                    "a federation checkpoint is NAME=POSITION:DIGEST (or NAME=none) per cell, "
                    "comma-separated, as `audit checkpoint --cells` prints it",
                )
            name, value = match.groups()
            if name in cells:
                raise InvalidRequestError("checkpoint", f"names cell {name!r} twice")
            parsed = None if value == "none" else Checkpoint.parse(value)
            assert not isinstance(parsed, bytes)
            cells[name] = parsed
        return cls(cells)


def federation_checkpoint(router: CellRouter) -> FederationCheckpoint:
    """The checkpoint of every cell (CellUnavailableError if one cannot be read: a
    federation checkpoint is of every cell or of none)."""
    found = router.across(checkpoint)
    for error in found.unavailable.values():
        raise error
    return FederationCheckpoint({row.cell: row.value for row in found.rows})


def verify_cells(
    router: CellRouter, federation: FederationCheckpoint | None = None
) -> dict[str, AuditReport]:
    """Every cell's audit (one at a time: each reads its whole log), against its entry
    of ``federation``; CellUnavailableError naming a cell that cannot be read."""
    if federation is not None:
        unknown = sorted(set(federation.cells) - set(router.names))
        missing = [name for name in router.names if name not in federation.cells]
        if unknown or missing:
            raise InvalidRequestError(
                "checkpoint",
                "the federation checkpoint's cells are not the cells file's: "
                + "; ".join(
                    part
                    for part in (
                        f"not in the file: {', '.join(unknown)}" if unknown else "",
                        f"not in the checkpoint: {', '.join(missing)}" if missing else "",
                    )
                    if part
                ),
            )
    reports: dict[str, AuditReport] = {}
    for name in router.names:
        expected = None if federation is None else federation.cells[name]
        reports[name] = router.call(name, _verifying(expected))
    return reports


def _verifying(expected: Checkpoint | None) -> Callable[[SchedulerApplication], AuditReport]:
    return lambda app: verify(app, checkpoint=expected)
