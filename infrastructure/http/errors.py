"""Errors of the HTTP API: RFC 9457 problem details, a stable code per error, statuses
to act on.

Every error answer, the scheduler's refusals as well as FastAPI's own request
validation, an unknown route or an unreachable store, is ``application/problem+json``::

    {"type": "tag:secondbox-scheduler,2026:problem/invalid_request",
     "title": "Invalid request", "status": 422,
     "detail": "SecondBox scheduler invalid request: requirements.pool_name: must not be empty",
     "instance": "/v1/sandboxes/sbx-1", "request_id": "7f0c...",
     "code": "invalid_request", "retryable": false,
     "field": "requirements.pool_name", "rule": "must not be empty"}

``type`` names the problem type (a ``tag:`` URI, RFC 4151: an identifier, not a page to
fetch), ``title`` is the same for every occurrence of the type, ``detail`` says what
happened this time, ``instance`` is the request's path (percent-encoded, no query) and
``request_id`` the id the service's log line of the request carries (``X-Request-Id``).
The extension members are the codes of before: ``code`` (the type's last segment, what
clients match on), ``retryable``; ``field`` and ``rule`` for invalid input (``field`` is
a dotted path into the JSON body, or the name of a path or query parameter); ``reason``
for an unavailable store (``connection-refused``, ``timeout``, ...); ``reasons`` for a
refused placement (runners refusing per reason code). The statuses:

- 401 ``unauthorized`` (with ``WWW-Authenticate: Bearer``): no valid bearer token, once
  any token exists; 403 ``forbidden``: the token's role may not call the route, or a
  runner token acts for a runner it does not name (``infrastructure/http/access.py``);
- 413 ``body_too_large``: the body is past the service's maximum (``serve
  --max-body-bytes``, default 1 MiB); refused before it was read, nothing was written;
- 422 ``invalid_request``: fix the named field; nothing was written;
- 404 ``runner_not_found``, ``sandbox_not_found``, ``assignment_not_found``,
  ``not_found`` (no such route);
- 409 ``stale_fence`` (drop the work: a newer generation or token exists), a conflict
  with the current state (``already_exists``, ``capacity_exceeded``,
  ``runner_unavailable``, ``invalid_transition``, ``release_proof_mismatch``,
  ``reconcile_claim_not_held``, ``profile_revision_mismatch``), or a refused placement
  (``no_compatible_runner``, ``home_runner_unavailable``, ``egress_context_unavailable``:
  retry when capacity, heartbeats or a drain change);
- 503 with ``Retry-After``: ``serialization_contention`` (lost every race of its retry
  budget), ``store_unavailable`` and ``cell_unavailable`` (one cell of several is down:
  the detail names it); retrying the same request is safe;
  ``read_model_unavailable``: a read model's tracking position lies beyond the log's
  head (tampered with): an operator must rebuild it (``projections rebuild``);
- 500 ``internal_error``: a fault of the scheduler (never expected; logged).

:data:`ERROR_RESPONSES` declares these in the OpenAPI document, and
:func:`problem_openapi` gives them the ``application/problem+json`` media type there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eventsourcing.persistence import InterfaceError, OperationalError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from secondbox_scheduler.domain.errors import (
    AccessTokenNotFoundError,
    AlreadyExistsError,
    AssignmentNotFoundError,
    CapacityExceededError,
    ConflictError,
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    InvalidTransitionError,
    NoCompatibleRunnerError,
    NotFoundError,
    PlacementError,
    ProfileRevisionMismatchError,
    ReconcileClaimError,
    ReleaseProofError,
    RunnerNotFoundError,
    RunnerUnavailableError,
    SandboxNotFoundError,
    SchedulerError,
    SerializationContentionError,
    StaleFenceError,
)
from secondbox_scheduler.infrastructure.access.errors import (
    PermissionDeniedError,
    UnauthenticatedError,
)
from secondbox_scheduler.infrastructure.metrics import refusal_reasons
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError
from secondbox_scheduler.projections.read_models import ReadModelAheadError

PROBLEM_JSON = "application/problem+json"
PROBLEM_TYPE = "tag:secondbox-scheduler,2026:problem/"  # + the code
MAX_INSTANCE_LENGTH = 2048  # characters of the request path echoed as ``instance``
RETRY_AFTER_CONTENTION = 1  # seconds; a lost race clears within milliseconds
RETRY_AFTER_STORE = 5  # seconds; a restarting database takes a few

# The first class of an error's MRO found here decides its status and code.
STATUS_AND_CODE: dict[type[BaseException], tuple[int, str]] = {
    InvalidRequestError: (422, "invalid_request"),
    RunnerNotFoundError: (404, "runner_not_found"),
    SandboxNotFoundError: (404, "sandbox_not_found"),
    AssignmentNotFoundError: (404, "assignment_not_found"),
    AccessTokenNotFoundError: (404, "access_token_not_found"),
    UnauthenticatedError: (401, "unauthorized"),
    PermissionDeniedError: (403, "forbidden"),
    NotFoundError: (404, "not_found"),
    StaleFenceError: (409, "stale_fence"),
    AlreadyExistsError: (409, "already_exists"),
    CapacityExceededError: (409, "capacity_exceeded"),
    RunnerUnavailableError: (409, "runner_unavailable"),
    InvalidTransitionError: (409, "invalid_transition"),
    ReleaseProofError: (409, "release_proof_mismatch"),
    ReconcileClaimError: (409, "reconcile_claim_not_held"),
    ConflictError: (409, "conflict"),
    ProfileRevisionMismatchError: (409, "profile_revision_mismatch"),
    NoCompatibleRunnerError: (409, "no_compatible_runner"),
    HomeRunnerUnavailableError: (409, "home_runner_unavailable"),
    EgressContextUnavailableError: (409, "egress_context_unavailable"),
    PlacementError: (409, "no_compatible_runner"),
    SerializationContentionError: (503, "serialization_contention"),
    StoreUnavailableError: (503, "store_unavailable"),
    CellUnavailableError: (503, "cell_unavailable"),
    ReadModelAheadError: (503, "read_model_unavailable"),
    SchedulerError: (409, "refused"),
    # The store failed under a command (connection lost, pool exhausted, SQLite busy).
    OperationalError: (503, "store_unavailable"),
    InterfaceError: (503, "store_unavailable"),
}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
TITLES = {  # the few whose title is not the code in words
    "refused": "Refused by the scheduler",
    "http_error": "HTTP error",
    "read_model_unavailable": "Read model unavailable (ahead of the log)",
    "reconcile_claim_not_held": "Reconcile claim not held",
}


def title_of(code: str) -> str:
    """The problem type's title: the same for every occurrence (RFC 9457, 3.1.3)."""
    return TITLES.get(code) or code.replace("_", " ").capitalize()


class ErrorDetail(BaseModel):
    """What an error handler knows of a problem; :func:`error_json` makes it a problem
    details document."""

    code: str
    message: str
    retryable: bool
    field: str | None = None
    rule: str | None = None
    reason: str | None = None
    reasons: dict[str, int] | None = None


class Problem(BaseModel):
    """An error answer: RFC 9457 problem details, ``application/problem+json``."""

    type: str = Field(
        description=f"The problem type: {PROBLEM_TYPE}<code> (an identifier, not a page).",
        examples=[f"{PROBLEM_TYPE}invalid_request"],
    )
    title: str = Field(description="A summary of the problem type, the same every time.")
    status: int = Field(description="The HTTP status code of this answer.")
    detail: str = Field(description="What went wrong this time, for people.")
    instance: str | None = Field(
        default=None, description="The request's path (percent-encoded, no query)."
    )
    request_id: str | None = Field(
        default=None, description="The request's id, as in the service's log (X-Request-Id)."
    )
    code: str = Field(description="Stable machine-readable code (see the list above).")
    retryable: bool = Field(description="True: the same request may succeed later (503).")
    field: str | None = Field(default=None, description="invalid_request: the field.")
    rule: str | None = Field(default=None, description="invalid_request: the rule it broke.")
    reason: str | None = Field(default=None, description="store_unavailable: why.")
    reasons: dict[str, int] | None = Field(
        default=None, description="Refused placements: runners refusing, per reason code."
    )


def _retry_after() -> dict[str, Any]:
    return {
        "Retry-After": {
            "description": "Seconds to wait before retrying the same request.",
            "schema": {"type": "integer", "minimum": 0},
        }
    }


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {
        "model": Problem,
        "description": "No valid bearer token (once any token exists).",
        "headers": {
            "WWW-Authenticate": {
                "description": "Bearer, with the realm.",
                "schema": {"type": "string"},
            }
        },
    },
    403: {"model": Problem, "description": "The token's role may not do this."},
    404: {"model": Problem, "description": "Unknown runner, sandbox or assignment."},
    409: {
        "model": Problem,
        "description": "Stale fence, a conflict with the current state, or a refused placement.",
    },
    413: {
        "model": Problem,
        "description": "The body is larger than the service's maximum (serve --max-body-bytes).",
    },
    422: {"model": Problem, "description": "Invalid input; nothing was written."},
    503: {
        "model": Problem,
        "description": "Contention or an unavailable store; retry after Retry-After.",
        "headers": _retry_after(),
    },
}


def instance_of(scope: Scope) -> str | None:
    """The request's path as the client sent it (percent-encoded, without the query
    string, which may hold what a log must not), at most :data:`MAX_INSTANCE_LENGTH`."""
    raw = scope.get("raw_path")
    path = raw.decode("ascii", "replace") if isinstance(raw, bytes) else scope.get("path")
    return path[:MAX_INSTANCE_LENGTH] if isinstance(path, str) and path else None


def request_id_of(scope: Scope) -> str | None:
    """The id the request log gave the request (:mod:`.request_log`), if any."""
    state = scope.get("state")
    found = state.get("request_id") if isinstance(state, dict) else None
    return found if isinstance(found, str) else None


def error_json(
    status: int,
    detail: ErrorDetail,
    headers: dict[str, str] | None = None,
    scope: Scope | None = None,
) -> JSONResponse:
    """The problem details answer of ``detail`` (``scope``: the request's, for
    ``instance`` and ``request_id``)."""
    if status == 503 and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_CONTENTION)}
    if scope is not None:  # for the request's log line (:mod:`.request_log`)
        scope.setdefault("state", {})["problem_code"] = detail.code
    problem = Problem(
        type=PROBLEM_TYPE + detail.code,
        title=title_of(detail.code),
        status=status,
        detail=detail.message,
        instance=None if scope is None else instance_of(scope),
        request_id=None if scope is None else request_id_of(scope),
        code=detail.code,
        retryable=detail.retryable,
        field=detail.field,
        rule=detail.rule,
        reason=detail.reason,
        reasons=detail.reasons,
    )
    return JSONResponse(
        problem.model_dump(mode="json", exclude_none=True),
        status_code=status,
        headers=headers,
        media_type=PROBLEM_JSON,
    )


def classify(error: BaseException) -> tuple[int, str] | None:
    for kind in type(error).__mro__:
        found = STATUS_AND_CODE.get(kind)
        if found is not None:
            return found
    return None


def scheduler_error_response(error: Exception, scope: Scope | None = None) -> JSONResponse:
    """The answer to an exception a command or query raised; anything not classified is
    a fault (500, no detail shown; the server logs its traceback)."""
    found = classify(error)
    if found is None:
        return error_json(
            500,
            ErrorDetail(
                code="internal_error",
                message="an unexpected error (a fault of the scheduler, logged by the service)",
                retryable=False,
            ),
            scope=scope,
        )
    status, code = found
    detail = ErrorDetail(code=code, message=str(error), retryable=status == 503)
    headers: dict[str, str] = {}
    if isinstance(error, InvalidRequestError):
        detail.field, detail.rule = error.field, error.rule
    elif isinstance(error, PlacementError):
        detail.reasons = dict(sorted(refusal_reasons(error).items()))
    elif isinstance(error, StoreUnavailableError):
        detail.reason = error.reason
        headers["Retry-After"] = str(RETRY_AFTER_STORE)
    elif isinstance(error, CellUnavailableError):
        detail.reason = "cell-unavailable"
        headers["Retry-After"] = str(RETRY_AFTER_STORE)
    elif isinstance(error, (OperationalError, InterfaceError)):
        detail.reason = "unavailable"
        detail.message = f"SecondBox scheduler store unavailable: {type(error).__name__}: {error}"
        headers["Retry-After"] = str(RETRY_AFTER_STORE)
    return error_json(status, detail, headers, scope)


def _validation_field(location: tuple[Any, ...]) -> str:
    """``("body", "requirements", "capacity", "vcpu_count")`` -> the dotted field path."""
    parts = [str(part) for part in location]
    if parts and parts[0] in ("body", "path", "query", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def validation_error_response(
    error: RequestValidationError, scope: Scope | None = None
) -> JSONResponse:
    first = error.errors()[0]
    rule = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    field = _validation_field(tuple(first.get("loc", ())))
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidRequestError):  # a domain value type's own refusal
        field = inner.field if field == "body" else f"{field}.{inner.field}"
        rule = inner.rule
    elif first.get("type") == "json_invalid":
        field = "body"
    return error_json(
        422,
        ErrorDetail(
            code="invalid_request",
            message=f"SecondBox scheduler invalid request: {field}: {rule}",
            retryable=False,
            field=field,
            rule=rule,
        ),
        scope=scope,
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error of ``app`` answers with problem details."""

    async def on_scheduler_error(request: Request, error: Exception) -> JSONResponse:
        return scheduler_error_response(error, request.scope)

    async def on_validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        return validation_error_response(error, request.scope)

    async def on_http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        if error.status_code == 400:  # a body that is not even JSON text (bad UTF-8)
            return error_json(
                422,
                ErrorDetail(
                    code="invalid_request",
                    message=f"SecondBox scheduler invalid request: body: {error.detail}",
                    retryable=False,
                    field="body",
                    rule=f"must be JSON text in UTF-8 ({error.detail})",
                ),
                scope=request.scope,
            )
        code = HTTP_CODES.get(error.status_code, "http_error")
        return error_json(
            error.status_code,
            ErrorDetail(code=code, message=str(error.detail), retryable=False),
            dict(error.headers or {}),
            request.scope,
        )

    for kind in (SchedulerError, OperationalError, InterfaceError):
        app.add_exception_handler(kind, on_scheduler_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_scheduler_error)


def problem_openapi(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI document give its problem answers (those whose schema is
    :class:`Problem`) the media type they are served with, ``application/problem+json``
    (FastAPI declares every response of a route as ``application/json``)."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                for response in operation.get("responses", {}).values():
                    content = response.get("content", {})
                    schema = content.get("application/json", {}).get("schema", {})
                    if schema.get("$ref", "").endswith("/Problem"):
                        response["content"] = {PROBLEM_JSON: content["application/json"]}
        return document

    app.openapi = openapi  # type: ignore[method-assign]
