"""Schemathesis against the served OpenAPI document.

For every operation of ``/openapi.json``, schemathesis generates requests from the
schema (its explicit examples, boundary values of the coverage phase, and random
valid and invalid ones) and sends them to the service in-process, over a store that
already holds the resources the path examples name (runner ``runner-1``, sandbox
``sbx-1`` with an assignment) and access tokens: each case carries a token of a role
its operation admits (admin for tokens, drains and deregistration, control-plane for
the rest), so that the checks behind the access check are fuzzed too. Every answer
must be no 500, documented (status, content type, headers, body schema), and a
refused request must write nothing: no event at all, except the refusal evidence a
refused placement records by design (and the tokens an admin issues).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from secondbox_scheduler.domain.access_tokens import ROLE_ADMIN as ADMIN
from secondbox_scheduler.domain.access_tokens import ROLE_CONTROL_PLANE as CONTROL_PLANE
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.access import access_of
from tests.conftest import Clock
from tests.factories import (
    create_sandbox,
    only_refusals_since,
    register,
    schedule_request,
    topics_since,
)

MAX_EXAMPLES = 12  # random cases per operation and generation mode (the fuzzing phase)
PLACEMENT_REFUSALS = {
    "no_compatible_runner",
    "home_runner_unavailable",
    "egress_context_unavailable",
}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


CONFIG = schemathesis.Config.from_dict(
    {"generation": {"max-examples": MAX_EXAMPLES, "deterministic": True}}
)
# The document is the same for every store: read it from a service over the in-memory
# store; each test then sends its cases to the service of its own store (``app=``).
schema = schemathesis.openapi.from_asgi(
    "/openapi.json",
    create_app(SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})),
    config=CONFIG,
)


@pytest.fixture
def service(postgres_schema: Any, clock: Clock) -> Iterator[FastAPI]:
    """The service over a PostgreSQL schema that holds what the path examples name
    (PostgreSQL, the production store: it refuses more than SQLite, a NUL in a text),
    and a token of each role the cases carry (``app.state.tokens``)."""
    app = SchedulerApplication(env=postgres_schema.env(), now=clock)
    try:
        register(app, "runner-1", at=clock())
        create_sandbox(app, "sbx-1")
        app.schedule(schedule_request("sbx-1", clock()))
        tokens = {role: issue_token(app, role=role).token for role in (ADMIN, CONTROL_PLANE)}
        service = create_app(app)
        service.state.tokens = tokens
        service.state.feed_max_wait_seconds = 0  # a long poll answers at once
        service.state.feed_max_stream_seconds = 0  # a stream ends after what is there
        yield service
    finally:
        app.close()


def authorization(case: Any, service: FastAPI) -> dict[str, str]:
    """A bearer token of a role the case's operation admits."""
    access = access_of(case.operation.method.upper(), case.operation.path)
    assert access is not None, case.operation.path  # tests/test_http_access.py
    role = CONTROL_PLANE if CONTROL_PLANE in access.roles else ADMIN
    return {"Authorization": f"Bearer {service.state.tokens[role]}"}


@pytest.mark.postgres
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_answer_is_documented_and_a_refusal_writes_nothing(
    case: Any, service: FastAPI
) -> None:
    scheduler = service.state.scheduler
    assert isinstance(scheduler, SchedulerApplication)
    head = scheduler.head_position()
    response = case.call_and_validate(
        checks=CHECKS, app=service, headers=authorization(case, service)
    )
    assert response.status_code not in (401, 403), response.text
    if response.status_code < 400:
        return
    code = response.json().get("code")
    if code in PLACEMENT_REFUSALS:
        assert only_refusals_since(scheduler, head), topics_since(scheduler, head)
    else:
        assert scheduler.head_position() == head, (code, topics_since(scheduler, head))
