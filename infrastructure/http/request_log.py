"""The service's structured logs: one JSON object a line on stderr, a line per request.

:class:`RequestLog` is a plain ASGI middleware, outermost. It gives every request an id
(the client's ``X-Request-Id`` when it is 1 to 128 of ``A-Z a-z 0-9 . _ : -``, else a new
one), answers it in the ``X-Request-Id`` header and in problem details
(``request_id``, :mod:`.errors`), and when the request is done logs::

    {"ts": "2026-12-01T20:15:03.123456Z", "level": "info",
     "logger": "secondbox_scheduler.http.requests", "message": "request",
     "request_id": "0d5c...", "actor": null, "method": "POST",
     "route": "/v1/sandboxes/{sandbox_id}/schedule", "status": 201, "outcome": "ok",
     "code": null, "latency_ms": 4.187}

``route`` is the matched route's template (``unmatched`` for no route), never the raw
path; ``outcome`` is ``ok`` (below 400), ``refused`` (4xx), ``unavailable`` (503) or
``error`` (other 5xx); ``code`` the problem's code of an error answer; ``actor`` who asked,
as the authentication put it in the request's state (``request.state.actor``: a string,
or the ``id``, ``role`` and ``name`` of a mapping or an object), else null. Nothing else
of the request is logged: no header, query string or body, so never a token or password.

Every request is logged with ``serve --access-log`` (whatever ``--log-level``); without
it only the 5xx answers are (level ``error``; ``warning`` for 503). :func:`log_config`
gives uvicorn's own loggers the same JSON lines.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from secondbox_scheduler.infrastructure.http.request_metrics import METHODS, OTHER_METHOD

REQUEST_LOGGER = "secondbox_scheduler.http.requests"
REQUEST_ID_HEADER = b"x-request-id"
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UNMATCHED = "unmatched"
ACTOR_FIELDS = ("kind", "id", "role", "name")
# the standard attributes of a LogRecord: anything else on a record is a field of its own
# (and uvicorn's coloured copy of its message)
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    """A log record as one JSON object: time, level, logger, message, its extra fields
    (``logger.info("request", extra={...})``) and, with an exception, its traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's ``log_config``: its loggers (``uvicorn``, ``uvicorn.error``) write JSON
    lines on stderr at ``log_level``; its access log is off (:class:`RequestLog` logs
    the requests); the request logger writes its own lines whatever the level."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"stderr": handler},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": log_level.upper(), "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "CRITICAL", "propagate": False},
            REQUEST_LOGGER: {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        },
    }


def actor_of(state: Mapping[str, Any]) -> Any:
    """Who asked, from the request's state, for the log: a string as it is; the ``id``,
    ``role`` and ``name`` of a mapping or an object (nothing else of it: never a secret);
    None when the request carried no actor."""
    actor = state.get("actor")
    if actor is None or isinstance(actor, str):
        return actor
    if isinstance(actor, Mapping):
        fields = {key: actor.get(key) for key in ACTOR_FIELDS}
    else:
        fields = {key: getattr(actor, key, None) for key in ACTOR_FIELDS}
    return {key: str(value) for key, value in fields.items() if value is not None} or None


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status < 500:
        return "refused"
    return "unavailable" if status == 503 else "error"


def request_id_from(scope: Scope) -> str:
    """The client's request id when it is a plain token, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            text = bytes(value).decode("latin-1")
            if CLIENT_REQUEST_ID.fullmatch(text):
                return text
            break
    return new_request_id()


# Request ids are unique, not secret: a generator seeded once per process from the OS.
# uuid4 reads os.urandom on every request, a system call that releases the GIL: on the
# event loop each request then waited for the placement batcher's thread to hand the
# GIL back (a fifth of serve's main-thread time per schedule, profiling ``bench``).
_IDS = random.Random(os.urandom(32))


def new_request_id() -> str:
    """A new request id: a random (version 4) UUID's 32 hex digits."""
    return uuid.UUID(int=_IDS.getrandbits(128), version=4).hex


class RequestLog:
    """ASGI middleware: a request id for every request, and its log line (see above)."""

    def __init__(self, app: ASGIApp, access_log: bool = False) -> None:
        self.app = app
        self.access_log = access_log
        self.logger = logging.getLogger(REQUEST_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() != REQUEST_ID_HEADER
                ]
                headers.append((REQUEST_ID_HEADER, request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.log(scope, state, status, time.perf_counter() - started)

    def log(self, scope: Scope, state: Mapping[str, Any], status: int, seconds: float) -> None:
        if status >= 500:
            level = logging.WARNING if status == 503 else logging.ERROR
        elif self.access_log:
            level = logging.INFO
        else:
            return
        route = getattr(scope.get("route"), "path", UNMATCHED)
        self.logger.log(
            level,
            "request",
            extra={
                "request_id": state.get("request_id"),
                "actor": actor_of(state),
                "method": scope["method"] if scope["method"] in METHODS else OTHER_METHOD,
                "route": route,
                "status": status,
                "outcome": outcome_of(status),
                "code": state.get("problem_code"),
                "latency_ms": round(seconds * 1000, 3),
            },
        )
