"""HTTP request durations for Prometheus, by method, route template and status.

A plain ASGI middleware (no per-request task or body buffering): it notes the status
of the response as it starts and, when the request is done, observes
``secondbox_scheduler_http_request_duration_seconds{method,route,status}``. ``route``
is the matched route's template (``/v1/sandboxes/{sandbox_id}/schedule``), never the
raw path, so ids do not become label values; unmatched paths count as ``unmatched``.
``method`` is one of RFC 9110's methods (:data:`METHODS`); any other (a server takes any
token as a method) counts as ``other``. So the label values are bounded by the routes,
ten methods and the statuses the service answers, whatever clients send.
"""

from __future__ import annotations

import threading
import time
import weakref

from prometheus_client import CollectorRegistry, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from secondbox_scheduler.infrastructure.metrics import DURATION_BUCKETS, NAMESPACE

UNMATCHED = "unmatched"
METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)
OTHER_METHOD = "other"


_HISTOGRAMS: weakref.WeakKeyDictionary[CollectorRegistry, Histogram] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def request_histogram(registry: CollectorRegistry) -> Histogram:
    """The request histogram of ``registry``, made on first use (several applications
    over one scheduler share its registry, and a name registers only once)."""
    with _LOCK:
        histogram = _HISTOGRAMS.get(registry)
        if histogram is None:
            histogram = Histogram(
                "http_request_duration_seconds",
                "Duration of HTTP requests, by method, route template and status code.",
                ["method", "route", "status"],
                namespace=NAMESPACE,
                registry=registry,
                buckets=DURATION_BUCKETS,
            )
            _HISTOGRAMS[registry] = histogram
        return histogram


class RequestMetrics:
    """ASGI middleware observing every HTTP request's duration into ``histogram``."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", UNMATCHED)
            method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
            self.histogram.labels(method, route, str(status)).observe(time.perf_counter() - started)
