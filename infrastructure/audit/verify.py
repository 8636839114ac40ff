"""Audit verification as a Python API: ``audit verify`` and ``audit checkpoint``.

:func:`verify` reads the notification log in order and folds it with
:class:`secondbox_scheduler.domain.audit.fold.AuditFold` (no aggregate cache, no
projection), checks every event against its link of the hash chain
(:mod:`secondbox_scheduler.domain.audit.chain`), every stored snapshot against its seal
and the events (:mod:`.snapshot_check`), and the log against a checkpoint. The CLI's
``audit verify`` prints the :class:`AuditReport` it returns. The read commands (``audit
state``, ``timeline``, ``explain``) are in :mod:`.queries`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.audit.chain import (
    ChainVerifier,
    Checkpoint,
    Finding,
    Link,
)
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.merkle import MerkleRefold
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.fold_state import FoldState, ResumedSnapshotCheck
from secondbox_scheduler.infrastructure.audit.log_fold import (
    PAGE,
    READ_PAGE,
    Until,
    event_after,
    printable_text,
)
from secondbox_scheduler.infrastructure.audit.merkle_checks import MerkleChecks, MerkleReport
from secondbox_scheduler.infrastructure.audit.parallel_verify import (
    can_fork,
    default_workers,
    parallel_fold,
)
from secondbox_scheduler.infrastructure.audit.row_steps import (
    feed_row,
    link_at,
    unfoldable,
    unreadable,
)
from secondbox_scheduler.infrastructure.audit.snapshot_check import SnapshotCheck
from secondbox_scheduler.infrastructure.audit.streams import outside_log
from secondbox_scheduler.infrastructure.store.chain_reads import chain_head, select_links
from secondbox_scheduler.infrastructure.store.chain_tables import ChainedRecorder
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import gc_paused, read_rows
from secondbox_scheduler.projections.read_models import RebuildReport, read_raw


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
    merkle: MerkleReport = field(default_factory=MerkleReport)
    state: bytes | None = None  # the fold state sealed at the end (save_state=True)

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
            "merkle": self.merkle.to_dict(),
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


def verify(
    app: SchedulerApplication,
    until: Until = None,
    progress: Callable[[int], None] = lambda _: None,
    measure_raw: bool = True,
    checkpoint: Checkpoint | bytes | None = None,
    merkle: MerkleChecks | None = None,
    save_state: bool = False,
    workers: int | None = None,
) -> AuditReport:
    """Replay the log through the audit fold; every violation with its position and rule.
    On a chained store, every event is also checked against its link of the chain, every
    stored snapshot against its seal and the events, and the log against ``checkpoint``;
    the Merkle tree is refolded from the log and compared with the stored one and with
    ``merkle``'s signed checkpoints. With ``merkle.since`` (a fold state sealed at a
    checkpoint, :mod:`.fold_state`), only the events after it are folded.
    ``save_state``: the report's ``state`` is the fold state sealed at its end.
    ``workers``: processes to verify with (None: :func:`.parallel_verify.default_workers`;
    1: this one only); the findings are the same (:mod:`.parallel_verify`)."""
    merkle = merkle or MerkleChecks()
    resume = merkle.resume(app)
    raw_seconds = 0.0
    if measure_raw:
        started = time.perf_counter()
        read_raw(
            app,
            until=until if isinstance(until, int) else None,
            after=0 if resume is None else resume.last,
        )
        raw_seconds = time.perf_counter() - started
    started = time.perf_counter()
    workers = default_workers() if workers is None else workers
    if (
        workers > 1
        and resume is None
        and not save_state
        and not isinstance(until, datetime)
        and can_fork(app)
    ):
        audit, chain, refold = _parallel_checked_fold(
            app, workers, until, progress, checkpoint, merkle
        )
        state = None
    else:
        audit, chain, state, refold = _checked_fold(
            app, until, progress, checkpoint, merkle, resume, save_state
        )
    merkle_report = merkle.finish(app, refold, audit.position, resume)
    audit.violations.extend(merkle.violations)
    seconds = time.perf_counter() - started
    violations = sorted(audit.violations, key=lambda v: v.position)
    events = audit.events - (0 if resume is None else resume.events_before)
    return AuditReport(
        events, seconds, raw_seconds, audit.position, violations, chain, merkle_report, state
    )


def _parallel_checked_fold(
    app: SchedulerApplication,
    workers: int,
    until: int | None,
    progress: Callable[[int], None],
    checkpoint: Checkpoint | bytes | None,
    merkle: MerkleChecks,
) -> tuple[AuditFold, ChainReport, MerkleRefold]:
    """:func:`_checked_fold` over ``workers`` processes, its results put together in
    the same order (:mod:`.parallel_verify`)."""
    folded, rows, snapshot_rows = parallel_fold(
        app, workers, until, progress, checkpoint, merkle.watched()
    )
    audit = folded.audit
    findings = list(rows.findings)
    chained = isinstance(app.recorder, ChainedRecorder)
    if not chained and checkpoint is not None:
        findings.append(Finding(0, "unchained", "this store keeps no chain"))
    audit.violations.extend(folded.violations)
    audit.violations.extend(_chain_violation(finding) for finding in findings)
    audit.violations.extend(snapshot_rows.snapshot_violations)
    refold = MerkleRefold()
    refold.size, refold.stack, refold.watched = rows.refold
    report = ChainReport(
        chained=chained,
        keyed=app.chain.keyed,
        unchained_until=rows.unchained_until,
        links_checked=rows.links_checked,
        snapshots_checked=snapshot_rows.snapshots_checked,
        head=None if rows.head is None else str(Checkpoint(rows.head.position, rows.head.digest)),
        checkpoint=None if checkpoint is None else (
            checkpoint.hex() if isinstance(checkpoint, bytes) else str(checkpoint)),
    )  # fmt: skip
    return audit, report, refold


def _link_at(recorder: object, position: int) -> Link | None:
    """The stored link at ``position`` (one the chain verifier meets out of order)."""
    links = select_links(recorder, position - 1, position)
    return links[0] if links else None


def _checked_fold(
    app: SchedulerApplication,
    until: Until,
    progress: Callable[[int], None],
    checkpoint: Checkpoint | bytes | None,
    merkle: MerkleChecks,
    resume: FoldState | None,
    save_state: bool,
) -> tuple[AuditFold, ChainReport, bytes | None, MerkleRefold]:
    """The audit fold over the log, with the chain checked position by position and
    the Merkle tree refolded (from a fold state sealed at a checkpoint: ``resume``)."""
    recorder = app.recorder
    chained = isinstance(recorder, ChainedRecorder)
    verifier = ChainVerifier(app.chain, lookup=lambda at: _link_at(recorder, at))
    snapshots: SnapshotCheck
    if resume is None:
        snapshots = SnapshotCheck(app)
        audit = AuditFold(compact=True)
        refold = MerkleRefold(merkle.watched())
        violations: list[Violation] = []
        read = last = 0
    else:
        resume.restore(verifier)
        snapshots = ResumedSnapshotCheck(app, resume.last, resume.snapshots)
        audit, refold, violations = resume.audit, resume.refold, resume.violations
        read, last = resume.read, resume.last
        refold.watched.update(dict.fromkeys(merkle.watched()))
    if checkpoint is not None:
        verifier.expect(checkpoint)
    audit.auditor_clock = app.now()  # no event is recorded later (rule time-order)
    decode = EventDecoder(app.mapper)
    stop = until if isinstance(until, int) else None
    if save_state and merkle.stop is not None:
        stop = merkle.stop if stop is None else min(stop, merkle.stop)
    after_time = until if isinstance(until, datetime) else None
    state_bytes: bytes | None = None
    finished = False
    with gc_paused():
        pages = read_rows(
            recorder,
            after=last,
            until=stop,
            page_size=READ_PAGE,
            first_page_size=PAGE,
            read_ahead=True,
        )
        for page in pages:
            end = page[-1][0]
            links = select_links(recorder, last, end) if chained else []
            snapshots.page(last, end)
            index = 0
            for row in page:
                position = row[0]
                index, link = link_at(verifier, links, index, position)
                event: Any = None
                try:
                    event = decode.row(row)
                except Exception as error:
                    violations.append(unreadable(row, error))
                if after_time is not None and event is not None and event.timestamp > after_time:
                    finished = True
                    break
                feed_row(verifier, refold, row, link, chained)
                if event is not None:
                    try:
                        audit.apply(position, event)
                    except Exception as error:
                        violations.append(unfoldable(row, event, error))
                    snapshots.apply(event)
                read += 1
                if read % PAGE == 0:
                    progress(PAGE)
                last = position
            if finished:
                break
            for link in links[index:]:
                verifier.feed(None, link)
            last = end
        if save_state and not finished:
            # the tree size it is sealed at: the signed checkpoint's, where it stopped
            at = max(last, stop) if stop is not None and stop == merkle.stop else last
            state_bytes = FoldState.capture(
                audit, verifier, refold, violations, snapshots, read, at
            )
        if chained and not finished:
            for link in select_links(recorder, last, stop):
                verifier.feed(None, link)  # links after the last event: deleted, or strays
            verifier.finish()
        try:
            # a cut may fall inside a transaction: the event past it may complete it
            past = event if finished else None if stop is None else event_after(app, last)
            audit.finish(past)
        except Exception as error:  # pragma: no cover - a tampered history
            violations.append(Violation(last, "-", "-", "unfoldable", str(error)))
    sealed_at, sealed_read = (0, 0) if resume is None else (resume.last, resume.read)
    # the streams hold no other event
    violations.extend(outside_log(recorder, read, last, sealed_at, sealed_read))
    # a cut by time is the cut by position at the last event read (snapshots past it wait)
    snapshots.finish(last if finished else stop, max(last, verifier.last_position))
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
    return audit, report, state_bytes, refold
