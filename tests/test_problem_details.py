"""Error answers are RFC 9457 problem details, and the service logs each request as one
JSON line (infrastructure/http/errors.py, infrastructure/http/request_log.py).

Problem details: ``application/problem+json`` with ``type``, ``title`` (the same for
every occurrence of a type), ``status``, ``detail``, ``instance`` (the path, never the
query) and the codes of before as extension members; the OpenAPI document declares that
media type for every problem answer. The request log: a request id (the client's, when
it is a plain token), the route template, status, outcome, the problem's code, the
latency and the actor from the request's state; never a header, query or body.
"""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.errors import PROBLEM_JSON, PROBLEM_TYPE
from secondbox_scheduler.infrastructure.http.request_log import (
    REQUEST_LOGGER,
    JsonFormatter,
    actor_of,
    new_request_id,
)
from secondbox_scheduler.infrastructure.http.server import serving_in_thread
from tests.http_helpers import api_client, error_of, runner_body

SECRET = "s3cr3t-token-value"


@pytest.fixture
def scheduler() -> Iterator[SchedulerApplication]:
    app = SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})
    try:
        yield app
    finally:
        app.close()


def test_a_refusal_is_a_problem_document(scheduler: SchedulerApplication) -> None:
    with api_client(scheduler) as client:
        first = error_of(client.get("/v1/runners/nope"), 404, "runner_not_found")
        second = error_of(client.get("/v1/runners/other"), 404, "runner_not_found")
        invalid = error_of(client.post("/v1/runners", json=runner_body("")), 422, "invalid_request")
    assert first["type"] == f"{PROBLEM_TYPE}runner_not_found"
    assert first["title"] == second["title"] == "Runner not found"  # the type's, every time
    assert first["detail"] != second["detail"]  # the occurrence's
    assert "'nope'" in first["detail"]
    assert first["instance"] == "/v1/runners/nope"
    assert (invalid["field"], invalid["instance"]) == ("runner_id", "/v1/runners")
    assert invalid["rule"]


def test_the_instance_is_the_path_as_sent_without_the_query(
    scheduler: SchedulerApplication,
) -> None:
    with api_client(scheduler) as client:
        answer = client.get("/v1/runners/a%20b", params={"token": SECRET})
    problem = error_of(answer, 404, "runner_not_found")
    assert problem["instance"] == "/v1/runners/a%20b"
    assert SECRET not in answer.text


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/no/such/route", 404, "not_found"),
        ("DELETE", "/v1/runners", 405, "method_not_allowed"),
    ],
)
def test_the_frameworks_own_errors_are_problems_too(
    scheduler: SchedulerApplication, method: str, path: str, status: int, code: str
) -> None:
    with api_client(scheduler) as client:
        error_of(client.request(method, path), status, code)


def test_a_body_past_the_limit_is_a_problem(scheduler: SchedulerApplication) -> None:
    with api_client(scheduler, max_body_bytes=1024) as client:
        answer = client.post("/v1/runners", content=b"x" * 4096)
    assert error_of(answer, 413, "body_too_large")["instance"] == "/v1/runners"


def test_a_fault_is_an_internal_error_problem_without_its_details(
    scheduler: SchedulerApplication, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError(f"the fault's own text {SECRET}")

    monkeypatch.setattr(scheduler, "assignments", broken)
    with api_client(scheduler) as client:
        answer = client.get("/v1/sandboxes/s1/assignments")
    problem = error_of(answer, 500, "internal_error")
    assert SECRET not in problem["detail"]
    assert problem["title"] == "Internal error"


def test_the_openapi_document_declares_problem_details(scheduler: SchedulerApplication) -> None:
    document = create_app(scheduler).openapi()
    schema = document["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "detail", "code", "retryable"} <= set(schema["required"])
    assert {"instance", "request_id", "field", "rule", "reason", "reasons"} <= set(
        schema["properties"]
    )
    problems = 0
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                content = response.get("content", {})
                if status.startswith(("4", "5")) and path.startswith("/v1"):
                    assert set(content) == {PROBLEM_JSON}, (method, path, status, content)
                    problems += 1
                for media, body in content.items():
                    refers = body.get("schema", {}).get("$ref", "").endswith("/Problem")
                    assert refers == (media == PROBLEM_JSON), (method, path, status, media)
    assert problems >= 4 * len([p for p in document["paths"] if p.startswith("/v1")])
    assert "HTTPValidationError" not in document["components"]["schemas"]


# -- the request log ---------------------------------------------------------------------


@contextmanager
def request_lines() -> Iterator[list[dict[str, Any]]]:
    """The request logger's lines while the block runs, as serve writes them (JSON)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(REQUEST_LOGGER)
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    lines: list[dict[str, Any]] = []
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        lines.extend(json.loads(line) for line in stream.getvalue().splitlines())


@dataclass
class Actor:
    """What an authentication might put in the request's state (a token's id and role;
    the secret itself must never reach the log)."""

    id: str
    role: str
    token: str = SECRET


@contextmanager
def served(app: FastAPI) -> Iterator[httpx.Client]:
    with serving_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def test_the_access_log_has_one_json_line_per_request(scheduler: SchedulerApplication) -> None:
    app = create_app(scheduler, access_log=True)
    with request_lines() as lines, served(app) as client:
        ok = client.get("/healthz", headers={"X-Request-Id": "req-7.a:b"})
        missing = client.get(
            "/v1/runners/r9",
            params={"token": SECRET},
            # not a plain token (a space): replaced. (A control character such as DEL
            # is refused earlier, by httptools, with a plain 400.)
            headers={"Authorization": f"Bearer {SECRET}", "X-Request-Id": "bad id"},
        )
        client.post("/v1/runners", json={**runner_body("r1"), "pool_name": SECRET})
    assert ok.headers["x-request-id"] == "req-7.a:b"
    generated = missing.headers["x-request-id"]
    assert generated != "bad id"
    assert len(generated) == 32
    assert missing.json()["request_id"] == generated
    assert [(line["route"], line["status"], line["outcome"], line["code"]) for line in lines] == [
        ("/healthz", 200, "ok", None),
        ("/v1/runners/{runner_id}", 404, "refused", "runner_not_found"),
        ("/v1/runners", 201, "ok", None),
    ]
    assert [line["request_id"] for line in lines[:2]] == ["req-7.a:b", generated]
    anonymous = {"kind": "anonymous", "name": "127.0.0.1"}  # no token issued yet
    assert [line["actor"] for line in lines] == [None, anonymous, anonymous]  # health: none
    for line in lines:
        assert line["level"] == "info"
        assert line["latency_ms"] >= 0
        assert line["method"] in ("GET", "POST")
        assert SECRET not in json.dumps(line)


def test_without_the_access_log_only_server_errors_are_logged(
    scheduler: SchedulerApplication, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a fault")

    monkeypatch.setattr(scheduler, "assignments", broken)
    with request_lines() as lines, served(create_app(scheduler)) as client:
        client.get("/healthz")
        client.get("/v1/runners/r9")
        client.get("/v1/sandboxes/s1/assignments")
    assert [(line["level"], line["status"], line["outcome"]) for line in lines] == [
        ("error", 500, "error")
    ]


def test_the_actor_is_the_tokens_and_never_its_secret(scheduler: SchedulerApplication) -> None:
    issued = issue_token(scheduler, role="control-plane")
    app = create_app(scheduler, access_log=True)
    with request_lines() as lines, served(app) as client:
        client.get("/v1/runners", headers={"Authorization": f"Bearer {issued.token}"})
    assert [line["actor"] for line in lines] == [
        {"kind": "token", "role": "control-plane", "name": issued.token_id}
    ]
    assert issued.token not in json.dumps(lines)


@pytest.mark.parametrize(
    ("actor", "logged"),
    [
        (None, None),
        ("cli:alice", "cli:alice"),
        ({"id": "t1", "role": "auditor", "token": SECRET}, {"id": "t1", "role": "auditor"}),
        (Actor("t2", "runner"), {"id": "t2", "role": "runner"}),
        (object(), None),
    ],
)
def test_what_of_an_actor_is_logged(actor: object, logged: object) -> None:
    assert actor_of({"actor": actor}) == logged


def test_request_ids_made_by_the_service_are_new_uuid_hex() -> None:
    made = {new_request_id() for _ in range(1000)}
    assert len(made) == 1000
    assert all(uuid.UUID(hex=made_id).version == 4 and len(made_id) == 32 for made_id in made)
