"""Sandboxes, assignments and runners a page at a time: keyset pagination on the log
position of each item's creation (docs/api.md, "Lists").

Each item is created by one event, which never moves: a sandbox by its
``Sandbox.Created``, an assignment by its ``Sandbox.AssignmentFenced``, a runner by its
``Runner.Registered``. A page lists the items created after the cursor's position, in
creation order, as they are now (state, drain phase, capacity), those the filters let
through; its ``next`` cursor holds the position of the last creation it read. Because
positions only grow (:mod:`.reading`), paging from the first page to the last while
writes go on returns every item exactly once: an item never moves between pages, and
one created meanwhile is on a later page. A filter on what changes (an assignment's
state, a runner's drain phase) is applied as each page is read: an item that stops or
starts matching meanwhile may be on no page, never on two. A deregistered runner is
on none.

``limit`` is the items per page (default 100; more than 1,000 is served as 1,000); a
page also ends after :data:`SCAN_BUDGET` creations read, so a narrow filter's pages
may be short, even empty, with a ``next`` all the same; and after
:data:`POSITION_WINDOW` positions of the log, so that no page's query reads the whole
log looking for creations that are rare in it. ``next`` is None after the
last page. A cursor is opaque text, valid for its own list only; anything else is
refused (``InvalidRequestError`` on ``cursor``).

The items' current values come from the read models when this process has them (one
query a page), else from the aggregates; an item a lagging read model does not hold
yet is folded from its aggregates, so it is never skipped.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from eventsourcing.persistence import Notification

try:
    from orjson import loads as _loads
except ImportError:  # without the [fast] extra
    from json import loads as _loads  # type: ignore[assignment]

from secondbox_scheduler.domain.assignment import STATES
from secondbox_scheduler.domain.errors import InvalidRequestError, NotFoundError
from secondbox_scheduler.domain.event_topics import topics_of
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    DurableAssignment,
    RunnerSnapshot,
    require_text,
)
from secondbox_scheduler.infrastructure.feed.reading import MAX_POSITION, page_limit
from secondbox_scheduler.projections.assignments import row_to_assignment
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import select_page
from secondbox_scheduler.projections.runner_snapshots import row_to_snapshot

if TYPE_CHECKING:
    from secondbox_scheduler.infrastructure.application import SchedulerApplication

SCAN_BUDGET = 10_000  # creations one page reads at most
POSITION_WINDOW = 1_000_000  # log positions one page covers at most
READ_PAGE = 1000
SANDBOXES, ASSIGNMENTS, RUNNERS = "sandboxes", "assignments", "runners"
DRAIN_PHASES = (DRAIN_PHASE_ACTIVE, DRAIN_PHASE_DRAINING)
T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next: str | None  # the cursor of the following page; None: this was the last


@dataclass(frozen=True)
class SandboxSummary:
    """One sandbox as the list shows it: its pinned fields, its home runner, its
    current generation and that generation's assignment state (None: not scheduled)."""

    sandbox_id: str
    workspace_id: str
    profile_revision_id: str
    pool_name: str
    home_runner_id: str
    generation: int
    state: str | None
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "workspace_id": self.workspace_id,
            "profile_revision_id": self.profile_revision_id,
            "pool_name": self.pool_name,
            "home_runner_id": self.home_runner_id,
            "generation": self.generation,
            "state": self.state,
            "created_at": self.created_at.isoformat(),
        }


def cursor_text(kind: str, position: int) -> str:
    raw = f"{kind}:{position}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor_position(kind: str, cursor: str | None) -> int:
    """The position a cursor of list ``kind`` holds (0 for None: the first page)."""
    if cursor is None:
        return 0
    rule = "must be the next cursor of an earlier page of this list"
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 64 or not cursor.isascii():
        raise InvalidRequestError("cursor", rule)
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, ValueError):
        raise InvalidRequestError("cursor", rule) from None
    found_kind, _, number = text.partition(":")
    if found_kind != kind or not number.isdigit() or len(number) > 19:
        raise InvalidRequestError("cursor", rule)
    position = int(number)
    if position > MAX_POSITION or cursor_text(kind, position) != cursor:
        raise InvalidRequestError("cursor", rule)
    return position


