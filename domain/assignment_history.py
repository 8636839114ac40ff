"""Every generation's assignment of a sandbox, folded from its events.

The Sandbox aggregate keeps only the current generation's assignment (its state is
bounded: ``domain/sandbox.py``); past generations stay in the events, and
:func:`assignment_history` folds them back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from secondbox_scheduler.domain.assignment import AssignmentRecord
from secondbox_scheduler.domain.sandbox import Sandbox


def assignment_history(events: Iterable[Any]) -> dict[int, AssignmentRecord]:
    """Every generation's assignment record, folded from a sandbox's events (from its
    first event; a snapshot holds only the current generation)."""
    sandbox: Sandbox | None = None
    records: dict[int, AssignmentRecord] = {}
    for event in events:
        sandbox = event.mutate(sandbox)
        if isinstance(event, Sandbox.AssignmentFenced) and sandbox is not None:
            assert sandbox.current is not None
            records[sandbox.current["generation"]] = sandbox.current  # changed in place later
    return records
