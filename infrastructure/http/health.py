"""``/healthz``, ``/readyz`` and ``/metrics``.

- ``/healthz``: the process answers (liveness); it touches nothing else.
- ``/readyz``: the store answers (one fresh connection with the connect timeout, no
  retries: :mod:`..store_probe`), and no read model lags the log by more than
  the threshold (``SECONDBOX_READY_MAX_LAG``, ``serve --max-read-model-lag``) or has a
  tracking position beyond the log's head (:mod:`.readiness`). Where queries catch the read models
  up themselves (``SECONDBOX_READ_MODELS=on``, the default), the probe catches them up
  first, as the next query would, and then measures; with ``external`` it only
  measures, since queries then answer from the tables as they are. 200 when ready,
  else 503 with ``Retry-After``; the body says which check failed either way
  (``reasons``). Each
  projection's ``unknown_events`` counts, by topic, the events of classes it does not
  know that this process met (not projected: ``projections/unknown_events.py``); they
  are shown, not a readiness failure (a newer release may write them during an upgrade).
Both are answered off the request pool (found by a red team: with 45 writes stalled on
the store, both timed out, queued for the same 40 threads as the requests): they are
``async`` handlers on the event loop, ``/healthz`` touching nothing and ``/readyz``
running its probe on threads of its own (``PROBE_THREADS``) and waiting for it at most
``PROBE_TIMEOUT_SECONDS`` (then 503, ``store: unavailable: no answer within ...``).

- ``/metrics``: (a token of a reading role once any token exists, unless ``serve
  --open-metrics``) the Prometheus text format of the service's registry
  (:mod:`secondbox_scheduler.infrastructure.metrics`, the HTTP request histogram, and
  the process collectors).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eventsourcing.persistence import PersistenceError
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from starlette.responses import Response

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.http.cells import cells_readiness
from secondbox_scheduler.infrastructure.http.common import respond
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES, RETRY_AFTER_STORE
from secondbox_scheduler.infrastructure.http.readiness import read_model_readiness
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError

router = APIRouter(tags=["operations"])

READ_MODELS_INLINE = "inline"  # queries catch the read models up first
READ_MODELS_EXTERNAL = "external"  # another process (projections run) keeps them current
READ_MODELS_NOT_KEPT = "not kept"  # in-memory store, or SECONDBOX_READ_MODELS=off
PROBE_THREADS = 2  # readiness probes' own threads: never the request pool's
PROBE_TIMEOUT_SECONDS = 10.0  # the longest /readyz waits for its probe
_probes = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="secondbox-readyz")


class Health(BaseModel):
    status: str = "ok"


class ReadModelLag(BaseModel):
    name: str
    position: int
    head: int
    lag_events: int
    unknown_events: dict[str, int] = Field(
        default_factory=dict,
        description="Events of classes the projection does not know (by topic), met by "
        "this process: not projected, reported (not a readiness failure).",
    )
    error: str | None = Field(
        default=None, description="Why it cannot be trusted (position beyond the head)."
    )


class Readiness(BaseModel):
    ready: bool
    store: str = Field(description="ok, or why the store did not answer.")
    read_models: str = Field(description="inline, external or not kept.")
    max_lag_events: int = Field(description="The threshold: more lag is not ready.")
    projections: list[ReadModelLag] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list, description="Why not ready (empty: ready).")
    cells: dict[str, str] | None = Field(
        default=None,
        description="Over cells: each cell's store, ok or why it did not answer. The "
        "service is ready while any cell answers (a down cell fails only its own commands).",
    )


READY_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {
        "model": Readiness,
        "description": "Not ready: the store did not answer, or a read model lags or is "
        "ahead of the log (its position beyond the head).",
        "headers": {
            "Retry-After": {
                "description": "Seconds to wait before probing again.",
                "schema": {"type": "integer", "minimum": 0},
            }
        },
    }
}


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz() -> Response:
    return respond(Health())


@router.get("/readyz", response_model=Readiness, summary="Readiness", responses=READY_RESPONSES)
async def readyz(request: Request) -> Response:
    threshold: int = request.app.state.max_read_model_lag
    if isinstance(request.app.state.scheduler, CellRouter):
        return await _cells_ready(request.app.state.scheduler, threshold)
    app: SchedulerApplication = request.app.state.scheduler
    if app.read_models is None:
        mode = READ_MODELS_NOT_KEPT
    else:
        mode = READ_MODELS_INLINE if app.catch_up_inline else READ_MODELS_EXTERNAL
    readiness = Readiness(ready=False, store="ok", read_models=mode, max_lag_events=threshold)
    probe = asyncio.get_running_loop().run_in_executor(
        _probes, _probe, app, readiness.model_copy(deep=True)
    )
    try:  # shielded: a probe that overruns ends on its thread, its answer unused
        readiness = await asyncio.wait_for(asyncio.shield(probe), PROBE_TIMEOUT_SECONDS)
    except TimeoutError:
        readiness.store = f"unavailable: no answer within {PROBE_TIMEOUT_SECONDS:g} s"
    if readiness.store != "ok":
        readiness.ready = False
        readiness.reasons.append(f"store {readiness.store}")
    if readiness.ready:
        return respond(readiness)
    response = respond(readiness, 503)
    response.headers["Retry-After"] = str(RETRY_AFTER_STORE)
    return response


async def _cells_ready(router: CellRouter, threshold: int) -> Response:
    """Readiness over cells: every cell probed at once; ready while any answers."""
    states = await asyncio.get_running_loop().run_in_executor(_probes, cells_readiness, router)
    answering = [name for name, state in states.items() if state == "ok"]
    readiness = Readiness(
        ready=bool(answering),
        store="ok" if len(answering) == len(states) else f"{len(answering)}/{len(states)} cells",
        read_models="per cell (see /metrics)",
        max_lag_events=threshold,
        cells=states,
        reasons=[] if answering else ["no cell answered"],
    )
    if readiness.ready:
        return respond(readiness)
    response = respond(readiness, 503)
    response.headers["Retry-After"] = str(RETRY_AFTER_STORE)
    return response


def _probe(app: SchedulerApplication, readiness: Readiness) -> Readiness:
    """``readiness`` after the checks (blocking: on a probe thread)."""
    try:
        app.probe_store()  # one connection, no retries: fast while the store is down
        statuses, readiness.reasons = read_model_readiness(app, readiness.max_lag_events)
        readiness.projections = [ReadModelLag(**status.to_dict()) for status in statuses]
    except StoreUnavailableError as error:
        readiness.store = f"unavailable: {error.reason}"
    except (SchedulerError, PersistenceError) as error:
        readiness.store = f"unavailable: {type(error).__name__}: {error}"
    else:
        readiness.ready = not readiness.reasons
    return readiness


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {
            "description": "The Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        401: ERROR_RESPONSES[401],  # once any token exists, unless serve --open-metrics
        403: ERROR_RESPONSES[403],
    },
)
def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
