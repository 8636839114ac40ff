"""``/v1/events``: the event feed, a page at a time (long-polling with ``wait``), and
``/v1/events/stream``, the same as server-sent events (docs/api.md, "Event feed").

A page holds the events after ``after`` in log order, those the filters let through
(``type``, repeatable; ``sandbox_id``, ``runner_id``, ``pool_name``), and ``next``,
the position to ask after next time (:mod:`secondbox_scheduler.infrastructure.feed.reading`).
With ``wait`` (seconds), a page that would be empty waits, up to that long, for the
first event that passes, then answers at once. The stream sends each event as
``id: POSITION``, ``event: TYPE`` and ``data: JSON`` (the page's event object); a
client that reconnects with ``Last-Event-ID`` (EventSource does) continues right
after it. Positions the filters skipped are sent as an ``id`` alone, so that a
reconnecting client does not read them again. A stream stays open for ``timeout``
seconds (default 60), then ends: the client reconnects, and a service that stops
ends its streams within that time.

The reads run in the thread pool; the waits are asynchronous (an idle follower holds
no thread). The longest wait and stream a service grants are ``app.state``'s
``feed_max_wait_seconds`` (30) and ``feed_max_stream_seconds`` (300): longer asks are
served as those.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.limits import MAX_ITEMS, MAX_NAME_LENGTH
from secondbox_scheduler.infrastructure.feed.reading import (
    MAX_LIMIT,
    MAX_POSITION,
    POLL_SECONDS,
    FeedFilter,
    FeedPage,
    read_feed,
)
from secondbox_scheduler.infrastructure.feed.wire import event_json
from secondbox_scheduler.infrastructure.http.common import CellName, Scheduler, cell_log, respond
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/events", tags=["events"], responses=ERROR_RESPONSES)

MAX_WAIT_SECONDS = 30.0  # the longest long-poll by default (app.state.feed_max_wait_seconds)
MAX_STREAM_SECONDS = 300.0  # the longest stream by default (feed_max_stream_seconds)
DEFAULT_STREAM_SECONDS = 60.0
KEEP_ALIVE_SECONDS = 15.0  # a comment line this often on an idle stream
RETRY_MILLISECONDS = 1000  # the stream's reconnection delay hint (retry:)


class ActorOut(BaseModel):
    kind: str
    name: str | None = None
    role: str | None = None


class EventOut(BaseModel):
    """One event of the log (docs/events.md gives each type's ``data``)."""

    position: int = Field(description="The event's position in the log: the cursor.")
    type: str = Field(description="The event type, e.g. Sandbox.AssignmentFenced.")
    stream_id: str = Field(description="The aggregate's stream id (a UUID).")
    stream_version: int = Field(description="The event's version in its stream.")
    timestamp: str | None = Field(description="When it was recorded (ISO 8601).")
    actor: ActorOut | None = Field(description="Who asked (null: recorded before 0.3).")
    sandbox_id: str | None = Field(description="The sandbox it concerns, if any.")
    runner_id: str | None = Field(description="The runner it concerns, if any.")
    pool_name: str | None = Field(description="The pool it concerns, if any.")
    data: dict[str, Any] = Field(description="The event's attributes.")


class EventPage(BaseModel):
    events: list[EventOut]
    next: int = Field(description="Ask with after=next for the following events.")
    head: int = Field(description="The log's head position when the page was read.")


After = Annotated[
    int,
    Query(ge=0, le=MAX_POSITION, description="Events after this position (0: from the start)."),
]
Limit = Annotated[
    int | None,
    Query(
        ge=1,
        description=f"Events per page (default 100; more than {MAX_LIMIT} is served as "
        f"{MAX_LIMIT}).",
    ),
]
Types = Annotated[
    list[str] | None,
    Query(
        alias="type",
        max_length=MAX_ITEMS,
        description="Only events of these types (repeatable), e.g. Sandbox.AssignmentFenced.",
    ),
]
Name = Annotated[str | None, Query(min_length=1, max_length=MAX_NAME_LENGTH)]


def _filter(
    types: list[str] | None, sandbox_id: str | None, runner_id: str | None, pool_name: str | None
) -> FeedFilter:
    return FeedFilter(tuple(types or ()), sandbox_id, runner_id, pool_name)


def _granted(request: Request, name: str, default: float, asked: float) -> float:
    maximum = getattr(request.app.state, name, default)
    return max(0.0, min(float(asked), float(maximum)))


async def _next_page(
    app: Any, after: int, limit: int | None, feed_filter: FeedFilter, wait: float
) -> FeedPage:
    """A page; while it is empty and caught up, read again until ``wait`` has passed."""
    deadline = time.monotonic() + wait
    while True:
        page = await run_in_threadpool(read_feed, app, after, limit, feed_filter)
        if page.events or page.more or time.monotonic() >= deadline:
            return page
        after = page.next
        await asyncio.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def _page_json(page: FeedPage) -> EventPage:
    return EventPage(
        events=[EventOut.model_validate(event_json(e)) for e in page.events],
        next=page.next,
        head=page.head,
    )


@router.get("", response_model=EventPage, summary="Events in log order")
async def list_events(
    request: Request,
    app: Scheduler,
    after: After = 0,
    limit: Limit = None,
    wait: Annotated[
        float,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Seconds to wait for an event when none is there yet (long poll; "
            "at most the service's maximum, 30 by default).",
        ),
    ] = 0,
    types: Types = None,
    sandbox_id: Name = None,
    runner_id: Name = None,
    pool_name: Name = None,
    cell: CellName = None,
) -> Response:
    """The events after ``after``, in log order, filtered, at most ``limit``; continue
    with ``after=next``. With ``wait``, an empty page waits for the first new event."""
    app = cell_log(app, cell)
    feed_filter = _filter(types, sandbox_id, runner_id, pool_name)
    granted = _granted(request, "feed_max_wait_seconds", MAX_WAIT_SECONDS, wait)
    page = await _next_page(app, after, limit, feed_filter, granted)
    return respond(_page_json(page))


def _last_event_id(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) > MAX_POSITION:
        raise InvalidRequestError(
            "Last-Event-ID", f"must be an event position from 0 to {MAX_POSITION}"
        )
    return int(text)


STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-sent events: id (the position), event (the type), data (the "
        "event as JSON, as in GET /v1/events).",
        "content": {
            "text/event-stream": {
                "schema": {  # one event (OpenAPI 3.2, "Server-Sent Events")
                    "type": "object",
                    "properties": {
                        "data": {"type": "string"},
                        "event": {"type": "string"},
                        "id": {"type": "string"},
                        "retry": {"type": "integer", "minimum": 0},
                    },
                }
            }
        },
    }
}


