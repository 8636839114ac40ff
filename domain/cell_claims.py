"""Which cell holds an id: the id directory of a deployment of several cells.

A deployment of several cells (docs/operations.md, "Cells") keeps each pool's runners
and sandboxes in one cell's event store. A sandbox or runner id must be unique across
the cells, and a router must find the cell of an id without asking every cell. Both are
kept by one ``CellClaim`` stream per id, whose stream id is derived from the id's kind
and the id (:func:`~secondbox_scheduler.domain.ids.cell_claim_uuid`), stored in the id's
**directory cell**: a function of the id and the names of the directory cells alone
(``infrastructure/cells/directory.py``), the same for every router reading the same
cells file. Two routers creating one id in two cells at once both try to create this
one stream in that one store; its uniqueness on (stream, version), the guard that also
makes ids unique within a cell, lets exactly one of them win; the other reads the
winner's claim and refuses its creation naming the winner's cell.

A claim is made before its id is created in its cell and binds the id to that cell even
if the creation is then refused (no capacity): a retry in the same cell goes on, a
creation in another cell is refused. A runner's claim moves (``Moved``) when its pool
moves to another cell, once the runner is deregistered in the cell it names.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.actors import ActedEvent
from secondbox_scheduler.domain.ids import cell_claim_uuid

KIND_RUNNER = "runner"
KIND_SANDBOX = "sandbox"
KINDS = (KIND_RUNNER, KIND_SANDBOX)


class CellClaim(Aggregate):
    """The cell that holds one runner or sandbox id."""

    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class Claimed(Aggregate.Created):
        kind: str
        subject_id: str
        cell: str

    def __init__(self, kind: str, subject_id: str, cell: str) -> None:
        self.kind = kind
        self.subject_id = subject_id
        self.cell = cell

    @classmethod
    def claim(cls, *, kind: str, subject_id: str, cell: str, at: datetime) -> CellClaim:
        if kind not in KINDS:
            raise ValueError(f"a claim's kind is one of {', '.join(KINDS)}, not {kind!r}")
        return cls._create(
            cls.Claimed,
            id=cell_claim_uuid(kind, subject_id),
            timestamp=at,
            kind=kind,
            subject_id=subject_id,
            cell=cell,
        )

    class Moved(Aggregate.Event):
        cell: str
        from_cell: str

        def apply(self, claim: CellClaim) -> None:
            claim.cell = self.cell

    def move(self, cell: str, at: datetime) -> None:
        """Name ``cell`` from now on (a runner's pool moved; its caller checked that the
        cell it named no longer holds the runner)."""
        if self.kind != KIND_RUNNER:
            raise ValueError("only a runner's claim moves (a sandbox stays in its cell)")
        if cell != self.cell:
            self.trigger_event(self.Moved, timestamp=at, cell=cell, from_cell=self.cell)


CELL_CLAIM_EVENTS: tuple[type[Any], ...] = (CellClaim.Claimed, CellClaim.Moved)
