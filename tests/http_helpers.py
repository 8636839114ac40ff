"""JSON bodies of the HTTP API for tests, the service on a free loopback port, and a
TCP proxy that can cut a service off its database.

The bodies mirror :mod:`tests.factories` (a fully compatible runner, the default
profile's requirements, a valid schedule request), in the API's wire shapes: hex
fencing tokens, seconds for durations, RFC 3339 times.
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any

import httpx

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.server import serving_in_thread
from tests.factories import CAPABILITIES, RUNTIME, TOOLCHAIN

GIB = 2**30
_tokens = itertools.count(1)


def token_hex() -> str:
    """A fresh 32-byte fencing token, as hex."""
    return (next(_tokens) + 10**9).to_bytes(32, "big").hex()


def capacity_body(**amounts: int) -> dict[str, int]:
    base = {
        "vcpu_count": 8,
        "memory_bytes": 16 * GIB,
        "disk_bytes": 100 * GIB,
        "instances": 4,
        "operations": 16,
    }
    base.update(amounts)
    return base


def runner_body(runner_id: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "runner_id": runner_id,
        "pool_name": "pool-a",
        "backend_kind": "firecracker",
        "architecture": "x86_64",
        "capabilities": list(CAPABILITIES),
        "allocatable": capacity_body(),
        "guest_protocol_minimum": 1,
        "guest_protocol_maximum": 3,
        "supported_egress_contexts": ["default"],
    }
    body.update(overrides)
    return body


def heartbeat_body(at: datetime) -> dict[str, Any]:
    return {
        "at": at.isoformat(),
        "artifact_digests": [RUNTIME],
        "materializations": [
            {
                "backend_kind": "firecracker",
                "architecture": "x86_64",
                "runtime_digest": RUNTIME,
                "toolchain_digest": TOOLCHAIN,
                "digest": "sha256:materialized",
            }
        ],
    }


def requirements_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "pool_name": "pool-a",
        "architecture": "x86_64",
        "capacity": {
            "vcpu_count": 2,
            "memory_bytes": 4 * GIB,
            "disk_bytes": 10 * GIB,
            "instances": 1,
            "operations": 1,
        },
        "guest_protocol_generation": 2,
        "preferred_artifact_digests": [RUNTIME, TOOLCHAIN],
    }
    body.update(overrides)
    return body


def sandbox_body(sandbox_id: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "sandbox_id": sandbox_id,
        "workspace_id": f"workspace-{sandbox_id}",
        "profile_revision_id": "profile-1",
        "requirements": requirements_body(),
        "heartbeat_timeout_seconds": 30,
    }
    body.update(overrides)
    return body


def schedule_body(
    sandbox_id: str, now: datetime, generation: int = 1, **overrides: Any
) -> dict[str, Any]:
    """A valid request for ``sandbox_id``'s ``generation`` (made with sandbox_body)."""
    body: dict[str, Any] = {
        "assignment_id": f"assignment-{sandbox_id}-{generation}",
        "assignment_command_id": f"command-{sandbox_id}-{generation}",
        "instance_id": f"instance-{sandbox_id}",
        "workspace_id": f"workspace-{sandbox_id}",
        "start_mutation_id": f"start-{sandbox_id}-{generation}",
        "profile_revision_id": "profile-1",
        "requirements": requirements_body(),
        "assignment_command": {"kind": "start"},
        "fencing_token": token_hex(),
        "resolved_artifacts": {"runtime": RUNTIME},
        "claim_expires_at": (now + timedelta(minutes=5)).isoformat(),
        "operation_deadline": (now + timedelta(minutes=10)).isoformat(),
        "retry_limit": 2,
        "heartbeat_timeout_seconds": 30,
        "now": now.isoformat(),
        "effect_started_at": now.isoformat(),
        "plan_ready_at": now.isoformat(),
    }
    body.update(overrides)
    return body


PROBLEM_TYPE = "tag:secondbox-scheduler,2026:problem/"
PROBLEM_MEMBERS = {"type", "title", "status", "detail", "instance", "request_id", "code",
                   "retryable", "field", "rule", "reason", "reasons"}  # fmt: skip


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The problem details of ``response`` (RFC 9457), checked to have the API's shape,
    status and code; with ``message`` (the ``detail``) beside them, as the tests read it."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert {"type", "title", "status", "detail", "code", "retryable"} <= set(body), body
    assert set(body) <= PROBLEM_MEMBERS, body
    assert body["type"] == PROBLEM_TYPE + code, body
    assert body["status"] == status, body
    assert body["code"] == code, body
    assert body["retryable"] is (status == 503)
    assert body["instance"] == response.request.url.raw_path.decode().split("?")[0]
    if status == 503:
        assert int(response.headers["retry-after"]) >= 1
    return {**body, "message": body["detail"]}


@contextmanager
def api_client(scheduler: SchedulerApplication, **options: Any) -> Iterator[httpx.Client]:
    """An HTTP client of the service over ``scheduler``, served by uvicorn on a free
    loopback port in a thread."""
    with (
        serving_in_thread(create_app(scheduler, **options)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


class TcpProxy:
    """Forwards a free loopback port to ``target``. :meth:`cut` closes the listener and
    every forwarded connection (the database is gone, as far as a client can tell);
    :meth:`restore` listens on the same port again."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        if self._listener is not None:
            with suppress(OSError):  # wakes the accepting thread
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