@router.get(
    "/stream",
    response_class=Response,
    responses=STREAM_RESPONSES,
    summary="Events as server-sent events",
)
async def stream_events(
    request: Request,
    app: Scheduler,
    after: After = 0,
    timeout: Annotated[
        float,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Seconds the stream stays open (default 60, at most the service's "
            "maximum, 300 by default); then it ends and the client reconnects.",
        ),
    ] = DEFAULT_STREAM_SECONDS,
    types: Types = None,
    sandbox_id: Name = None,
    runner_id: Name = None,
    pool_name: Name = None,
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            max_length=32,
            description="Continue after this position (what EventSource sends on reconnect); "
            "it takes precedence over after.",
        ),
    ] = None,
    cell: CellName = None,
) -> Response:
    """Every event after the position, in log order, filtered, as it is written."""
    app = cell_log(app, cell)
    feed_filter = _filter(types, sandbox_id, runner_id, pool_name)
    resumed = _last_event_id(last_event_id)
    start = after if resumed is None else resumed
    duration = _granted(request, "feed_max_stream_seconds", MAX_STREAM_SECONDS, timeout)
    return StreamingResponse(
        _stream(app, start, feed_filter, duration),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _stream(
    app: Any, after: int, feed_filter: FeedFilter, duration: float
) -> AsyncIterator[bytes]:
    ends = time.monotonic() + duration
    quiet_since = time.monotonic()
    yield f"retry: {RETRY_MILLISECONDS}\n\n".encode()
    while True:
        page = await run_in_threadpool(read_feed, app, after, None, feed_filter)
        chunks = [
            f"id: {item.position}\nevent: {item.type}\ndata: "
            f"{json.dumps(event_json(item), separators=(',', ':'))}\n\n"
            for item in page.events
        ]
        last = page.events[-1].position if page.events else after
        if page.next > last:  # positions filtered out: skip them on a reconnect too
            chunks.append(f"id: {page.next}\n\n")
        now = time.monotonic()
        if chunks:
            yield "".join(chunks).encode()
            quiet_since = now
        elif now - quiet_since >= KEEP_ALIVE_SECONDS:
            yield b": keep-alive\n\n"
            quiet_since = now
        after = page.next
        if page.more:
            continue
        if now >= ends:
            return
        await asyncio.sleep(min(POLL_SECONDS, max(0.0, ends - now)))
