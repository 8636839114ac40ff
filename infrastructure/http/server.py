"""Serving the application with uvicorn on a socket bound before the server starts.

Binding first lets ``serve --port 0`` take a free port and say which (the listening
line names it before the first request can arrive; connections wait in the backlog
until uvicorn accepts them), and lets tests run a server in a thread on a free port.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp

BACKLOG = 2048


def fast_parts() -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop: httptools and uvloop when the ``[fast]``
    extra installed them (about a fifth less CPU per request here), else h11 and
    asyncio. Named, not ``auto``, so the choice is the one this function reports."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        http = "h11"
    else:
        http = "httptools"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        loop = "asyncio"
    else:
        loop = "uvloop"
    return http, loop


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) and listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol number matters: asyncio sets TCP_NODELAY on accepted connections only
    # for IPPROTO_TCP sockets. Without it, Nagle's algorithm held back each answer's body
    # until the client's delayed ACK, about 40 ms a request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class TlsFiles:
    """The service's TLS: its certificate chain and key (PEM), and, to ask every client
    for a certificate signed by it, a CA bundle (``serve --tls-client-ca``)."""

    certificate: str
    key: str
    client_ca: str | None = None

    def check(self) -> None:
        """``ssl.SSLError`` or ``OSError`` now, rather than when the server starts."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certificate, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(cafile=self.client_ca)


def base_url(sock: socket.socket, *, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def make_server(
    app: ASGIApp,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    log_config: dict[str, Any] | None = None,
    tls: TlsFiles | None = None,
) -> uvicorn.Server:
    """uvicorn on ``sock``; its access log is off (the service's own request log,
    :mod:`.request_log`, writes the requests); HTTP/1.1 keep-alive as uvicorn keeps it
    (5 s idle); the parser and loop of :func:`fast_parts`. ``log_config``: uvicorn's
    logging configuration (by default uvicorn's own)."""
    host, port = sock.getsockname()[:2]
    http, loop = fast_parts()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http,
        loop=loop,
        log_level=log_level,
        log_config=log_config if log_config is not None else uvicorn.config.LOGGING_CONFIG,
        access_log=False,
        lifespan="off",
        server_header=False,
        ssl_certfile=tls.certificate if tls else None,
        ssl_keyfile=tls.key if tls else None,
        ssl_ca_certs=tls.client_ca if tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca else ssl.CERT_NONE,
    )
    return uvicorn.Server(config)


@contextmanager
def serving_in_thread(
    app: ASGIApp, host: str = "127.0.0.1", *, tls: TlsFiles | None = None
) -> Iterator[str]:
    """Serve ``app`` on a free port of ``host`` in a thread; yields its base URL."""
    sock = listening_socket(host, 0)
    server = make_server(app, sock, tls=tls)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield base_url(sock, tls=tls is not None)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
