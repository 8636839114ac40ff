"""Audit replay as a Python API: verify, state at a point, timelines, explanations.

Everything here reads the notification log (or one stream) and folds it with
:class:`domain.audit.AuditFold` or reads the evidence recorded with each decision: no
aggregate cache, no projection. The CLI's ``audit`` commands print what these return.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.assignment import to_durable_assignment
from secondbox_scheduler.domain.audit.chain import (
    ChainedEvent,
    ChainVerifier,
    Checkpoint,
    Finding,
)
from secondbox_scheduler.domain.audit.fold import AuditFold, Violation
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
from secondbox_scheduler.infrastructure.audit.streams import outside_log
from secondbox_scheduler.infrastructure.store.chain_reads import (
    chain_head,
    select_links,
    stored_snapshots,
)
from secondbox_scheduler.infrastructure.store.chain_tables import ChainedRecorder
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import gc_paused, read_pages
from secondbox_scheduler.projections.read_models import RebuildReport, read_raw

PAGE = 1000  # progress is reported every PAGE events
READ_PAGE = 5000  # notifications per query (the next page is read ahead)
Until = int | datetime | None
POSITION_MAX = 2**63 - 1  # notification ids are BIGINT


def parse_until(text: str | None) -> Until:
    """``--until``/``--at``: a notification position (integer) or an ISO time with zone."""
    if text is None:
        return None
    if text.isdigit():
        position = int(text)
        if position > POSITION_MAX:
            raise InvalidRequestError("until", f"a position is at most {POSITION_MAX}", text)
        return position
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequestError(
            "until", "must be a position or an ISO time", printable_text(text)
        ) from None
    if moment.tzinfo is None:
        raise InvalidRequestError("until", "an ISO time needs a zone (Z or +00:00)", text)
    return moment


def printable_text(text: str) -> str:
    return text.encode("unicode_escape").decode("ascii")[:80]


def _events(app: SchedulerApplication, until: Until) -> Iterator[tuple[int, Any]]:
    """(position, event) in log order, up to a position or to the first event after a time."""
    stop = until if isinstance(until, int) else None
    after_time = until if isinstance(until, datetime) else None
    decode = EventDecoder(app.mapper)
    pages = read_pages(
        app.recorder, until=stop, page_size=READ_PAGE, first_page_size=PAGE, read_ahead=True
    )
    for page in pages:
        for notification in page:
            event: Any = decode(notification)
            if after_time is not None and event.timestamp > after_time:
                return
            yield notification.id, event


@dataclass
class ChainReport:
    """What the chain check found: how much of the log is chained, and how."""

    chained: bool = False  # the store keeps a chain
    keyed: bool = False  # digests are HMACs with SECONDBOX_AUDIT_KEY
    unchained_until: int = 0  # the last position of the prefix from before the chain
    links_checked: int = 0
    snapshots_checked: int = 0
    head: str | None = None  # POSITION:DIGEST of the last link checked
    checkpoint: str | None = None  # the checkpoint the log was checked against

    def to_dict(self) -> dict[str, Any]:
        return {
            "chained": self.chained,
            "keyed": self.keyed,
            "unchained_until": self.unchained_until,
            "links_checked": self.links_checked,
            "snapshots_checked": self.snapshots_checked,
            "head": self.head,
            "checkpoint": self.checkpoint,
        }


@dataclass
class AuditReport(RebuildReport):
    """An audit replay: its rates (as a rebuild's), how far it went, what it found."""

    position: int = 0
    violations: list[Violation] = field(default_factory=list)
    chain: ChainReport = field(default_factory=ChainReport)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def first_bad_position(self) -> int | None:
        """The first position named by a violation (0: a snapshot whose event is gone,
        position unknown, counts only when nothing else is named)."""
        named = [v.position for v in self.violations if v.position > 0]
        return min(named) if named else (0 if self.violations else None)

    def to_dict(self) -> dict[str, Any]:
        rates = super().to_dict()
        rates["events_checked"] = rates.pop("events")
        return {
            "ok": self.ok,
            **rates,
            "position": self.position,
            "first_bad_position": self.first_bad_position,
            "chain": self.chain.to_dict(),
            "violations": [violation.to_dict() for violation in self.violations],
        }


def checkpoint(app: SchedulerApplication) -> Checkpoint | None:
    """The head of the chain (position and digest): keep it elsewhere, and later check
    that the log still extends it (``verify(..., checkpoint=...)``). None: no link yet."""
    head = chain_head(app.recorder)
    return None if head is None else Checkpoint(head.position, head.digest)


def parse_checkpoint(text: str) -> Checkpoint | bytes:
    """``--checkpoint``: POSITION:DIGEST (as ``audit checkpoint`` prints it) or DIGEST."""
    try:
        return Checkpoint.parse(text)
    except ValueError as error:
        raise InvalidRequestError("checkpoint", str(error), printable_text(text)) from None


def _chain_violation(finding: Finding, event: Any = None) -> Violation:
    # a finding at a position with no event there (deleted, cut) names the log itself
    stream = "log" if event is None else str(event.originator_id)
    name = "(no event)" if event is None else str(event.topic).rpartition(":")[2]
    return Violation(finding.position, stream, name, f"chain-{finding.kind}", finding.detail)


class _SnapshotCheck:
    """Every stored snapshot against the events it covers: its seal (the chain digest at
    its version) and its state (the aggregate refolded from the events up to there)."""

    def __init__(self, app: SchedulerApplication) -> None:
        self.app = app
        self.checked = 0
        self.violations: list[Violation] = []
        recorder = app.snapshots.recorder if app.snapshots is not None else None
        self.sealed = isinstance(recorder, SealedSnapshots)
        rows = stored_snapshots(recorder)
        self.pending: dict[tuple[Any, int], tuple[Any, bytes | None, bytes | None, int]] = {}
        self.last: dict[Any, int] = {}
        for stored, seal, digest, position in rows:
            key = (stored.originator_id, stored.originator_version)
            self.pending[key] = (stored, seal, digest, position or 0)
            self.last[stored.originator_id] = max(
                self.last.get(stored.originator_id, 0), stored.originator_version
            )
        self.aggregates: dict[Any, Any] = {}
        self.broken: set[Any] = set()

    def apply(self, event: Any) -> None:
        stream = event.originator_id
        if stream not in self.last:
            return
        try:
            self.aggregates[stream] = event.mutate(self.aggregates.get(stream))
        except Exception:  # a tampered history; the chain names it
            self.aggregates.pop(stream, None)
            self.last.pop(stream, None)
            self.broken.add(stream)
            return
        version = event.originator_version
        found = self.pending.pop((stream, version), None)
        if found is not None:
            self._compare(found, self.aggregates[stream])
        if version >= self.last[stream]:
            self.aggregates.pop(stream, None)
            self.last.pop(stream, None)

    def _violation(self, stored: Any, position: int, detail: str) -> None:
        self.violations.append(
            Violation(
                position,
                str(stored.originator_id),
                f"snapshot v{stored.originator_version}",
                "snapshot",
                detail,
            )
        )

    def _compare(self, found: tuple[Any, bytes | None, bytes | None, int], aggregate: Any) -> None:
        stored, seal, digest, position = found
        self.checked += 1
        if self.sealed and digest is not None:
            reason = self.app.snapshots.recorder.refusal(stored, seal, digest)  # type: ignore[union-attr]
            if reason:
                self._violation(stored, position, reason)
                return
        mapper = self.app.mapper
        try:
            taken: Any = mapper.to_domain_event(stored)
            snapshot_class = type(taken)
            # both through the aggregate (a snapshot of an older class version is upcast
            # there), then taken and transcoded alike
            kept: Any = mapper.to_domain_event(
                mapper.to_stored_event(snapshot_class.take(taken.mutate(None)))
            )
            fresh: Any = mapper.to_domain_event(
                mapper.to_stored_event(snapshot_class.take(aggregate))
            )
        except Exception as error:
            self._violation(stored, position, f"cannot be read ({type(error).__name__})")
            return
        if kept.state != fresh.state:
            differ = sorted(
                k for k in kept.state.keys() | fresh.state.keys()
                if kept.state.get(k) != fresh.state.get(k)
            )  # fmt: skip
            self._violation(
                stored,
                position,
                f"its state differs from the events up to its version ({', '.join(differ)})",
            )

    def finish(self, stop: int | None, end: int) -> None:
        orphans = [s for s, _, _, position in self.pending.values() if not position]
        if len(orphans) > 3:  # the log was cut short under its snapshots
            self.checked += len(orphans)
            self.violations.append(
                Violation(end + 1, "-", "snapshots", "snapshot",
                          f"{len(orphans)} snapshots have no event at their version "
                          "(events deleted or the log truncated)")
            )  # fmt: skip
            self.pending = {k: v for k, v in self.pending.items() if v[3]}
        for stored, _, _, position in self.pending.values():
            if stop is None or position <= stop:
                self.checked += 1
                broken = stored.originator_id in self.broken
                self._violation(
                    stored,
                    position,
                    "cannot be checked: the events of its stream do not fold up to its version"
                    if broken
                    else "no event at its version",
                )


def fold(
    app: SchedulerApplication, until: Until = None, progress: Callable[[int], None] = lambda _: None
) -> AuditFold:
    audit = AuditFold()
    with gc_paused():
        for count, (position, event) in enumerate(_events(app, until), start=1):
            audit.apply(position, event)
            if count % PAGE == 0:
                progress(PAGE)
        audit.finish()
    return audit


def verify(
    app: SchedulerApplication,
    until: Until = None,
    progress: Callable[[int], None] = lambda _: None,
    measure_raw: bool = True,
    checkpoint: Checkpoint | bytes | None = None,
) -> AuditReport:
    """Replay the log through the audit fold; every violation with its position and rule.
    On a chained store, every event is also checked against its link of the chain, every
    stored snapshot against its seal and the events, and the log against ``checkpoint``."""
    raw_seconds = 0.0
    if measure_raw:
        started = time.perf_counter()
        read_raw(app, until=until if isinstance(until, int) else None)
        raw_seconds = time.perf_counter() - started
    started = time.perf_counter()
    audit, chain = _checked_fold(app, until, progress, checkpoint)
    seconds = time.perf_counter() - started
    violations = sorted(audit.violations, key=lambda v: v.position)
    return AuditReport(audit.events, seconds, raw_seconds, audit.position, violations, chain)


def _checked_fold(
    app: SchedulerApplication,
    until: Until,
    progress: Callable[[int], None],
    checkpoint: Checkpoint | bytes | None,
) -> tuple[AuditFold, ChainReport]:
    """The audit fold over the log, with the chain checked position by position."""
    recorder = app.recorder
    chained = isinstance(recorder, ChainedRecorder)
    verifier = ChainVerifier(app.chain)
    if checkpoint is not None:
        verifier.expect(checkpoint)
    snapshots = _SnapshotCheck(app)
    audit = AuditFold()
    decode = EventDecoder(app.mapper)
    stop = until if isinstance(until, int) else None
    after_time = until if isinstance(until, datetime) else None
    violations: list[Violation] = []
    read = 0
    last = 0
    finished = False
    with gc_paused():
        pages = read_pages(
            recorder, until=stop, page_size=READ_PAGE, first_page_size=PAGE, read_ahead=True
        )
        for page in pages:
            links = select_links(recorder, last, page[-1].id) if chained else []
            index = 0
            for notification in page:
                position = notification.id
                while index < len(links) and links[index].position < position:
                    verifier.feed(None, links[index])  # a link whose event was deleted
                    index += 1
                link = None
                if index < len(links) and links[index].position == position:
                    link = links[index]
                    index += 1
                event: Any = None
                try:
                    event = decode(notification)
                except Exception as error:
                    violations.append(
                        Violation(position, str(notification.originator_id),
                                  notification.topic.rpartition(":")[2], "unreadable",
                                  f"the event cannot be decoded ({type(error).__name__})")
                    )  # fmt: skip
                if after_time is not None and event is not None and event.timestamp > after_time:
                    finished = True
                    break
                if chained:
                    state: Any = notification.state
                    verifier.feed(
                        ChainedEvent(
                            position,
                            notification.originator_id,
                            notification.originator_version,
                            str(notification.topic),
                            state.encode() if isinstance(state, str) else bytes(state),
                        ),
                        link,
                    )
                if event is not None:
                    try:
                        audit.apply(position, event)
                    except Exception as error:
                        violations.append(
                            Violation(position, str(notification.originator_id),
                                      type(event).__qualname__, "unfoldable",
                                      f"the fold cannot apply it ({type(error).__name__}: "
                                      f"{error})")
                        )  # fmt: skip
                    snapshots.apply(event)
                read += 1
                if read % PAGE == 0:
                    progress(PAGE)
                last = position
            if finished:
                break
            for link in links[index:]:
                verifier.feed(None, link)
            last = page[-1].id
        if chained and not finished:
            for link in select_links(recorder, last, stop):
                verifier.feed(None, link)  # links after the last event: events deleted
        try:
            audit.finish()
        except Exception as error:  # pragma: no cover - a tampered history
            violations.append(Violation(last, "-", "-", "unfoldable", str(error)))
    violations.extend(outside_log(recorder, read, last))  # the streams hold no other event
    snapshots.finish(None if finished else stop, max(last, verifier.last_position))
    if chained and checkpoint is not None:
        verifier.check(checkpoint)
    elif checkpoint is not None:
        verifier.findings.append(Finding(0, "unchained", "this store keeps no chain"))
    audit.violations.extend(violations)
    audit.violations.extend(_chain_violation(finding) for finding in verifier.findings)
    audit.violations.extend(snapshots.violations)
    head = verifier.head
    report = ChainReport(
        chained=chained,
        keyed=app.chain.keyed,
        unchained_until=verifier.unchained_until,
        links_checked=verifier.links_checked,
        snapshots_checked=snapshots.checked,
        head=None if head is None else str(Checkpoint(head.position, head.digest)),
        checkpoint=None if checkpoint is None else (
            checkpoint.hex() if isinstance(checkpoint, bytes) else str(checkpoint)),
    )  # fmt: skip
    return audit, report


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time.isoformat(),
            "stream": self.stream,
            "version": self.version,
            "event": self.event,
            "fields": self.fields,
        }


_SKIP = {"originator_id", "originator_version", "timestamp", "originator_topic"}


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
        wanted = fields.pop("requirements")
        fields["requirements"] = {
            k: wanted[k] for k in ("pool_name", "architecture", "capacity", "egress_context")
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "decided_at": self.decided_at.isoformat(),
            "heartbeat_timeout_seconds": self.heartbeat_timeout_seconds,
            "summary": self.summary,
            "candidates": [c.to_dict() for c in self.candidates],
            "detail": self.detail,
        }


@dataclass
class Explanation:
    sandbox_id: str
    decisions: list[Decision]

    def to_dict(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id, "decisions": [d.to_dict() for d in self.decisions]}


def _decision(title: str, record: dict[str, Any], chosen: str | None, **detail: Any) -> Decision:
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
                decision, decision["chosen_runner_id"],
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
                placement, record["runner_id"],
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
            f"{what} refused ({event.error})", record, None)))  # fmt: skip
    decisions = [decision for _, _, decision in sorted(timed, key=lambda t: (t[0], t[1]))]
    return Explanation(sandbox_id, decisions)