def _page(
    app: SchedulerApplication,
    kind: str,
    creation: type[Any],
    cursor: str | None,
    limit: int | None,
    resolve: Callable[[list[Any]], list[T | None]],
    scan_budget: int,
    narrow: bool,
    extract: Callable[[EventDecoder, Notification], Any] | None = None,
) -> Page[T]:
    """Read creations after the cursor, resolve them a read page at a time into items
    (None: not listed), and stop at ``limit`` items or the scan budget. ``extract``:
    what ``resolve`` gets of each creation (by default the decoded event)."""
    position = cursor_position(kind, cursor)
    wanted = page_limit(limit)
    topics = topics_of(creation)
    decoder = EventDecoder(app.mapper)
    decode = decoder if extract is None else partial(extract, decoder)
    head = app.recorder.max_notification_id() or 0  # before the reads: all up to it are in
    end = max(position, min(position + POSITION_WINDOW, head))  # this page: (position, end]
    found: list[T] = []
    scanned = 0
    while position < end:
        size = min(READ_PAGE, scan_budget - scanned)
        if not narrow:  # every creation is an item: read no more than the page needs
            size = min(size, wanted - len(found))
        notifications = select_page(app.recorder, position, end, topics, size)
        events = [decode(n) for n in notifications]
        for notification, item in zip(notifications, resolve(events), strict=True):
            scanned += 1
            position = notification.id
            if item is None:
                continue
            found.append(item)
            if len(found) == wanted:
                return Page(found, cursor_text(kind, position))
        if len(notifications) < size:  # every position up to ``end`` is read
            break
        if scanned >= scan_budget:
            return Page(found, cursor_text(kind, position))
    return Page(found, cursor_text(kind, end) if end < head else None)


def list_sandboxes(
    app: SchedulerApplication,
    *,
    cursor: str | None = None,
    limit: int | None = None,
    pool_name: str | None = None,
    home_runner_id: str | None = None,
    scan_budget: int = SCAN_BUDGET,
) -> Page[SandboxSummary]:
    """The sandboxes in creation order (of a pool, homed on a runner)."""
    _names(pool_name=pool_name, home_runner_id=home_runner_id)

    def resolve(events: list[Any]) -> list[SandboxSummary | None]:
        found: list[SandboxSummary | None] = []
        for event in events:
            requirements = event.requirements
            if (pool_name is not None and requirements.get("pool_name") != pool_name) or (
                home_runner_id is not None and event.home_runner_id != home_runner_id
            ):
                found.append(None)
                continue
            sandbox = app.queries.sandbox(event.sandbox_id, copy=False)
            current = sandbox.assignment()
            found.append(
                SandboxSummary(
                    sandbox_id=sandbox.sandbox_id,
                    workspace_id=sandbox.workspace_id,
                    profile_revision_id=sandbox.profile_revision_id,
                    pool_name=str(requirements.get("pool_name")),
                    home_runner_id=sandbox.home_runner_id,
                    generation=sandbox.generation,
                    state=None if current is None else current["state"],
                    created_at=event.timestamp,
                )
            )
        return found

    narrow = (pool_name, home_runner_id) != (None, None)
    return _page(app, SANDBOXES, Sandbox.Created, cursor, limit, resolve, scan_budget, narrow)


def list_assignments(
    app: SchedulerApplication,
    *,
    cursor: str | None = None,
    limit: int | None = None,
    state: str | None = None,
    runner_id: str | None = None,
    sandbox_id: str | None = None,
    scan_budget: int = SCAN_BUDGET,
) -> Page[DurableAssignment]:
    """Every generation's assignment in the order they were fenced (in a state, on a
    runner, of a sandbox): e.g. every ``uncertain`` one."""
    if state is not None and state not in STATES:
        raise InvalidRequestError("state", f"must be one of {', '.join(STATES)}")
    _names(runner_id=runner_id, sandbox_id=sandbox_id)

    def resolve(fenced: list[tuple[str, int, str]]) -> list[DurableAssignment | None]:
        keys = [
            (sandbox, generation)
            if runner_id in (None, runner) and sandbox_id in (None, sandbox)
            else None
            for sandbox, generation, runner in fenced
        ]
        current = _assignments_now(app, [key for key in keys if key is not None], state)
        found: list[DurableAssignment | None] = []
        for key in keys:
            assignment = None if key is None else current.get(key)
            if assignment is not None and (state is None or assignment.state == state):
                found.append(assignment)
            else:
                found.append(None)
        return found

    narrow = (state, runner_id, sandbox_id) != (None, None, None)
    return _page(
        app, ASSIGNMENTS, Sandbox.AssignmentFenced, cursor, limit, resolve, scan_budget, narrow,
        _fenced_key,
    )  # fmt: skip


