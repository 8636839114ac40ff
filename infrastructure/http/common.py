"""What the HTTP routes share: the application they serve, their path parameters, and
answering with a pydantic model serialised once.

Routes return a :class:`~starlette.responses.Response` they built from their response
model (``model_dump_json``), so FastAPI neither dumps the model to a dict nor validates
it again; the ``response_model`` each route declares is for the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from pydantic import BaseModel
from starlette.responses import Response

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter

INT64_MAX = 2**63 - 1
# What a service serves: one application, or a router over cells (infrastructure/cells/).
Served = SchedulerApplication | CellRouter


async def scheduler(request: Request) -> Served:
    """The application, or the cell router, this service serves (``app.state.scheduler``).
    A coroutine: FastAPI runs a plain function dependency on its thread pool, a hop of
    every request between the event loop and a thread for one attribute read (found
    profiling ``schedule``)."""
    app = request.app.state.scheduler
    assert isinstance(app, (SchedulerApplication, CellRouter))
    return app


Scheduler = Annotated[Served, Depends(scheduler)]


def sandbox_application(app: Served, sandbox_id: str) -> SchedulerApplication:
    """The application that holds ``sandbox_id`` (over cells: its cell's)."""
    return app if isinstance(app, SchedulerApplication) else app.sandbox_application(sandbox_id)


def runner_application(app: Served, runner_id: str) -> SchedulerApplication:
    """The application that holds ``runner_id`` (over cells: its cell's)."""
    return app if isinstance(app, SchedulerApplication) else app.runner_application(runner_id)


CellName = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="The cell whose log to read (required when the service serves "
        "several cells: each has its own log, positions and Merkle tree).",
    ),
]


def cell_log(app: Served, cell: str | None) -> SchedulerApplication:
    """The application whose log a route reads: over several cells ``cell`` names one
    (required there; an unknown name is refused naming ``cell``); one cell or one
    store: that one (``cell``, if given, must be its name)."""
    if isinstance(app, SchedulerApplication):
        return app
    names = list(app.names)
    if cell is None and len(names) == 1:
        cell = names[0]
    if cell not in names:
        raise InvalidRequestError(
            "cell", f"must name the cell whose log to read: one of {', '.join(names)}", cell
        )
    return app.application(cell)


def tokens_application(app: Served) -> SchedulerApplication:
    """The application whose store keeps the access tokens (over cells: the first cell
    of the cells file's)."""
    return app if isinstance(app, SchedulerApplication) else app.application(app.names[0])


RunnerId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="The runner's id, percent-encoded.",
        examples=["runner-1"],
    ),
]
SandboxId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="The sandbox's id, percent-encoded.",
        examples=["sbx-1"],
    ),
]
GenerationPath = Annotated[
    int, Path(ge=1, le=INT64_MAX, description="The sandbox generation.", examples=[1])
]
GenerationQuery = Annotated[
    int | None,
    Query(ge=1, le=INT64_MAX, description="A generation (default: the current one)."),
]
PoolQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=MAX_NAME_LENGTH, description="Only this pool's runners."),
]


def respond(
    model: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """``model`` as JSON (its own serialisation: hex tokens, sorted sets, ISO times)."""
    return Response(
        model.model_dump_json(),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )
