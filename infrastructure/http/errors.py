"""Errors of the HTTP API: one JSON shape, a stable code per error, statuses to act on.

Every error answer, the scheduler's refusals as well as FastAPI's own request
validation, an unknown route or an unreachable store, is::

    {"error": {"code": "invalid_request", "message": "...", "retryable": false,
               "field": "requirements.pool_name", "rule": "must not be empty"}}

``field`` and ``rule`` are set for invalid input (``field`` is a dotted path into the
JSON body, or the name of a path or query parameter); ``reason`` for an unavailable
store (``connection-refused``, ``timeout``, ...); ``reasons`` for a refused placement
(runners refusing per reason code). The statuses:

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
  budget) and ``store_unavailable``; retrying the same request is safe;
  ``read_model_unavailable``: a read model's tracking position lies beyond the log's
  head (tampered with): an operator must rebuild it (``projections rebuild``);
- 500 ``internal_error``: a fault of the scheduler (never expected; logged).

:data:`ERROR_RESPONSES` declares these in the OpenAPI document.
"""

from __future__ import annotations

from typing import Any

from eventsourcing.persistence import InterfaceError, OperationalError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError
from secondbox_scheduler.projections.read_models import ReadModelAheadError

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
    ReadModelAheadError: (503, "read_model_unavailable"),
    SchedulerError: (409, "refused"),
    # The store failed under a command (connection lost, pool exhausted, SQLite busy).
    OperationalError: (503, "store_unavailable"),
    InterfaceError: (503, "store_unavailable"),
}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code (see the list above).")
    message: str
    retryable: bool = Field(description="True: the same request may succeed later (503).")
    field: str | None = Field(default=None, description="invalid_request: the field.")
    rule: str | None = Field(default=None, description="invalid_request: the rule it broke.")
    reason: str | None = Field(default=None, description="store_unavailable: why.")
    reasons: dict[str, int] | None = Field(
        default=None, description="Refused placements: runners refusing, per reason code."
    )


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _retry_after() -> dict[str, Any]:
    return {
        "Retry-After": {
            "description": "Seconds to wait before retrying the same request.",
            "schema": {"type": "integer", "minimum": 0},
        }
    }


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {
        "model": ErrorResponse,
        "description": "No valid bearer token (once any token exists).",
        "headers": {
            "WWW-Authenticate": {
                "description": "Bearer, with the realm.",
                "schema": {"type": "string"},
            }
        },
    },
    403: {"model": ErrorResponse, "description": "The token's role may not do this."},
    404: {"model": ErrorResponse, "description": "Unknown runner, sandbox or assignment."},
    409: {
        "model": ErrorResponse,
        "description": "Stale fence, a conflict with the current state, or a refused placement.",
    },
    413: {
        "model": ErrorResponse,
        "description": "The body is larger than the service's maximum (serve --max-body-bytes).",
    },
    422: {"model": ErrorResponse, "description": "Invalid input; nothing was written."},
    503: {
        "model": ErrorResponse,
        "description": "Contention or an unavailable store; retry after Retry-After.",
        "headers": _retry_after(),
    },
}


def error_json(
    status: int,
    detail: ErrorDetail,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if status == 503 and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_CONTENTION)}
    return JSONResponse(
        ErrorResponse(error=detail).model_dump(mode="json", exclude_none=True),
        status_code=status,
        headers=headers,
    )


def classify(error: BaseException) -> tuple[int, str] | None:
    for kind in type(error).__mro__:
        found = STATUS_AND_CODE.get(kind)
        if found is not None:
            return found
    return None


def scheduler_error_response(error: Exception) -> JSONResponse:
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
    elif isinstance(error, (OperationalError, InterfaceError)):
        detail.reason = "unavailable"
        detail.message = f"SecondBox scheduler store unavailable: {type(error).__name__}: {error}"
        headers["Retry-After"] = str(RETRY_AFTER_STORE)
    return error_json(status, detail, headers)


def _validation_field(location: tuple[Any, ...]) -> str:
    """``("body", "requirements", "capacity", "vcpu_count")`` -> the dotted field path."""
    parts = [str(part) for part in location]
    if parts and parts[0] in ("body", "path", "query", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def validation_error_response(error: RequestValidationError) -> JSONResponse:
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
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error of ``app`` answers in the one JSON shape."""

    async def on_scheduler_error(_: Request, error: Exception) -> JSONResponse:
        return scheduler_error_response(error)

    async def on_validation_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        return validation_error_response(error)

    async def on_http_error(_: Request, error: Exception) -> JSONResponse:
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
            )
        code = HTTP_CODES.get(error.status_code, "http_error")
        return error_json(
            error.status_code,
            ErrorDetail(code=code, message=str(error.detail), retryable=False),
            dict(error.headers or {}),
        )

    for kind in (SchedulerError, OperationalError, InterfaceError):
        app.add_exception_handler(kind, on_scheduler_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_scheduler_error)
