"""The lists: ``GET /v1/sandboxes``, ``GET /v1/assignments`` and ``GET /v1/runners``,
a page at a time (docs/api.md, "Lists").

Each answers up to ``limit`` items (default 100; more than 1,000 is served as 1,000)
and ``next``, the cursor of the following page (null after the last); pass it back as
``cursor``. Paging from the first page to the last returns every item once while
writes go on (:mod:`secondbox_scheduler.infrastructure.feed.lists`). A cursor that is
not the ``next`` of this list, a limit below 1 or an unknown state or drain phase is
422 ``invalid_request`` naming the field, like every other invalid input.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH
from secondbox_scheduler.domain.values import RunnerSnapshot
from secondbox_scheduler.infrastructure.feed import lists
from secondbox_scheduler.infrastructure.feed.reading import MAX_LIMIT
from secondbox_scheduler.infrastructure.http.common import Scheduler, respond
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES
from secondbox_scheduler.infrastructure.http.models import AssignmentOut

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

Limit = Annotated[
    int | None,
    Query(
        ge=1,
        description=f"Items per page (default 100; more than {MAX_LIMIT} is served as "
        f"{MAX_LIMIT}).",
    ),
]
Cursor = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=64,
        description="The next cursor of the previous page (none: the first page).",
    ),
]
Name = Annotated[str | None, Query(min_length=1, max_length=MAX_NAME_LENGTH)]
NEXT = Field(description="The cursor of the following page; null after the last page.")


class SandboxOut(BaseModel):
    sandbox_id: str
    workspace_id: str
    profile_revision_id: str
    pool_name: str
    home_runner_id: str
    generation: int = Field(description="The current generation.")
    state: str | None = Field(description="Its assignment's state (null: not scheduled).")
    created_at: datetime


class SandboxPage(BaseModel):
    sandboxes: list[SandboxOut]
    next: str | None = NEXT


class AssignmentPage(BaseModel):
    assignments: list[AssignmentOut]
    next: str | None = NEXT


class RunnerPage(BaseModel):
    runners: list[RunnerSnapshot]
    next: str | None = NEXT


@router.get("/sandboxes", response_model=SandboxPage, tags=["sandboxes"], summary="Sandboxes")
async def list_sandboxes(
    app: Scheduler,
    limit: Limit = None,
    cursor: Cursor = None,
    pool_name: Name = None,
    home_runner_id: Name = None,
) -> Response:
    """The sandboxes in creation order (of a pool, homed on a runner), as they are now."""
    page = await run_in_threadpool(
        lambda: lists.list_sandboxes(
            app, cursor=cursor, limit=limit, pool_name=pool_name, home_runner_id=home_runner_id
        )
    )
    return respond(
        SandboxPage(
            sandboxes=[SandboxOut.model_validate(s.to_dict()) for s in page.items],
            next=page.next,
        )
    )


@router.get(
    "/assignments", response_model=AssignmentPage, tags=["sandboxes"], summary="Assignments"
)
async def list_assignments(
    app: Scheduler,
    limit: Limit = None,
    cursor: Cursor = None,
    state: Annotated[
        str | None,
        Query(
            max_length=32,
            description="Only assignments in this state: assigned, running, released, "
            "failed, uncertain.",
        ),
    ] = None,
    runner_id: Name = None,
    sandbox_id: Name = None,
) -> Response:
    """Every generation's assignment in the order they were fenced, as they are now (in
    a state, e.g. every ``uncertain`` one; on a runner; of a sandbox)."""
    page = await run_in_threadpool(
        lambda: lists.list_assignments(
            app,
            cursor=cursor,
            limit=limit,
            state=state,
            runner_id=runner_id,
            sandbox_id=sandbox_id,
        )
    )
    return respond(
        AssignmentPage(assignments=[AssignmentOut.of(a) for a in page.items], next=page.next)
    )


@router.get("/runners", response_model=RunnerPage, tags=["runners"], summary="Runners")
async def list_runners(
    app: Scheduler,
    limit: Limit = None,
    cursor: Cursor = None,
    pool_name: Name = None,
    drain_phase: Annotated[
        str | None,
        Query(max_length=32, description="Only runners in this drain phase: active, draining."),
    ] = None,
) -> Response:
    """The registered runners in registration order (of a pool, in a drain phase)."""
    page = await run_in_threadpool(
        lambda: lists.list_runners(
            app, cursor=cursor, limit=limit, pool_name=pool_name, drain_phase=drain_phase
        )
    )
    return respond(RunnerPage(runners=page.items, next=page.next))
