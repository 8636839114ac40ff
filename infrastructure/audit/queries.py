"""The audit's read commands as a Python API: state at a point, timelines, explanations.

:func:`state_at` folds the log up to a position or a time with
:class:`secondbox_scheduler.domain.audit.fold.AuditFold` (:func:`.log_fold.fold`);
:func:`timeline` and :func:`explain` read one sandbox's or one runner's streams and the
evidence recorded with each decision, each with the actor who asked for it (None:
unknown, an event recorded before 0.3). No aggregate cache, no projection. The CLI's
``audit state``, ``audit timeline`` and ``audit explain`` print what these return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.actors import ActorRecord, actor_of
from secondbox_scheduler.domain.assignment import to_durable_assignment
from secondbox_scheduler.domain.errors import (
    InvalidRequestError,
    RunnerNotFoundError,
    SandboxNotFoundError,
)
from secondbox_scheduler.domain.ids import lease_uuid, refusal_log_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.placement.evidence import (
    RankRecord,
    RuleFailureRecord,
    RunnerEvaluation,
    Unlisted,
    summarize_refusals,
)
from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot, require_text
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import Until, fold


@dataclass
class AuditState:
    position: int
    runners: list[RunnerSnapshot]
    assignments: list[DurableAssignment]


def state_at(app: SchedulerApplication, at: Until) -> AuditState:
    """Every runner snapshot and assignment as they stood at a position or time."""
    audit = fold(app, at)
    return AuditState(
        audit.position,
        audit.runner_snapshots(),
        [to_durable_assignment(record) for record in audit.assignment_records()],
    )


@dataclass(frozen=True)
class TimelineEntry:
    time: datetime
    stream: str
    version: int
    event: str
    fields: dict[str, Any]
    actor: ActorRecord | None = None  # who asked; None: unknown (recorded before 0.3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time.isoformat(),
            "stream": self.stream,
            "version": self.version,
            "event": self.event,
            "actor": self.actor,
            "fields": self.fields,
        }


_SKIP = {"originator_id", "originator_version", "timestamp", "originator_topic", "actor"}


def _fields(event: Any) -> dict[str, Any]:
    fields = {k: v for k, v in vars(event).items() if k not in _SKIP}
    if "assignment" in fields:
        record = fields.pop("assignment")
        fields["assignment"] = {
            k: record[k] for k in ("id", "generation", "runner_id", "state", "capacity")
        }
    if "placement" in fields:
        placement = fields.pop("placement")
        runner = placement.get("runner", {})
        fields["placement"] = {
            "home_runner_id": placement.get("home_runner_id"),
            "heartbeat": runner.get("last_heartbeat_at"),
            "reserved_before": runner.get("reserved"),
            "attempt": placement.get("attempt"),
        }
    if "home_decision" in fields:
        decision = fields.pop("home_decision")
        fields["home_decision"] = summarize_refusals(
            [RunnerEvaluation.from_record(c) for c in decision["candidates"]],
            Unlisted.from_record(decision.get("unlisted")),
        )
    if "requirements" in fields:
        # Sandbox.Created always holds them; RefusalLog.Refused only for create_sandbox
        # (None for schedule, absent before: docs/events.md 7.3)
        wanted = fields.pop("requirements")
        if wanted is not None:
            fields["requirements"] = {
                k: wanted.get(k)
                for k in ("pool_name", "architecture", "capacity", "egress_context")
            }
    if "candidates" in fields:
        fields["candidates"] = len(fields["candidates"])
    if fields.get("unlisted") is None:
        fields.pop("unlisted", None)
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in fields.items()}


def timeline(
    app: SchedulerApplication, *, sandbox_id: str | None = None, runner_id: str | None = None
) -> list[TimelineEntry]:
    """One sandbox's (with its refusals) or one runner's (with its lease) history."""
    if (sandbox_id is None) == (runner_id is None):
        raise InvalidRequestError("sandbox_id", "give exactly one of sandbox_id or runner_id")
    if sandbox_id is not None:
        require_text("sandbox_id", sandbox_id)
        streams = {"sandbox": sandbox_uuid(sandbox_id), "refusals": refusal_log_uuid(sandbox_id)}
    else:
        assert runner_id is not None
        require_text("runner_id", runner_id)
        streams = {"runner": runner_uuid(runner_id), "lease": lease_uuid(runner_id)}
    entries = []
    for label, stream in streams.items():
        stream_events: list[Any] = list(app.events.get(stream))
        for event in stream_events:
            entries.append(
                TimelineEntry(
                    event.timestamp,
                    label,
                    event.originator_version,
                    type(event).__qualname__,
                    _fields(event),
                    actor_of(event),
                )
            )
    if not entries:
        if sandbox_id is not None:
            raise SandboxNotFoundError(sandbox_id)
        raise RunnerNotFoundError(str(runner_id))
    return sorted(entries, key=lambda e: (e.time, e.stream != "sandbox", e.version))


@dataclass
class CandidateLine:
    runner_id: str
    verdict: str  # "chosen", "compatible, ranked lower", "refused"
    reasons: list[RuleFailureRecord]
    rank: RankRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "runner_id": self.runner_id,
            "verdict": self.verdict,
            "reasons": self.reasons,
            "rank": self.rank,
        }


@dataclass
class Decision:
    title: str
    decided_at: datetime
    heartbeat_timeout_seconds: float
    summary: str
    candidates: list[CandidateLine]
    detail: dict[str, Any] = field(default_factory=dict)
    actor: ActorRecord | None = None  # who asked for the command that decided

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "decided_at": self.decided_at.isoformat(),
            "heartbeat_timeout_seconds": self.heartbeat_timeout_seconds,
            "summary": self.summary,
            "actor": self.actor,
            "candidates": [c.to_dict() for c in self.candidates],
            "detail": self.detail,
        }


@dataclass
class Explanation:
    sandbox_id: str
    decisions: list[Decision]

    def to_dict(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id, "decisions": [d.to_dict() for d in self.decisions]}


def _decision(
    title: str, record: dict[str, Any], chosen: str | None, event: Any, **detail: Any
) -> Decision:
    evaluations = [RunnerEvaluation.from_record(c) for c in record["candidates"]]
    lines = []
    for candidate, evaluation in zip(record["candidates"], evaluations, strict=True):
        if evaluation.runner_id == chosen:
            verdict = "chosen"
        elif evaluation.compatible:
            verdict = "compatible, ranked lower"
        else:
            verdict = "refused"
        lines.append(
            CandidateLine(
                evaluation.runner_id,
                verdict,
                [failure.to_record() for failure in evaluation.failures],
                candidate.get("rank"),
            )
        )
    order = {"chosen": 0, "compatible, ranked lower": 1, "refused": 2}
    lines.sort(key=lambda line: (order[line.verdict], line.runner_id))
    unlisted = Unlisted.from_record(record.get("unlisted"))
    if unlisted:  # runners without a line of their own (docs/events.md 7.3)
        detail["unlisted"] = unlisted.to_record()
    return Decision(
        title,
        record["decided_at"],
        record["heartbeat_timeout_seconds"],
        summarize_refusals(evaluations, unlisted),
        lines,
        detail,
        actor_of(event),
    )


def explain(
    app: SchedulerApplication, sandbox_id: str, generation: int | None = None
) -> Explanation:
    """Why this home runner, why each generation's runner, why each refusal."""
    require_text("sandbox_id", sandbox_id)
    events: list[Any] = list(app.events.get(sandbox_uuid(sandbox_id)))
    refusals: list[Any] = list(app.events.get(refusal_log_uuid(sandbox_id)))
    if not events and not refusals:
        raise SandboxNotFoundError(sandbox_id)
    decisions: list[Decision] = []
    timed: list[tuple[datetime, int, Decision]] = []
    for event in events:
        name = type(event).__qualname__
        if name == "Sandbox.Created" and generation is None:
            decision = event.home_decision
            timed.append((event.timestamp, 0, _decision(
                f"home runner chosen by create_sandbox: {decision['chosen_runner_id']}",
                decision, decision["chosen_runner_id"], event,
                pool=event.requirements["pool_name"],
                architecture=event.requirements["architecture"],
            )))  # fmt: skip
        elif name == "Sandbox.AssignmentFenced":
            record, placement = event.assignment, event.placement
            if generation is not None and record["generation"] != generation:
                continue
            runner = placement["runner"]
            timed.append((event.timestamp, 1, _decision(
                f"generation {record['generation']}: assignment {record['id']} fenced on "
                f"home runner {record['runner_id']} (attempt {placement.get('attempt', 0)})",
                placement, record["runner_id"], event,
                heartbeat=runner["last_heartbeat_at"], reserved_before=runner["reserved"],
                allocatable=runner["allocatable"], requested=placement["requested"],
                runner_version=placement["runner_version"],
                lease_version=placement["lease_version"],
            )))  # fmt: skip
    for event in refusals:
        if type(event).__qualname__ != "RefusalLog.Refused":
            continue
        if generation is not None and event.generation != generation:
            continue
        what = "create_sandbox" if event.operation == "create_sandbox" else (
            f"schedule of generation {event.generation}")  # fmt: skip
        record = {
            "candidates": event.candidates,
            "unlisted": getattr(event, "unlisted", None),
            "decided_at": event.decided_at,
            "heartbeat_timeout_seconds": event.heartbeat_timeout_seconds,
        }
        timed.append((event.timestamp, 2, _decision(
            f"{what} refused ({event.error})", record, None, event)))  # fmt: skip
    decisions = [decision for _, _, decision in sorted(timed, key=lambda t: (t[0], t[1]))]
    return Explanation(sandbox_id, decisions)
