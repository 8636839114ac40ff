"""Claims for the ids a cell already holds: adopting cells over existing stores.

A store that served before the cells file (one store becoming a cell, say) holds runners
and sandboxes without claims (domain/cell_claims.py). A router still finds them (an id
the directory does not know is looked for in every cell), but nothing would stop a
creation of one of those ids in another cell. :func:`claim_existing` writes the missing
claims: for every sandbox and every registered runner of every cell (read from the
cell's log: ``Runner.Registered`` and ``Sandbox.Created``), the claim naming that cell,
as a creation through a router would have made it. An id already claimed by another
cell is reported (a duplicate made before the claims: the operator decides), never
overwritten; a runner deregistered in its cell is passed over (it can never be active
there again). Running it again claims only what is new: run it once with every replica
already on the cells file, before creating ids through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from secondbox_scheduler.domain.cell_claims import KIND_RUNNER, KIND_SANDBOX
from secondbox_scheduler.domain.errors import AlreadyExistsError
from secondbox_scheduler.domain.event_topics import topics_of
from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter

PAGE = 1000
CREATIONS = {
    topic: kind
    for cls, kind in ((Runner.Registered, KIND_RUNNER), (Sandbox.Created, KIND_SANDBOX))
    for topic in topics_of(cls)
}


@dataclass
class CellClaims:
    """What :func:`claim_existing` did in one cell."""

    claimed: int = 0  # claims written now
    already: int = 0  # claims there before, naming this cell
    passed_over: int = 0  # runners deregistered in this cell
    conflicts: list[str] = field(default_factory=list)  # "kind id: held by cell X"

    def to_dict(self) -> dict[str, Any]:
        return {
            "claimed": self.claimed,
            "already": self.already,
            "passed_over": self.passed_over,
            "conflicts": list(self.conflicts),
        }


def created_ids(app: SchedulerApplication) -> list[tuple[str, str]]:
    """(kind, id) of every runner registration and sandbox creation in ``app``'s log."""
    found: list[tuple[str, str]] = []
    position = 0
    while True:
        page = app.recorder.select_notifications(
            start=position + 1, limit=PAGE, topics=list(CREATIONS)
        )
        if not page:
            return found
        for notification in page:
            event: Any = app.mapper.to_domain_event(notification)
            kind = CREATIONS[notification.topic]
            found.append((kind, event.runner_id if kind == KIND_RUNNER else event.sandbox_id))
        position = page[-1].id


def claim_existing(
    router: CellRouter, progress: Callable[[str], None] = lambda _: None
) -> dict[str, CellClaims]:
    """The missing claims of every cell's ids written; a report per cell."""
    reports: dict[str, CellClaims] = {}
    for cell in router.names:
        report = reports[cell] = CellClaims()
        ids = router.call(cell, created_ids)
        progress(f"cell {cell}: {len(ids):,} ids")
        for kind, subject_id in ids:
            if kind == KIND_RUNNER and _deregistered(router, cell, subject_id):
                report.passed_over += 1
                continue
            claim = router.claim_of(kind, subject_id)
            if claim is not None and claim == cell:
                report.already += 1
                continue
            try:
                router.claim(kind, subject_id, cell)
            except AlreadyExistsError:
                holder = router.claim_of(kind, subject_id)
                report.conflicts.append(f"{kind} {subject_id}: held by cell {holder}")
                continue
            report.claimed += 1
    return reports


def _deregistered(router: CellRouter, cell: str, runner_id: str) -> bool:
    runner = router.call(cell, lambda app: app.load(runner_uuid(runner_id), Runner))
    return runner is not None and runner.deregistered
