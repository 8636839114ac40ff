"""The report of a what-if replay, and the tally that builds it decision by decision.

Each replayed decision is reproduced (outcome and evidence as recorded), the same
outcome on other evidence, or changed, by kind: placed -> refused, refused -> placed,
moved to another runner, refused with another error, or skipped (its sandbox was not
created in the counterfactual). The first difference is named by position; the first
:data:`SHOWN_CHANGES` changed decisions keep both sides' evidence. Refusals are counted
by error and by reason key before (the record) and after (the replay).

Events of a class the replay neither handles nor ignores (not in the catalogue of
``domain/event_catalogue.py``: written by another release, say) are not replayed; they
are counted by topic (``unknown_events``), and a report with any is not
:attr:`~WhatIfReport.identical`: the decisions that depend on them cannot be checked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.whatif.evidence import DecisionView

OPERATION_CREATE = "create_sandbox"
OPERATION_SCHEDULE = "schedule"
OPERATIONS = (OPERATION_CREATE, OPERATION_SCHEDULE)
SHOWN_CHANGES = 20  # changed decisions reported with their evidence

REPRODUCED = "reproduced"
EVIDENCE_CHANGED = "same outcome, other evidence"
PLACED_TO_REFUSED = "placed -> refused"
REFUSED_TO_PLACED = "refused -> placed"
MOVED = "moved to another runner"
REFUSED_OTHERWISE = "refused with another error"
SKIPPED = "skipped (sandbox not created)"
CHANGE_KINDS = (PLACED_TO_REFUSED, REFUSED_TO_PLACED, MOVED, REFUSED_OTHERWISE, SKIPPED)


def change_kind(recorded: str | None, replayed: str | None) -> str:
    """The kind of change between two different outcomes (a runner id, or None: refused)."""
    if recorded and not replayed:
        return PLACED_TO_REFUSED
    if replayed and not recorded:
        return REFUSED_TO_PLACED
    if recorded and replayed:
        return MOVED
    return REFUSED_OTHERWISE


@dataclass(frozen=True)
class Difference:
    """The first replayed decision that is not reproduced."""

    position: int
    operation: str
    sandbox_id: str
    generation: int
    kind: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "operation": self.operation,
            "sandbox_id": self.sandbox_id,
            "generation": self.generation,
            "kind": self.kind,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class ChangedDecision:
    """One changed decision: what the record states and what the replay decided."""

    position: int
    time: datetime
    operation: str
    sandbox_id: str
    generation: int
    kind: str
    before: DecisionView
    after: DecisionView

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "time": self.time.isoformat(),
            "operation": self.operation,
            "sandbox_id": self.sandbox_id,
            "generation": self.generation,
            "kind": self.kind,
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }


@dataclass
class WhatIfReport:
    """What a what-if replay found (docs/audit.md, "audit whatif")."""

    changes: list[str]
    policy: str
    window: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    position: int = 0
    decisions: int = 0
    reproduced: int = 0
    evidence_changed: int = 0
    changed: int = 0
    kept: int = 0
    kept_consistent: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_operation: dict[str, dict[str, int]] = field(default_factory=dict)
    first_difference: Difference | None = None
    refusals: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    reasons: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    utilisation: dict[str, Any] = field(default_factory=dict)
    lifecycle_skipped: int = 0
    held_to_end: int = 0
    allocatable_waits: int = 0
    invariant_violations: list[str] = field(default_factory=list)
    unknown_events: dict[str, int] = field(default_factory=dict)  # not replayed: by topic
    changed_decisions: list[ChangedDecision] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """Every replayed decision reproduced its record, and every event was replayed
        (none of an unknown class)."""
        return self.reproduced == self.decisions and not self.unknown_events

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": self.changes,
            "policy": self.policy,
            "window": self.window,
            "events": self.events,
            "position": self.position,
            "decisions": self.decisions,
            "reproduced": self.reproduced,
            "changed": self.changed,
            "evidence_changed": self.evidence_changed,
            "kept": self.kept,
            "kept_consistent": self.kept_consistent,
            "changed_by_kind": self.by_kind,
            "by_operation": self.by_operation,
            "first_difference": self.first_difference and self.first_difference.to_dict(),
            "refusals_by_error": self.refusals,
            "refusals_by_reason": self.reasons,
            "utilisation": self.utilisation,
            "lifecycle_skipped": self.lifecycle_skipped,
            "held_to_end": self.held_to_end,
            "allocatable_waits": self.allocatable_waits,
            "invariant_violations": self.invariant_violations,
            "unknown_events": self.unknown_events,
            "changed_decisions": [change.to_dict() for change in self.changed_decisions],
        }


class Tally:
    """Counts decisions and refusals as the replay makes them, into a report."""

    def __init__(self, report: WhatIfReport) -> None:
        self.report = report
        self.counts: Counter[tuple[str, str]] = Counter()
        self.refusals = {side: {op: Counter[str]() for op in OPERATIONS} for side in _SIDES}
        self.reasons = {side: {op: Counter[str]() for op in OPERATIONS} for side in _SIDES}

    def refusal(
        self, side: str, operation: str, error: str | None, keys: Mapping[str, int]
    ) -> None:
        """One refusal ``before`` (recorded) or ``after`` (replayed), with the refused
        runners counted per reason key."""
        self.refusals[side][operation][str(error)] += 1
        self.reasons[side][operation].update(keys)

    def decision(
        self,
        position: int,
        moment: datetime,
        operation: str,
        sandbox_id: str,
        generation: int,
        kind: str,
        detail: str | None,
        views: Callable[[], tuple[DecisionView, DecisionView]],
    ) -> None:
        """One replayed decision; ``views`` builds both sides' evidence when it is shown."""
        report = self.report
        report.decisions += 1
        self.counts[(operation, "decisions")] += 1
        if kind == REPRODUCED:
            report.reproduced += 1
            self.counts[(operation, "reproduced")] += 1
            return
        if report.first_difference is None:
            report.first_difference = Difference(
                position, operation, sandbox_id, generation, kind, detail or ""
            )
        if kind == EVIDENCE_CHANGED:
            report.evidence_changed += 1
            self.counts[(operation, "evidence_changed")] += 1
            return
        report.changed += 1
        self.counts[(operation, "changed")] += 1
        report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
        if len(report.changed_decisions) < SHOWN_CHANGES:
            before, after = views()
            report.changed_decisions.append(
                ChangedDecision(
                    position, moment, operation, sandbox_id, generation, kind, before, after
                )
            )

    def finish(self) -> None:
        report = self.report
        found = report.by_kind
        report.by_kind = {kind: found[kind] for kind in CHANGE_KINDS if kind in found}
        report.by_operation = {
            operation: {
                name: self.counts[(operation, name)]
                for name in ("decisions", "reproduced", "evidence_changed", "changed")
            }
            for operation in OPERATIONS
        }
        report.refusals = {
            side: {op: dict(sorted(counts[op].items())) for op in OPERATIONS}
            for side, counts in self.refusals.items()
        }
        report.reasons = {
            side: {op: dict(sorted(counts[op].items())) for op in OPERATIONS}
            for side, counts in self.reasons.items()
        }


_SIDES = ("before", "after")
