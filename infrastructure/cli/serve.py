"""The ``serve`` command: the HTTP/JSON API, health and Prometheus metrics (uvicorn)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import ssl
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.config import load_cells
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.cli.cells import CellsFile, open_router
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
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError

if TYPE_CHECKING:
    from secondbox_scheduler.domain.access_tokens import AccessTokens
    from secondbox_scheduler.infrastructure.http.server import TlsFiles

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# This module's top-level commands; the package's __init__ adds them to the app `cli`.
commands = typer.Typer()

SERVE_HELP = (
    "Serve the scheduler over HTTP/JSON: every command and query under /v1 (runners, "
    "sandboxes, assignments, explain, timeline), the OpenAPI document at /openapi.json, "
    "/healthz, /readyz and /metrics (Prometheus). Once any access token exists "
    "(secondbox-scheduler tokens), every route but /healthz and /readyz needs one; beyond "
    "a loopback address serve requires tokens and TLS (--tls-cert, --tls-key) unless "
    "--insecure. Several serve processes on one "
    "PostgreSQL database are replicas. Stops on Ctrl-C or SIGTERM (after the requests in "
    "flight). See docs/operations.md, "
    '"The HTTP service".\n\n'
    "[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler serve --database-url postgresql://postgres@127.0.0.1:5432/sched\n"
    "  secondbox-scheduler serve --port 0 --json   # a free port, named on stdout\n"
    "  secondbox-scheduler serve --host 0.0.0.0 --tls-cert cert.pem --tls-key key.pem"
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
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            "--tls-cert",
            help="Serve HTTPS with this certificate chain (PEM); needs --tls-key.",
            show_default=False,
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option("--tls-key", help="The certificate's private key (PEM).", show_default=False),
    ] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(
            "--tls-client-ca",
            help="Also require every client to present a certificate signed by this CA "
            "bundle (PEM): mutual TLS, in addition to the bearer token.",
            show_default=False,
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen on a non-loopback address even without access tokens or TLS "
            "(anyone who reaches the port may then call the service, or read the tokens "
            "in transit).",
        ),
    ] = False,
    open_metrics: Annotated[
        bool,
        typer.Option(
            "--open-metrics",
            help="Serve /metrics without a token (for a Prometheus that holds none); by "
            "default, once any token exists, /metrics needs one of a reading role.",
        ),
    ] = False,
    as_json: JsonOutput = False,
    cells: CellsFile = None,
) -> None:
    needs_extra("server", "serve")
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        disable_created_metrics,
    )

    from secondbox_scheduler.infrastructure.access.tokens import load_tokens
    from secondbox_scheduler.infrastructure.http import create_app
    from secondbox_scheduler.infrastructure.http.request_log import log_config
    from secondbox_scheduler.infrastructure.http.server import (
        base_url,
        listening_socket,
        make_server,
    )

    if log_level not in LOG_LEVELS:
        fail(f"--log-level takes one of {', '.join(LOG_LEVELS)}; got {escape(log_level)!r}")
    tls = tls_files(tls_cert, tls_key, tls_client_ca)
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    scheduler: SchedulerApplication | CellRouter
    with reported_errors(), store_errors(database_url):
        if cells is not None:
            scheduler, stored = _open_cells(cells)
            database_url = f"cells {cells} ({', '.join(scheduler.names)})"
        else:
            scheduler = open_store(database_url, must_exist=False)
            try:
                if max_read_model_lag is None:
                    max_read_model_lag = ready_max_lag(scheduler.env.get(READY_MAX_LAG))
                stored = load_tokens(scheduler)
            except BaseException:
                scheduler.close()
                raise
    tokens = len(stored.tokens) if stored is not None else 0
    exposed = exposure(host, tokens=tokens, tls=tls is not None)
    if exposed and not insecure:
        scheduler.close()
        fail(escape(f"refusing to listen on {host}: {exposed}; or pass --insecure"))
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
            open_metrics=open_metrics,
        )
        try:
            sock = listening_socket(host, port)
        except OSError as error:
            fail(escape(f"cannot listen on {host}:{port}: {error.strerror or error}"))
        url = base_url(sock, tls=tls is not None)
        access = access_line(tokens, open_metrics=open_metrics)
        if as_json:
            line = {
                "url": url,
                "pid": os.getpid(),
                "database": redact_url(database_url),
                "tls": tls is not None,
                "client_certificates": tls is not None and tls.client_ca is not None,
                "tokens_required": tokens > 0,
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
        else:
            say_listening(url, database_url, access)
        if exposed:  # --insecure
            sys.stderr.write(f"warning: {exposed} (--insecure)\n")
        # uvicorn shuts down gracefully on SIGTERM, then raises it again: end then with
        # exit code 0 and the store closed, as after Ctrl-C (which exits with 130).
        signal.signal(signal.SIGTERM, _exit_cleanly)
        server = make_server(
            app, sock, log_level=log_level, log_config=log_config(log_level), tls=tls
        )
        server.run(sockets=[sock])
    finally:
        scheduler.close()


def _open_cells(cells: Path) -> tuple[CellRouter, AccessTokens | None]:
    """The router over the cells file's cells and the access tokens of its first cell
    (None when that cell is down now: the exposure check then counts no token, and the
    service refuses requests until it reads them)."""
    from secondbox_scheduler.infrastructure.access.tokens import load_tokens

    router = open_router(load_cells(cells))
    try:
        stored = load_tokens(router.application(router.names[0]))
    except CellUnavailableError as error:
        sys.stderr.write(f"warning: {error}: access tokens not read yet\n")
        stored = None
    return router, stored


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def say_listening(url: str, database_url: str, access: str = "") -> None:
    """One line on stderr: where the service listens, on which store, who may call."""
    sys.stderr.write(
        f"secondbox-scheduler serving {url} (store {redact_url(database_url)}); "
        f"OpenAPI at {url}/openapi.json, metrics at {url}/metrics"
        + (f"; {access}" if access else "")
        + "\n"
    )
    sys.stderr.flush()


def access_line(tokens: int, *, open_metrics: bool) -> str:
    if not tokens:
        return "no access token issued: every route is open (secondbox-scheduler tokens create)"
    metrics = "; /metrics open" if open_metrics else ""
    return f"bearer tokens required ({tokens} issued){metrics}"


def tls_files(cert: Path | None, key: Path | None, client_ca: Path | None) -> TlsFiles | None:
    """The TLS files of the options, loaded once to fail now (exit 2) on a bad one."""
    from secondbox_scheduler.infrastructure.http.server import TlsFiles

    if cert is None and key is None:
        if client_ca is not None:
            fail("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        fail("give both --tls-cert and --tls-key")
    files = TlsFiles(str(cert), str(key), None if client_ca is None else str(client_ca))
    try:
        files.check()
    except (ssl.SSLError, OSError) as error:
        fail(escape(f"cannot load the TLS files {cert}, {key}: {error.strerror or error}"))
    return files


def exposure(host: str, *, tokens: int, tls: bool) -> str:
    """Why listening on ``host`` exposes the service ("" when it does not): beyond
    loopback it needs both access tokens and TLS."""
    if is_loopback(host):
        return ""
    missing = [
        what
        for what, present in (
            ("no access token exists (secondbox-scheduler tokens create)", tokens > 0),
            ("no TLS (--tls-cert, --tls-key)", tls),
        )
        if not present
    ]
    if not missing:
        return ""
    return f"{host} is not a loopback address and " + " and ".join(missing)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything
