"""Whether the caller may call the route: the access check of every route
(docs/operations.md, "Access").

One dependency of the whole application (``create_app``), so it runs for every route
FastAPI matched, with the route's own path template and parameters: the route's entry
in the table (:mod:`.access`; none: 403 for every token) must name the token's role,
and a runner token must act for a runner it names: the path's ``runner_id``, the
body's ``runner_id`` (the very bytes the route parses), or the runner the path's
sandbox generation is assigned to (a generation's runner never changes once fenced).
A refusal is 403 ``forbidden``. With no token issued yet (the caller is anonymous) and
on the open routes nothing is checked.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from secondbox_scheduler.domain.access_tokens import ROLE_RUNNER
from secondbox_scheduler.domain.errors import NotFoundError
from secondbox_scheduler.infrastructure.access.errors import PermissionDeniedError
from secondbox_scheduler.infrastructure.access.principal import Principal
from secondbox_scheduler.infrastructure.http.access import (
    RUNNER_IN_BODY,
    RUNNER_IN_PATH,
    RUNNER_OF_ASSIGNMENT,
    access_of,
)
from secondbox_scheduler.infrastructure.http.authentication import PRINCIPAL

_GENERATION = re.compile(r"[0-9]{1,19}")
_MISSING = object()


async def authorize(request: Request) -> None:
    """Raise PermissionDeniedError (403) unless the request's caller may call its route."""
    principal = request.scope.get("state", {}).get(PRINCIPAL, _MISSING)
    if principal is None:  # open: no token issued yet, or an open route
        return
    if not isinstance(principal, Principal):  # no Authentication middleware: deny
        raise PermissionDeniedError("the service checks no token (no Authentication)")
    route = request.scope.get("route")
    template = getattr(route, "path", "")
    where = f"{request.method} {template}"
    access = access_of(request.method, template)
    if access is None:
        raise PermissionDeniedError(f"{where} is in no role's access (http/access.py)")
    if principal.role not in access.roles:
        allowed = ", ".join(sorted(access.roles)) or "no role"
        raise PermissionDeniedError(
            f"token {principal.token_id} (role {principal.role}) may not call {where}; "
            f"{allowed} may"
        )
    if principal.role == ROLE_RUNNER:
        runner = await _runner_of(request, access.runner)
        if not (isinstance(runner, str) and runner in principal.runner_ids):
            named = ", ".join(sorted(principal.runner_ids))
            raise PermissionDeniedError(
                f"runner token {principal.token_id} acts only for runner(s) {named}"
            )


async def _runner_of(request: Request, where: str | None) -> object:
    """The runner a runner token's request acts for (None: none it could name)."""
    params = request.path_params
    if where == RUNNER_IN_PATH:
        return params.get("runner_id")
    if where == RUNNER_IN_BODY:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):  # not JSON: the route refuses it too
            return None
        return body.get("runner_id") if isinstance(body, dict) else None
    if where == RUNNER_OF_ASSIGNMENT:
        sandbox_id, generation = params.get("sandbox_id"), params.get("generation")
        if not isinstance(sandbox_id, str) or not _GENERATION.fullmatch(str(generation)):
            return None
        scheduler = request.app.state.scheduler
        try:
            assignment = await run_in_threadpool(
                scheduler.get_assignment, sandbox_id, int(str(generation))
            )
        except NotFoundError:
            return None
        return None if assignment is None else assignment.runner_id
    return None  # no runner scope: a runner token may not (the table sets one for it)
