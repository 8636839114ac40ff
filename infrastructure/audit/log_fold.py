"""The notification log of a store, read in order and folded by the audit fold.

Where a replay stops (``--until``/``--at``: a notification position or a time), the
events in log order, and :func:`fold`: the log folded by
:class:`secondbox_scheduler.domain.audit.fold.AuditFold` without any other check (``audit
state``, the fault-injection run). ``audit verify`` (:mod:`.verify`) reads the log
itself, to check the chain position by position beside the fold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import gc_paused, read_pages

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


def log_events(app: SchedulerApplication, until: Until) -> Iterator[tuple[int, Any]]:
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


def event_after(app: SchedulerApplication, position: int) -> Any | None:
    """The event just past ``position`` (None at the end of the log, or unreadable): the
    rest of a transaction that a cut at ``position`` splits (``AuditFold.finish``)."""
    page = app.recorder.select_notifications(start=position + 1, limit=1)
    if not page:
        return None
    try:
        return EventDecoder(app.mapper)(page[0])
    except Exception:  # unreadable: verify names it when it reads that far
        return None


def fold(
    app: SchedulerApplication, until: Until = None, progress: Callable[[int], None] = lambda _: None
) -> AuditFold:
    audit = AuditFold()
    with gc_paused():
        for count, (position, event) in enumerate(log_events(app, until), start=1):
            audit.apply(position, event)
            if count % PAGE == 0:
                progress(PAGE)
        audit.finish()
    return audit
