"""``audit verify`` streams, and its cost per snapshot does not grow with what the
snapshot holds beyond encoding it once (counted, not timed: docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import log_events
from secondbox_scheduler.infrastructure.audit.snapshot_check import STATE_CHUNK_ROWS, SnapshotCheck
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.tools.bench.audit_history import (
    one_runner_history,
    steady_history,
)
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import read_pages


def _app(tmp_path: Path) -> SchedulerApplication:
    return SchedulerApplication(env={DATABASE_URL: f"sqlite:///{tmp_path / 'audit.db'}"})


def test_busy_runner_snapshots_are_compared_without_decoding_them(tmp_path: Path) -> None:
    """Each snapshot of a runner with hundreds of live reservations is checked by one
    encoding of the refolded runner, never decoded (three decodings of every
    reservation per snapshot made the audit quadratic in a runner's reservations), and
    the check holds one chunk of snapshot states at a time, never the table."""
    app = _app(tmp_path)
    one_runner_history(app, 300)
    check = SnapshotCheck(app)
    decode = EventDecoder(app.mapper)
    last, held = 0, 0
    for page in read_pages(app.recorder, page_size=100):
        check.page(last, page[-1].id)
        for notification in page:
            check.apply(decode(notification))
            held = max(held, len(check.rows))
        last = page[-1].id
    check.finish(None, last)
    assert check.checked == len(check.positions) > 3
    assert check.violations == []
    assert check.decoded == 0
    assert held < STATE_CHUNK_ROWS
    app.close()


def test_past_generations_are_not_kept(tmp_path: Path) -> None:
    """A steady fleet's log grows by generations; the fold of ``audit verify`` keeps no
    record of a past generation released as it should be (a range of generations per
    sandbox, and 16 bytes of each generation's token), so the records it holds are one
    per sandbox, whatever the length of the log."""
    app = _app(tmp_path)
    steady_history(app, 400, runners=2, sandboxes=6)
    audit = AuditFold(compact=True)
    for position, event in log_events(app, None):
        audit.apply(position, event)
    audit.finish()
    assert audit.violations == []
    sandboxes = [s.sandbox for s in audit._streams.values() if s.sandbox is not None]
    assert len(sandboxes) == 6
    for sandbox in sandboxes:
        assert sandbox.generation > 2
        assert set(sandbox.assignments) <= {sandbox.generation}
        assert sandbox.dropped == [range(1, sandbox.generation)]
        assert len(sandbox.tokens) == len(range(1, sandbox.generation)) + len(sandbox.assignments)
    app.close()
