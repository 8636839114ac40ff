"""Who calls: the bearer token of every request (docs/operations.md, "Access").

A plain ASGI middleware, inside the body-size limit and outside the routes. For each
HTTP request:

1. an open route (``/healthz``, ``/readyz``, ``/metrics`` with ``--open-metrics``: the
   exact paths) passes as it is;
2. with no token ever issued, every route is open and the caller is recorded as
   ``anonymous`` with its client address;
3. otherwise a valid bearer token is needed (401 ``unauthorized`` with
   ``WWW-Authenticate: Bearer``), on any path, known or not: an unknown path answers
   404 only to a valid token;
4. the request then runs with the token's principal in its scope, for the access check
   of its route (:mod:`.authorization`), and with the token's actor (id and role) as the
   actor of its commands' events (:mod:`..acting`).

Tokens are read through :class:`~..access.cache.TokenCache` (at most every
``SECONDBOX_TOKEN_REFRESH_SECONDS``); expiry is checked at every request against the
scheduler's clock. A token that cannot be read is a 503, never an open door. The token
itself is never logged or echoed. A websocket connection is closed once any token
exists (the service has no websocket route).
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from starlette.types import ASGIApp, Receive, Scope, Send

from secondbox_scheduler.domain.actors import Actor, ActorRecord
from secondbox_scheduler.infrastructure.access.cache import TokenCache
from secondbox_scheduler.infrastructure.access.errors import UnauthenticatedError
from secondbox_scheduler.infrastructure.access.principal import Principal, authenticate
from secondbox_scheduler.infrastructure.acting import acting_as_record
from secondbox_scheduler.infrastructure.http.access import public_paths
from secondbox_scheduler.infrastructure.http.errors import scheduler_error_response

REALM = 'Bearer realm="secondbox-scheduler"'
PRINCIPAL = "secondbox_principal"  # in the request's state: a Principal, or None (open)


class Authentication:
    """ASGI middleware: the caller of each request (see the module's docstring)."""

    def __init__(
        self, app: ASGIApp, *, tokens: TokenCache, scheduler: Any, open_metrics: bool = False
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.scheduler = scheduler
        self.public = public_paths(open_metrics=open_metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if kind == "http" and scope["path"] in self.public:
            await self._run(None, None, scope, receive, send)
            return
        try:
            tokens = self.tokens.held if self.tokens.fresh() else (
                await anyio.to_thread.run_sync(self.tokens.current)
            )  # fmt: skip
        except Exception as error:  # the store: 503, never open on tokens unread
            await self._answer(scope, receive, send, scheduler_error_response(error))
            return
        if tokens is None or not tokens.tokens:  # no token yet: open, callers anonymous
            client = scope.get("client")
            actor = Actor.anonymous(client[0] if client else None).to_record()
            await self._run(None, actor, scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        authorization = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        principal = authenticate(authorization, tokens, self.scheduler.now())
        if isinstance(principal, str):
            response = scheduler_error_response(UnauthenticatedError(principal))
            challenge = REALM + (', error="invalid_token"' if authorization else "")
            response.headers["WWW-Authenticate"] = challenge
            await self._answer(scope, receive, send, response)
            return
        await self._run(principal, principal.actor(), scope, receive, send)

    async def _run(
        self,
        principal: Principal | None,
        actor: ActorRecord | None,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        state = scope.setdefault("state", {})
        state[PRINCIPAL] = principal
        state["actor"] = actor  # for the request log (.request_log)
        if actor is None:
            await self.app(scope, receive, send)
            return
        with acting_as_record(actor):
            await self.app(scope, receive, send)

    @staticmethod
    async def _answer(scope: Scope, receive: Receive, send: Send, response: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1011})
            return
        await response(scope, receive, send)
