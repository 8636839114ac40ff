"""``audit verify`` over several processes (``--workers N``, docs/audit.md, "Verifying
in several processes").

A verify does two kinds of work over the log, and neither needs the other's results:

- the **fold** (:class:`~secondbox_scheduler.domain.audit.fold.AuditFold`): every event
  decoded and applied in log order, then the end of the log judged and the streams
  compared with the log (:func:`.streams.outside_log`);
- the **row checks**: the hash chain (each stored row against its link, the link
  against the stored link it names), the Merkle tree refolded from the stored rows, and
  the snapshot check (each snapshotted stream refolded from its own events).

:func:`parallel_fold` runs the fold in this process and the row checks in a child
process (``workers`` 2: the chain, the Merkle tree and the snapshot check, which decodes
the events of the snapshotted streams again), or the snapshot check in a second child
(``workers`` 3). The fold is the larger part (decoding every event, checking every
placement): its process does nothing else.
Each child has its own connection to the store and reads the same range of the log
(positions up to the head when the verify started, or up to ``--until``). The results
are put together as the serial verify (:func:`.verify._checked_fold`) puts them, so the
findings are the same list in the same order (``tests/test_audit_parallel.py``). A
child that fails is run again in this process, after the fold: its error, if any, is
then the serial verify's.

The children are forked (no second import of the package: about 0.8 s of CPU here),
so this runs only where ``fork`` is available and the store is one a second process
can open (PostgreSQL, an SQLite file); elsewhere, and for a verify that cuts by time,
resumes from a fold state or seals one, :func:`.verify.verify` runs serially.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.sqlite import SQLiteApplicationRecorder

from secondbox_scheduler.domain.audit.chain import (
    ChainVerifier,
    Checkpoint,
    Finding,
    Link,
)
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.merkle import MerkleRefold
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import PAGE, READ_PAGE, event_after
from secondbox_scheduler.infrastructure.audit.row_steps import (
    feed_row,
    link_at,
    unfoldable,
    unreadable,
)
from secondbox_scheduler.infrastructure.audit.snapshot_check import SnapshotCheck
from secondbox_scheduler.infrastructure.audit.streams import outside_log
from secondbox_scheduler.infrastructure.settings import BATCHING, READ_MODELS, RUNNER_LOCKS
from secondbox_scheduler.infrastructure.store.chain_reads import select_links
from secondbox_scheduler.infrastructure.store.chain_tables import ChainedRecorder
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import gc_paused, read_rows

MAX_WORKERS = 3  # the fold, the chain and Merkle tree, the snapshot check


def default_workers() -> int:
    """``--workers`` when not given: 2 on a machine with two cores or more, else 1."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def can_fork(app: SchedulerApplication) -> bool:
    """Whether a forked process can open this store on its own."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    recorder = app.recorder
    if isinstance(recorder, PostgresApplicationRecorder):
        return True
    if isinstance(recorder, SQLiteApplicationRecorder):
        pool = getattr(recorder.datastore, "pool", None)
        return pool is not None and not getattr(pool, "is_sqlite_memory_mode", True)
    return False


@dataclass
class FoldResult:
    """The fold's part: the fold, its loop's findings, how far it read."""

    audit: AuditFold
    violations: list[Violation]
    read: int
    last: int


@dataclass
class RowResult:
    """The row checks' part, as plain values (sent back from a child by pickle)."""

    chain: bool = False  # this part checked the chain and refolded the tree
    snapshots: bool = False  # this part checked the snapshots
    last: int = 0
    findings: list[Finding] = field(default_factory=list)
    unchained_until: int = 0
    links_checked: int = 0
    head: Link | None = None
    last_position: int = 0
    refold: tuple[int, list[tuple[int, bytes]], dict[int, bytes | None]] = (0, [], {})
    snapshot_violations: list[Violation] = field(default_factory=list)
    snapshots_checked: int = 0