def _fenced_key(decode: EventDecoder, notification: Notification) -> tuple[str, int, str]:
    """The sandbox, generation and runner of a ``Sandbox.AssignmentFenced``: read from
    its stored JSON when the store keeps plain JSON (no cipher or compressor), without
    decoding its placement evidence (most of the event, and of the time a list of them
    took); else from the decoded event. The three fields are the same in every version
    of the event (its upcasts change others)."""
    mapper = decode.mapper
    if not getattr(mapper, "cipher", None) and not getattr(mapper, "compressor", None):
        try:
            record = _loads(notification.state)["assignment"]
            found = (record["sandbox_id"], record["generation"], record["runner_id"])
        except (ValueError, KeyError, TypeError):
            found = None
        if (
            found is not None
            and type(found[0]) is str
            and type(found[1]) is int
            and type(found[2]) is str
        ):
            return found
    record = decode(notification).assignment
    return (record["sandbox_id"], record["generation"], record["runner_id"])


def list_runners(
    app: SchedulerApplication,
    *,
    cursor: str | None = None,
    limit: int | None = None,
    pool_name: str | None = None,
    drain_phase: str | None = None,
    scan_budget: int = SCAN_BUDGET,
) -> Page[RunnerSnapshot]:
    """The registered runners in registration order (of a pool, in a drain phase)."""
    if drain_phase is not None and drain_phase not in DRAIN_PHASES:
        raise InvalidRequestError("drain_phase", f"must be one of {', '.join(DRAIN_PHASES)}")
    _names(pool_name=pool_name)

    def resolve(events: list[Any]) -> list[RunnerSnapshot | None]:
        ids = [
            event.runner_id if pool_name is None or event.pool_name == pool_name else None
            for event in events
        ]
        current = _runners_now(app, [runner_id for runner_id in ids if runner_id is not None])
        found: list[RunnerSnapshot | None] = []
        for runner_id in ids:
            snapshot = None if runner_id is None else current.get(runner_id)
            if snapshot is not None and (
                drain_phase is None or snapshot.drain_phase == drain_phase
            ):
                found.append(snapshot)
            else:
                found.append(None)
        return found

    # a deregistered runner is no item: always read a full page of registrations
    return _page(app, RUNNERS, Runner.Registered, cursor, limit, resolve, scan_budget, True)


def _names(**values: str | None) -> None:
    for name, value in values.items():
        if value is not None:
            require_text(name, value)


def _marks(count: int) -> str:
    return ", ".join("%s" for _ in range(count))


def _assignments_now(
    app: SchedulerApplication, keys: Sequence[tuple[str, int]], state: str | None = None
) -> dict[tuple[str, int], DurableAssignment]:
    """The assignments of ``keys`` as they are now (those in ``state``, if given): from
    the read model (one query; only the rows in the state are decoded), those it lacks
    folded from their sandbox."""
    found: dict[tuple[str, int], DurableAssignment] = {}
    if not keys:
        return found
    held: set[tuple[str, int]] = set()  # in the read model, in another state
    read_models = app.current_read_models()
    if read_models is not None:
        sandboxes = sorted({sandbox for sandbox, _ in keys})
        rows = read_models.assignments.query(
            f"SELECT * FROM {{table}} WHERE sandbox_id IN ({_marks(len(sandboxes))})", sandboxes
        )
        wanted = set(keys)
        for row in rows:
            key = (row["sandbox_id"], int(row["generation"]))
            if key not in wanted:
                continue
            if state is None or row["state"] == state:
                found[key] = row_to_assignment(row)
            else:
                held.add(key)
    for key in keys:
        if key not in found and key not in held:
            assignment = app.get_assignment(*key)
            if assignment is not None:
                found[key] = assignment
    return found


def _runners_now(app: SchedulerApplication, ids: Sequence[str]) -> dict[str, RunnerSnapshot]:
    """The snapshots of the runners ``ids`` still registered: from the read model (one
    query), those it lacks folded from their aggregates."""
    found: dict[str, RunnerSnapshot] = {}
    gone: set[str] = set()
    if not ids:
        return found
    read_models = app.current_read_models()
    if read_models is not None:
        rows = read_models.runners.query(
            f"SELECT * FROM {{table}} WHERE runner_id IN ({_marks(len(ids))})", list(ids)
        )
        for row in rows:
            if row["deregistered"]:
                gone.add(row["runner_id"])
            else:
                found[row["runner_id"]] = row_to_snapshot(row)
    for runner_id in ids:
        if runner_id not in found and runner_id not in gone:
            try:
                found[runner_id] = app.fold_runner(runner_id)
            except NotFoundError:  # deregistered
                continue
    return found
