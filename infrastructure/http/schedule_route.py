"""``POST /v1/sandboxes/{sandbox_id}/schedule`` without FastAPI's per-request machinery.

Profiling ``serve`` under the bench's HTTP load put about a third of the process's CPU
in the HTTP layer, and most of that in FastAPI's work around the route: solving the
route's dependencies (the access check, the application, the path and body
parameters), matching through the included routers, and its generic body handling.
For the hot route, :class:`ScheduleRoute` stands first in the application's routes and
does the same steps directly:

1. the access check (:func:`.authorization.authorize`, the same function, on the same
   route template);
2. the body read once; parsed with ``json.loads`` and validated with
   ``ScheduleBody.model_validate`` (what FastAPI does: its JSON body is ``json.loads``'
   dict, validated in Python mode), the path's id checked against the route's bounds;
3. the route's own endpoint (``sandboxes.schedule``) called with those values, and
   its response sent.

It takes only requests it can answer exactly as the FastAPI route would: a body
declared ``application/json`` that parses to an object and validates, and a path id
within its bounds. Anything else (no or another content type, a body that is not JSON,
a validation error, a path id out of bounds) goes on, body replayed, to the FastAPI
route, which answers it as always (its 422 problem details are not rebuilt here). An
error the endpoint raises (a refusal, a stale fence, contention) propagates to the
application's exception handlers, as the FastAPI route's does. The routes answer the
same bytes: ``tests/test_schedule_route.py`` sends the same requests, valid and not,
to a service with and without this route and compares the answers.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import Message, Receive, Scope, Send

from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH
from secondbox_scheduler.infrastructure.http.authorization import authorize
from secondbox_scheduler.infrastructure.http.models import ScheduleBody

GO_ON = "secondbox.schedule_route.go_on"  # in the scope: let the FastAPI route answer
JSON = b"application/json"


class ScheduleRoute(BaseRoute):
    """The schedule route of :mod:`.sandboxes`, answered directly (see the module)."""

    def __init__(self, route: APIRoute) -> None:
        self.route = route
        self.path = route.path  # the template, for the access table, metrics and log

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get(GO_ON):
            return Match.NONE, {}
        match, child_scope = self.route.matches(scope)
        return (Match.FULL, child_scope) if match == Match.FULL else (Match.NONE, {})

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        messages = await _read_messages(receive)
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        await authorize(Request(scope, _replaying(messages, receive)))
        whole = messages[-1]["type"] == "http.request"  # else the client went away
        parsed = _parsed(scope, body) if whole else None
        if parsed is None:  # the FastAPI route answers it, as it always has
            scope[GO_ON] = True
            await scope["router"].app(scope, _replaying(messages, receive), send)
            return
        sandbox_id, schedule_body = parsed
        response = await self.route.endpoint(
            sandbox_id=sandbox_id, body=schedule_body, app=scope["app"].state.scheduler
        )
        await response(scope, receive, send)


def install_schedule_route(app: FastAPI, route: APIRoute) -> None:
    """Put a :class:`ScheduleRoute` for ``route`` first among ``app``'s routes."""
    app.router.routes.insert(0, ScheduleRoute(route))


def _parsed(scope: Scope, body: bytes) -> tuple[str, ScheduleBody] | None:
    """The path's sandbox id and the validated body, or ``None`` when the FastAPI route
    is to answer (see the module)."""
    sandbox_id = scope["path_params"].get("sandbox_id")
    if not isinstance(sandbox_id, str) or not 1 <= len(sandbox_id) <= MAX_NAME_LENGTH:
        return None
    content_types = [v for k, v in scope["headers"] if k == b"content-type"]
    if content_types != [JSON]:
        return None
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return sandbox_id, ScheduleBody.model_validate(data)
    except ValidationError:
        return None


async def _read_messages(receive: Receive) -> list[Message]:
    """The request's messages up to its body's last one, or up to the client's going
    away (the body-size limit outside already bounds them)."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` again, then the connection's next ones."""
    given = iter(list(messages))

    async def replay() -> Message:
        message = next(given, None)
        return await receive() if message is None else message

    return replay
