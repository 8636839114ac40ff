"""A creation's home decision, made once and shared (:class:`HomeChoice`).

``Sandbox.create`` decides its home with the placement rules over the candidates and
records the decision's evidence; a creation batch (``infrastructure/creating/batch.py``)
decides once for the creations of the same requirements over the same candidates,
instant and heartbeat timeout, and each records what its own ``Sandbox.create`` would
(``Sandbox.create_at_home``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from secondbox_scheduler.domain.placement.evidence import HomeDecisionRecord, Unlisted
from secondbox_scheduler.domain.placement.rules import (
    PlacementDecision,
    decide,
    home_decision_record,
)
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot


@dataclass(frozen=True)
class HomeChoice:
    """A home decision (``select_runner``'s, over ``decision``'s candidates) with the
    evidence a creation records for it, made once and shared by the creations of the
    same requirements over the same candidates at the same instant and heartbeat
    timeout (:meth:`Sandbox.create_at_home`): each records what its own
    :meth:`Sandbox.create` would. The evidence record is built once, on first use, and
    shared by those creations' events (records are never changed in place)."""

    requirements: Requirements
    decision: PlacementDecision
    now: datetime
    heartbeat_timeout: timedelta
    _record: list[HomeDecisionRecord] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def decided(
        cls,
        requirements: Requirements,
        runners: Sequence[RunnerSnapshot],
        now: datetime,
        heartbeat_timeout: timedelta,
        unlisted: Unlisted | None = None,
    ) -> HomeChoice:
        """The placement rules' decision over ``runners`` (``unlisted``: the pool's
        others, counted), as :meth:`Sandbox.create` makes it."""
        decision = decide(requirements, runners, now, heartbeat_timeout, unlisted)
        return cls(requirements, decision, now, heartbeat_timeout)

    def record(self) -> HomeDecisionRecord:
        """The evidence of the decision (docs/events.md 7.3); only for a runner chosen."""
        if not self._record:
            self._record.append(
                home_decision_record(self.decision, self.now, self.heartbeat_timeout)
            )
        return self._record[0]