def fold_part(
    app: SchedulerApplication,
    read_until: int | None,
    stop: int | None,
    progress: Callable[[int], None],
) -> FoldResult:
    """The fold over positions up to ``read_until`` (the serial loop without the row
    checks), the end of the log judged as the serial verify judges it at ``stop``."""
    recorder = app.recorder
    audit = AuditFold(compact=True)
    audit.auditor_clock = app.now()  # no event is recorded later (rule time-order)
    decode = EventDecoder(app.mapper)
    violations: list[Violation] = []
    read = last = 0
    with gc_paused():
        pages = read_rows(
            recorder,
            after=0,
            until=read_until,
            page_size=READ_PAGE,
            first_page_size=PAGE,
            read_ahead=True,
        )
        decode_row, apply = decode.row, audit.apply
        for page in pages:
            for row in page:
                event: Any = None
                try:
                    event = decode_row(row)
                except Exception as error:
                    violations.append(unreadable(row, error))
                if event is not None:
                    try:
                        apply(row[0], event)
                    except Exception as error:
                        violations.append(unfoldable(row, event, error))
            # progress every PAGE events, as the serial verify reports it
            for _ in range((read + len(page)) // PAGE - read // PAGE):
                progress(PAGE)
            read += len(page)
            last = page[-1][0]
        try:
            # a cut may fall inside a transaction: the event past it may complete it
            audit.finish(None if stop is None else event_after(app, last))
        except Exception as error:  # pragma: no cover - a tampered history
            violations.append(Violation(last, "-", "-", "unfoldable", str(error)))
    violations.extend(outside_log(recorder, read, last))
    return FoldResult(audit, violations, read, last)


def _chain_end(recorder: object, last: int, stop: int | None) -> int:
    """The chain verifier's last position at the end of a verify that read the log up to
    ``last``, without the chain checked here: the last link up to ``stop``, if later."""
    if not isinstance(recorder, ChainedRecorder):
        return last
    return max([last, *(link.position for link in select_links(recorder, last, stop))])


def row_part(
    app: SchedulerApplication,
    read_until: int | None,
    stop: int | None,
    checkpoint: Checkpoint | bytes | None,
    watched: list[int],
    chain: bool,
    snapshots: bool,
) -> RowResult:
    """The chain and Merkle tree (``chain``) and the snapshot check (``snapshots``) over
    positions up to ``read_until``, the links after them up to ``stop`` (None: every
    one), as the serial verify checks them."""
    recorder = app.recorder
    chained = chain and isinstance(recorder, ChainedRecorder)
    verifier = ChainVerifier(app.chain, lookup=lambda at: _link_at(recorder, at))
    check = SnapshotCheck(app) if snapshots else None
    refold = MerkleRefold(watched)
    if checkpoint is not None:
        verifier.expect(checkpoint)
    decode = EventDecoder(app.mapper)
    wanted: dict[Any, int] = {}
    last = 0
    with gc_paused():
        pages = read_rows(
            recorder,
            after=0,
            until=read_until,
            page_size=READ_PAGE,
            first_page_size=PAGE,
            read_ahead=True,
        )
        for page in pages:
            end = page[-1][0]
            links = select_links(recorder, last, end) if chained else []
            if check is not None:
                check.page(last, end)
                wanted = check.last
            index = 0
            for row in page:
                if chain:
                    index, link = link_at(verifier, links, index, row[0])
                    feed_row(verifier, refold, row, link, chained)
                if check is not None and (
                    row[1] in wanted or type(row[1]) is not UUID
                ):  # the check passes over the events of streams without snapshots
                    try:
                        event: Any = decode.row(row)
                    except Exception:  # unreadable: the fold names it
                        continue
                    check.apply(event)
            for link in links[index:]:
                verifier.feed(None, link)
            last = end
        if chained:
            for link in select_links(recorder, last, stop):
                verifier.feed(None, link)  # links after the last event: deleted, or strays
            verifier.finish()
            if checkpoint is not None:
                verifier.check(checkpoint)
        end = max(last, verifier.last_position) if chain else _chain_end(recorder, last, stop)
    result = RowResult(chain=chain, snapshots=snapshots, last=last)
    if chain:
        result.findings = verifier.findings
        result.unchained_until = verifier.unchained_until
        result.links_checked = verifier.links_checked
        result.head = verifier.head
        result.last_position = verifier.last_position
        result.refold = (refold.size, refold.stack, refold.watched)
    if check is not None:
        check.finish(stop, end)
        result.snapshot_violations = check.violations
        result.snapshots_checked = check.checked
    return result


def _link_at(recorder: object, position: int) -> Link | None:
    links = select_links(recorder, position - 1, position)
    return links[0] if links else None


def _child(
    connection: Any,
    env: dict[str, str],
    arguments: tuple[Any, ...],
) -> None:
    """A forked process: its own application on the store, one :func:`row_part`."""
    try:
        app = SchedulerApplication(env={**env, READ_MODELS: "off", RUNNER_LOCKS: "off",
                                        BATCHING: "off"})  # fmt: skip
        try:
            result = row_part(app, *arguments)
        finally:
            app.close()
        connection.send(("ok", result))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def parallel_fold(
    app: SchedulerApplication,
    workers: int,
    stop: int | None,
    progress: Callable[[int], None],
    checkpoint: Checkpoint | bytes | None,
    watched: list[int],
) -> tuple[FoldResult, RowResult, RowResult]:
    """The fold here, the row checks in ``workers - 1`` forked processes (module
    docstring). Returns the fold's part, the chain's, the snapshots'."""
    head = app.recorder.max_notification_id() or 0
    read_until = head if stop is None else min(stop, head)
    env = dict(app.env)
    # 2: the snapshot check beside the chain, on the events of its streams it decodes
    parts = [(True, True)] if workers <= 2 else [(True, False), (False, True)]
    context = multiprocessing.get_context("fork")
    children = []
    for chain, snapshots in parts:
        arguments = (read_until, stop, checkpoint, watched, chain, snapshots)
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_child, args=(sender, env, arguments), daemon=True)
        process.start()
        sender.close()
        children.append((process, receiver, arguments))
    try:
        folded = fold_part(app, read_until, stop, progress)
    except BaseException:  # the fold's error (or an interrupt) is the verify's: no wait
        for process, receiver, _ in children:
            process.terminate()
            process.join()
            receiver.close()
        raise
    results = [_result(app, *child) for child in children]
    return folded, results[0], results[-1]


def _result(
    app: SchedulerApplication, process: Any, receiver: Any, arguments: tuple[Any, ...]
) -> RowResult:
    """A child's result; a child that failed or died: its part run here."""
    answer: Any = None
    try:
        answer = receiver.recv()
    except EOFError:
        pass
    finally:
        receiver.close()
        process.join()
    if answer is not None and answer[0] == "ok":
        result: RowResult = answer[1]
        return result
    return row_part(app, *arguments)
