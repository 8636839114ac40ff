"""The largest request body the service reads: 413 ``body_too_large`` past it.

A plain ASGI middleware, outermost (before anything reads the body). A request whose
``Content-Length`` is past the limit is answered at once, with the service's problem
details, without reading a byte of its body; a body streamed without one (chunked) is
counted as it arrives and refused as soon as the count passes the limit: what is read
is never more than the limit plus one chunk, so no body can make the service spend
memory in proportion to its size. The limit is ``serve --max-body-bytes`` (or
``SECONDBOX_HTTP_MAX_BODY_BYTES``), default 1 MiB: a schedule request with both maps
full (64 entries of 4,096 ASCII characters each) is about 0.6 MB; only maps of mostly
non-ASCII or escaped text at their limits need a larger one.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from secondbox_scheduler.infrastructure.http.errors import ErrorDetail, error_json

DEFAULT_MAX_BODY_BYTES = 2**20
BODY_TOO_LARGE = "body_too_large"


def too_large_message(limit: int) -> str:
    return f"SecondBox scheduler request body too large: at most {limit} bytes"


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit; the error handlers
    answer it 413 ``body_too_large`` (an HTTPException, so that FastAPI's body reading
    lets it through instead of making it a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit), {"Connection": "close"})


class BodyLimit:
    """ASGI middleware refusing request bodies of more than ``max_body_bytes``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            response = error_json(
                413,
                ErrorDetail(code=BODY_TOO_LARGE, message=too_large_message(limit), retryable=False),
                {"Connection": "close"},
                scope,
            )
            await response(scope, receive, send)
            return
        received = 0

        async def counting() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        await self.app(scope, counting, send)


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` (None: none, or not a number, which the HTTP
    server refuses before the application sees the request)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
