"""``POST /v1/sandboxes`` answers as it did when it read first whether the sandbox
existed (201 new, 200 found) and then called ``create_sandbox``: now the creation itself
tells (``RecordedHome``), awaited on the event loop. The route's answers (status and
body) are compared with that reference's, made on the same service with other ids, for
a new sandbox, the same request again, other fields for an existing id, no compatible
runner (twice), and concurrent creations of one id; with batching on and off, on SQLite
and PostgreSQL."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import httpx
import pytest

from secondbox_scheduler.domain.errors import SandboxNotFoundError, SchedulerError
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.http.errors import scheduler_error_response
from secondbox_scheduler.infrastructure.http.models import SandboxCreation
from tests.conftest import Clock, Store
from tests.http_helpers import api_client, heartbeat_body, requirements_body, runner_body
from tests.http_helpers import sandbox_body as new_body

Answer = tuple[int, dict[str, Any]]


def reference(app: SchedulerApplication, body: dict[str, Any]) -> Answer:
    """The route's answer as it was: whether the sandbox exists read first, then
    ``create_sandbox``; an error answered by the service's error handler."""
    creation = SandboxCreation.model_validate(body)
    try:
        app.sandbox_home(creation.sandbox_id)
        existed = True
    except SandboxNotFoundError:
        existed = False
    try:
        home = app.create_sandbox(
            sandbox_id=creation.sandbox_id,
            workspace_id=creation.workspace_id,
            profile_revision_id=creation.profile_revision_id,
            requirements=creation.requirements,
            heartbeat_timeout=timedelta(seconds=creation.heartbeat_timeout_seconds),
        )
    except SchedulerError as error:
        response = scheduler_error_response(error)
        return response.status_code, json.loads(bytes(response.body))
    return 200 if existed else 201, {"sandbox_id": creation.sandbox_id, "home_runner_id": home}


def routed(client: httpx.Client, body: dict[str, Any]) -> Answer:
    response = client.post("/v1/sandboxes", json=body)
    answer: dict[str, Any] = response.json()
    for name in ("instance", "request_id"):  # the request's own, not the answer's
        answer.pop(name, None)
    return response.status_code, answer


def without(prefix: str, answer: Answer) -> Answer:
    """The answer with the call's ids made one."""
    status, body = answer
    return status, json.loads(json.dumps(body).replace(prefix, "<id>"))


def cases(prefix: str) -> list[dict[str, Any]]:
    other = {"architecture": "arm64"}  # no runner offers it
    return [
        new_body(f"{prefix}-s1"),  # new: 201
        new_body(f"{prefix}-s1"),  # the same again: 200
        new_body(f"{prefix}-s1", workspace_id="elsewhere"),  # other fields: already_exists
        new_body(f"{prefix}-s2", requirements=requirements_body(**other)),  # no runner
        new_body(f"{prefix}-s2", requirements=requirements_body(**other)),  # still none
        new_body(f"{prefix}-s3", heartbeat_timeout_seconds=60),  # new, another timeout
    ]


def served(store: Store, clock: Clock, batching: str) -> SchedulerApplication:
    app = SchedulerApplication(env={**store.env, "SECONDBOX_BATCHING": batching}, now=clock)
    store.opened.append(app)
    return app


def fleet(client: httpx.Client, clock: Clock) -> None:
    for runner_id in ("r1", "r2"):
        assert client.post("/v1/runners", json=runner_body(runner_id)).status_code == 201
        beat = client.post(f"/v1/runners/{runner_id}/heartbeat", json=heartbeat_body(clock()))
        assert beat.status_code == 200, beat.text


@pytest.mark.parametrize("batching", ["on", "off"])
def test_the_create_route_answers_as_reading_first_did(
    store: Store, clock: Clock, batching: str
) -> None:
    app = served(store, clock, batching)
    with api_client(app) as client:
        fleet(client, clock)
        answers = [without("route", routed(client, body)) for body in cases("route")]
    expected = [without("direct", reference(app, body)) for body in cases("direct")]
    assert answers == expected
    assert [status for status, _ in answers] == [201, 200, 409, 409, 409, 201]
    codes = [body.get("code") for _, body in answers]
    assert codes[2:5] == ["already_exists", "no_compatible_runner", "no_compatible_runner"]
    assert app.sandbox_home("route-s1") == answers[0][1]["home_runner_id"]
    with pytest.raises(SandboxNotFoundError):
        app.sandbox_home("route-s2")


def at_once(client: httpx.Client, bodies: list[dict[str, Any]]) -> list[Answer]:
    """Each body sent by a client of its own, all released together."""
    answers: list[Answer] = []
    start = threading.Barrier(len(bodies))

    def call(body: dict[str, Any]) -> None:
        with httpx.Client(base_url=client.base_url, timeout=30) as own:
            start.wait(30)
            answers.append(routed(own, body))

    threads = [threading.Thread(target=call, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == len(bodies)
    return answers


@pytest.mark.parametrize("batching", ["on", "off"])
def test_concurrent_creations_of_one_id_answer_as_one_by_one(
    store: Store, clock: Clock, batching: str
) -> None:
    """As a serial execution of the same requests would: one creates it (201), every
    other finds it (200), all with the same home; then, the sandbox recorded, repeats
    are 200 and calls naming other fields ``already_exists``, whatever their order."""
    app = served(store, clock, batching)
    with api_client(app) as client:
        fleet(client, clock)
        first = at_once(client, [new_body("together")] * 8)
        home = app.sandbox_home("together")
        found = {"sandbox_id": "together", "home_runner_id": home}
        assert sorted(first, key=str) == [(200, found)] * 7 + [(201, found)]
        mixed = at_once(client, [new_body("together"), new_body("together", workspace_id="x")] * 4)
    serial = [
        reference(app, body)
        for body in [new_body("together"), new_body("together", workspace_id="x")]
    ]
    assert sorted(mixed, key=str) == sorted([serial[0], serial[1]] * 4, key=str)
    assert [status for status, _ in serial] == [200, 409]
