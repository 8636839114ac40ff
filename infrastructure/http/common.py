"""What the HTTP routes share: the application they serve, their path parameters, and
answering with a pydantic model serialised once.

Routes return a :class:`~starlette.responses.Response` they built from their response
model (``model_dump_json``), so FastAPI neither dumps the model to a dict nor validates
it again; the ``response_model`` each route declares is for the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request
from pydantic import BaseModel
from starlette.responses import Response

from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH
from secondbox_scheduler.infrastructure.application import SchedulerApplication

INT64_MAX = 2**63 - 1


async def scheduler(request: Request) -> SchedulerApplication:
    """The application this service serves (``app.state.scheduler``). A coroutine: FastAPI
    runs a plain function dependency on its thread pool, a hop of every request between
    the event loop and a thread for one attribute read (found profiling ``schedule``)."""
    app = request.app.state.scheduler
    assert isinstance(app, SchedulerApplication)
    return app


Scheduler = Annotated[SchedulerApplication, Depends(scheduler)]

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


def respond(model: BaseModel, status_code: int = 200) -> Response:
    """``model`` as JSON (its own serialisation: hex tokens, sorted sets, ISO times)."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")
