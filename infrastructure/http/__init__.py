"""The scheduler as an HTTP/JSON service (``secondbox-scheduler serve``).

Modules, by job: ``app`` (:func:`create_app`, the FastAPI application over one
``SchedulerApplication``), ``runners`` and ``sandboxes`` (the routes, by resource),
``health`` (``/healthz``, ``/readyz``, ``/metrics``), ``models`` (request and response
bodies where the domain's types do not fit), ``errors`` (RFC 9457 problem details, codes
and statuses), ``request_metrics`` (request durations), ``request_log`` (the JSON log
line of each request, its id), ``common`` (what routes share).
docs/operations.md ("The HTTP service") shows it running.
"""

from secondbox_scheduler.infrastructure.http.app import create_app

__all__ = ["create_app"]
