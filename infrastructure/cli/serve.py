"""The ``serve`` command: the HTTP/JSON API, health and Prometheus metrics (uvicorn)."""

from __future__ import annotations

import json
import os
import signal
import sys
from types import FrameType
from typing import Annotated

import typer
from rich.markup import escape

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    fail,
    needs_extra,
    open_store,
    reported_errors,
    store_errors,
)
from secondbox_scheduler.infrastructure.settings import (
    DEFAULT_SQLITE_URL,
    READY_MAX_LAG,
    ready_max_lag,
    redact_url,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# This module's top-level commands; the package's __init__ adds them to the app `cli`.
commands = typer.Typer()

SERVE_HELP = (
    "Serve the scheduler over HTTP/JSON: every command and query under /v1 (runners, "
    "sandboxes, assignments, explain, timeline), the OpenAPI document at /openapi.json, "
    "/healthz, /readyz and /metrics (Prometheus). Several serve processes on one "
    "PostgreSQL database are replicas. Stops on Ctrl-C or SIGTERM (after the requests in "
    "flight). See docs/operations.md, "
    '"The HTTP service".\n\n'
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler serve --database-url postgresql://postgres@127.0.0.1:5432/sched\n"
    "  secondbox-scheduler serve --port 0 --json   # a free port, named on stdout"
)


@commands.command("serve", help=SERVE_HELP)
def serve(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: a free one).")
    ] = 8080,
    max_read_model_lag: Annotated[
        int | None,
        typer.Option(
            "--max-read-model-lag",
            min=0,
            show_default=False,
            help="Events a read model may lag behind the log before /readyz answers 503 "
            "[default: SECONDBOX_READY_MAX_LAG, else 1000].",
        ),
    ] = None,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            "--max-body-bytes",
            min=1024,
            max=2**30,
            envvar="SECONDBOX_HTTP_MAX_BODY_BYTES",
            help="Largest request body read; a larger one is refused with 413 "
            "body_too_large before it is read (1,024 to 2**30).",
        ),
    ] = 2**20,  # body_limit.DEFAULT_MAX_BODY_BYTES (not imported here: a slow import)
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log",
            help="Log every request on stderr, one JSON line each (request id, actor, route "
            "template, status, outcome, latency; never a header, query or body), whatever "
            "--log-level says. Without it only the 5xx answers are logged.",
        ),
    ] = False,
    log_level: Annotated[
        str,
        typer.Option("--log-level", help="Level of the server's own log lines (JSON, stderr)."),
    ] = "warning",
    as_json: JsonOutput = False,
) -> None:
    needs_extra("server", "serve")
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        disable_created_metrics,
    )

    from secondbox_scheduler.infrastructure.http import create_app
    from secondbox_scheduler.infrastructure.http.request_log import log_config
    from secondbox_scheduler.infrastructure.http.server import (
        base_url,
        listening_socket,
        make_server,
    )

    if log_level not in LOG_LEVELS:
        fail(f"--log-level takes one of {', '.join(LOG_LEVELS)}; got {escape(log_level)!r}")
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    with reported_errors(), store_errors(database_url):
        scheduler = open_store(database_url, must_exist=False)
        if max_read_model_lag is None:
            try:
                max_read_model_lag = ready_max_lag(scheduler.env.get(READY_MAX_LAG))
            except InvalidRequestError:
                scheduler.close()
                raise
    try:
        registry = CollectorRegistry()  # the service's own; the process-wide one is untouched
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)
        app = create_app(
            scheduler,
            registry=registry,
            max_read_model_lag=max_read_model_lag,
            max_body_bytes=max_body_bytes,
            access_log=access_log,
        )
        try:
            sock = listening_socket(host, port)
        except OSError as error:
            fail(escape(f"cannot listen on {host}:{port}: {error.strerror or error}"))
        url = base_url(sock)
        if as_json:
            line = {"url": url, "pid": os.getpid(), "database": redact_url(database_url)}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
        else:
            say_listening(url, database_url)
        # uvicorn shuts down gracefully on SIGTERM, then raises it again: end then with
        # exit code 0 and the store closed, as after Ctrl-C (which exits with 130).
        signal.signal(signal.SIGTERM, _exit_cleanly)
        server = make_server(app, sock, log_level=log_level, log_config=log_config(log_level))
        server.run(sockets=[sock])
    finally:
        scheduler.close()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def say_listening(url: str, database_url: str) -> None:
    """One line on stderr: where the service listens and on which store."""
    sys.stderr.write(
        f"secondbox-scheduler serving {url} (store {redact_url(database_url)}); "
        f"OpenAPI at {url}/openapi.json, metrics at {url}/metrics\n"
    )
    sys.stderr.flush()
