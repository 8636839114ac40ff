"""The HTTP/JSON service's application factory: :func:`create_app`.

One FastAPI application over one :class:`SchedulerApplication`: the routes of
``runners`` and ``sandboxes`` (every command and query, under ``/v1``), ``health``
(``/healthz``, ``/readyz``, ``/metrics``), the OpenAPI document at ``/openapi.json``,
the error answers of :mod:`.errors`, the request-duration middleware and the body-size
limit (:mod:`.body_limit`). Several
processes serving one PostgreSQL database are replicas: nothing is kept in a process
that another one needs (the scheduler serializes through the database).
"""

from __future__ import annotations

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry

import secondbox_scheduler.infrastructure.http.audit_log as audit_log
import secondbox_scheduler.infrastructure.http.events as events
import secondbox_scheduler.infrastructure.http.health as health
import secondbox_scheduler.infrastructure.http.lists as lists
import secondbox_scheduler.infrastructure.http.runners as runners
import secondbox_scheduler.infrastructure.http.sandboxes as sandboxes
import secondbox_scheduler.infrastructure.http.tokens as tokens
from secondbox_scheduler.infrastructure.access.cache import (
    TOKEN_REFRESH_SECONDS,
    TokenCache,
    token_refresh_seconds,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter, LazyApplication
from secondbox_scheduler.infrastructure.http.authentication import Authentication
from secondbox_scheduler.infrastructure.http.authorization import authorize
from secondbox_scheduler.infrastructure.http.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from secondbox_scheduler.infrastructure.http.cells import CellsCollector, export_metrics
from secondbox_scheduler.infrastructure.http.errors import install_error_handlers, problem_openapi
from secondbox_scheduler.infrastructure.http.request_log import RequestLog
from secondbox_scheduler.infrastructure.http.request_metrics import (
    RequestMetrics,
    request_histogram,
)
from secondbox_scheduler.infrastructure.http.schedule_route import install_schedule_route
from secondbox_scheduler.infrastructure.prometheus_export import PrometheusMetrics
from secondbox_scheduler.infrastructure.settings import (
    DEFAULT_READY_MAX_LAG,
    READY_MAX_LAG,
    ready_max_lag,
)

DEFAULT_MAX_READ_MODEL_LAG = DEFAULT_READY_MAX_LAG  # events; /readyz answers 503 beyond
API_VERSION = "1"

DESCRIPTION = """\
The SecondBox scheduler over HTTP/JSON: every command and query of
`SchedulerApplication` (runners, sandboxes, assignments, explanations, timelines),
health and Prometheus metrics.

Once any access token exists (`secondbox-scheduler tokens create`), every route but
`/healthz` and `/readyz` needs `Authorization: Bearer <token>`; the token's role
(`runner`, `control-plane`, `auditor`, `admin`) decides which routes it may call.

Errors are RFC 9457 problem details (`application/problem+json`: `type`, `title`,
`status`, `detail`, `instance`) with the extension members `code` (stable, to match on),
`retryable`, `request_id` and, as they apply, `field`, `rule`, `reason`, `reasons`:
401 no valid token, 403 a role that may not,
422 invalid input, 404 unknown, 409 stale fence or conflict (and refused placements),
413 a body past the maximum size (`serve --max-body-bytes`, default 1 MiB), 503 with
`Retry-After` for contention and an unavailable store. Commands are idempotent by the
ids they carry: retrying one after a lost answer is safe.

Fencing tokens are hex; durations are seconds; times are RFC 3339 with a zone. The
scheduler's clock is the authority: a request's `now` must lie within its clock plus
or minus the tolerance (`SECONDBOX_CLOCK_TOLERANCE_SECONDS`, default 5).
"""


def create_app(
    scheduler: SchedulerApplication | CellRouter,
    *,
    registry: CollectorRegistry | None = None,
    max_read_model_lag: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    access_log: bool = False,
    open_metrics: bool = False,
    schedule_route: bool = True,
) -> FastAPI:
    """The service over ``scheduler``. Its metrics go to ``registry``, or to the
    registry the scheduler already exports to, or to a new one; ``/metrics`` serves it.
    ``max_read_model_lag``: the events a read model may lag before ``/readyz`` answers
    503; by default the scheduler's ``SECONDBOX_READY_MAX_LAG`` (1,000 when unset). A
    request body of more than ``max_body_bytes`` is refused, 413, before it is read.
    ``access_log``: log every request (:mod:`.request_log`), not only the 5xx ones.

    Once any access token exists, every route but the health probes (and ``/metrics``
    with ``open_metrics``) needs one (:mod:`.authentication`). ``schedule_route``: answer
    ``schedule`` through :mod:`.schedule_route` (the same answers, less CPU per
    request); off, through FastAPI's route alone."""
    if isinstance(scheduler, CellRouter):
        return _create_app(
            scheduler,
            registry if registry is not None else CollectorRegistry(),
            max_read_model_lag=max_read_model_lag,
            max_body_bytes=max_body_bytes,
            access_log=access_log,
            open_metrics=open_metrics,
            schedule_route=schedule_route,
        )
    if max_read_model_lag is None:
        max_read_model_lag = ready_max_lag(scheduler.env.get(READY_MAX_LAG))
    sink = scheduler.metrics.sink
    if registry is None and isinstance(sink, PrometheusMetrics):
        exporter = sink
    else:
        exporter = scheduler.attach_metrics(registry)
    return _create_app(
        scheduler,
        exporter.registry,
        max_read_model_lag=max_read_model_lag,
        max_body_bytes=max_body_bytes,
        access_log=access_log,
        open_metrics=open_metrics,
        schedule_route=schedule_route,
    )


def _create_app(
    scheduler: SchedulerApplication | CellRouter,
    registry: CollectorRegistry,
    *,
    max_read_model_lag: int | None,
    max_body_bytes: int,
    access_log: bool,
    open_metrics: bool,
    schedule_route: bool,
) -> FastAPI:
    """The FastAPI application over one application or a cell router (its tokens are
    the first cell's; its metrics every cell's, by :class:`CellsCollector`)."""
    if isinstance(scheduler, CellRouter):
        if max_read_model_lag is None:
            max_read_model_lag = ready_max_lag(scheduler.setting(READY_MAX_LAG))
        registry.register(CellsCollector(scheduler))
        scheduler.when_opened(export_metrics)
        token_cache = TokenCache(
            LazyApplication(scheduler, scheduler.names[0]),
            token_refresh_seconds(scheduler.setting(TOKEN_REFRESH_SECONDS)),
        )
    else:
        assert max_read_model_lag is not None
        token_cache = TokenCache(scheduler)
    app = FastAPI(
        title="SecondBox scheduler",
        version=API_VERSION,
        description=DESCRIPTION,
        openapi_url="/openapi.json",
        dependencies=[Depends(authorize)],
    )
    app.state.scheduler = scheduler
    app.state.registry = registry
    app.state.max_read_model_lag = max_read_model_lag
    install_error_handlers(app)
    problem_openapi(app)
    # sandboxes first: the router tries the routes in order, and schedule, the hot
    # route, then is among the first few (no sandbox path is another router's)
    app.include_router(sandboxes.router)
    app.include_router(lists.router)  # before runners: GET /v1/runners is a list
    app.include_router(runners.router)
    app.include_router(events.router)
    app.include_router(health.router)
    app.include_router(tokens.router)
    app.include_router(audit_log.router)
    if schedule_route:  # the hot route without FastAPI's per-request work (same answers)
        install_schedule_route(app, sandboxes.schedule_route())
    app.add_middleware(  # who calls (401); the dependency `authorize`: whether they may (403)
        Authentication,
        tokens=token_cache,
        scheduler=scheduler,
        open_metrics=open_metrics,
    )
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    # Added last, so outermost: it also times (and counts) the 413s of BodyLimit.
    app.add_middleware(RequestMetrics, histogram=request_histogram(registry))
    app.add_middleware(RequestLog, access_log=access_log)  # outermost: the request id first
    return app
