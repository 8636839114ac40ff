"""The RefusalLog aggregate: evidence of placements the scheduler refused.

A refused ``create_sandbox`` or ``schedule`` reserves nothing, but an auditor must still
be able to see why. Each sandbox id has a refusal log of its own (so recording a
refusal never contends with the sandbox's or a runner's stream). A refusal is recorded
when its reasons differ from the last one recorded for the same operation and
generation, so a caller retrying against the same obstacle does not grow the log; the
state keeps only the last refusal per operation, so it does not grow either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypedDict

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.actors import ActedEvent, ActorRecord
from secondbox_scheduler.domain.errors import PlacementError
from secondbox_scheduler.domain.ids import refusal_log_uuid
from secondbox_scheduler.domain.placement.evidence import (
    CandidateRecord,
    RunnerEvaluation,
    Unlisted,
    UnlistedRecord,
    summarize_refusals,
)
from secondbox_scheduler.domain.records import RequirementsRecord
from secondbox_scheduler.domain.values import Requirements

OPERATION_CREATE = "create_sandbox"
OPERATION_SCHEDULE = "schedule"


class UnlistedReasons(TypedDict):
    """The last of a refusal's reasons when it counted runners without a record."""

    unlisted: UnlistedRecord


# What two refusals of one operation are compared on (:func:`_reasons`): the candidate
# records, then the unlisted counts when there are any.
RefusalReasons = Sequence[CandidateRecord | UnlistedReasons]


class RefusalLog(Aggregate):
    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class Opened(Aggregate.Created):
        sandbox_id: str

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        # by operation: the generation and the reasons of the last refusal recorded
        # (one entry per operation, however many generations were refused)
        self.last: dict[str, list[int | RefusalReasons]] = {}  # [generation, reasons]: JSON-shaped

    @classmethod
    def open(cls, sandbox_id: str, at: datetime) -> RefusalLog:
        return cls._create(
            cls.Opened, id=refusal_log_uuid(sandbox_id), timestamp=at, sandbox_id=sandbox_id
        )

    class Refused(Aggregate.Event):
        operation: str
        generation: int
        error: str
        summary: str
        decided_at: datetime
        heartbeat_timeout_seconds: float
        candidates: list[CandidateRecord]
        unlisted: UnlistedRecord | None = None  # Unlisted.to_record(); absent before
        # create_sandbox: the requirements refused (Requirements.to_record()), so that the
        # request can be replayed (audit whatif); absent before, None for schedule
        requirements: RequirementsRecord | None = None

        def apply(self, log: RefusalLog) -> None:
            log.last[self.operation] = [self.generation, _reasons(self.candidates, self.unlisted)]

    def refuse(
        self,
        *,
        operation: str,
        generation: int,
        error: str,
        evaluations: Sequence[RunnerEvaluation],
        decided_at: datetime,
        heartbeat_timeout: timedelta,
        unlisted: Unlisted | None = None,
        requirements: Requirements | None = None,
    ) -> bool:
        """Record a refusal unless its reasons equal the last one of this operation.

        ``unlisted``: counts of the runners refused without an evaluation record;
        ``requirements``: what a refused ``create_sandbox`` asked for (a schedule's are
        the sandbox's pinned ones)."""
        candidates = [evaluation.to_record() for evaluation in evaluations]
        counts = unlisted.to_record() if unlisted else None
        if self.last.get(operation) == [generation, _reasons(candidates, counts)]:
            return False
        self.trigger_event(
            self.Refused,
            timestamp=decided_at,
            operation=operation,
            generation=generation,
            error=error,
            summary=summarize_refusals(evaluations, unlisted),
            decided_at=decided_at,
            heartbeat_timeout_seconds=heartbeat_timeout.total_seconds(),
            candidates=candidates,
            unlisted=counts,
            requirements=None if requirements is None else requirements.to_record(),
        )
        return True


@dataclass(frozen=True)
class Refusal:
    """A refused placement to record in its sandbox's log."""

    sandbox_id: str
    operation: str
    generation: int
    error: PlacementError
    decided_at: datetime
    heartbeat_timeout: timedelta
    requirements: Requirements | None = None  # a refused creation's
    actor: ActorRecord | None = None  # who asked (recorded on its events by the store)

    def add_to(self, log: RefusalLog) -> bool:
        """Record it in ``log`` (False: the same reasons as the last one recorded)."""
        return log.refuse(
            operation=self.operation,
            generation=self.generation,
            error=type(self.error).__name__,
            evaluations=self.error.evaluations,
            decided_at=self.decided_at,
            heartbeat_timeout=self.heartbeat_timeout,
            unlisted=self.error.unlisted,
            requirements=self.requirements,
        )


def _reasons(candidates: list[CandidateRecord], unlisted: UnlistedRecord | None) -> RefusalReasons:
    """What two refusals are compared on: the records, and the counts when there are any."""
    return [*candidates, {"unlisted": unlisted}] if unlisted else candidates
