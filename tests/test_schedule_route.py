"""The direct schedule route (``infrastructure/http/schedule_route.py``) answers as the
FastAPI route does: the same requests, valid and not, sent to a service with it and to
one without it, on fresh ids each, get the same statuses, content types, problem
details and bodies; the direct route itself answers the valid ones (not the FastAPI
route behind it), and its requests count under the route's template in the metrics.
On SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http import schedule_route as direct
from secondbox_scheduler.infrastructure.http.server import serving_in_thread
from tests.conftest import Store
from tests.http_helpers import (
    capacity_body,
    heartbeat_body,
    requirements_body,
    runner_body,
    sandbox_body,
    schedule_body,
)

JSON = {"content-type": "application/json"}
Request = tuple[str, bytes, dict[str, str]]  # path, body, headers
CHUNKED = "x-test-chunked"  # a header of the test's: send the body in chunks


@contextmanager
def _service(app: SchedulerApplication, *, fast: bool) -> Iterator[httpx.Client]:
    with (
        serving_in_thread(create_app(app, schedule_route=fast)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def _setup(client: httpx.Client, p: str, at: datetime, headers: dict[str, str]) -> None:
    """One runner with room for one sandbox, alone in its pool; sandboxes a and b homed
    on it (b is refused once a holds the room)."""
    body = runner_body(f"{p}-r", pool_name=f"{p}-pool", allocatable=capacity_body(instances=1))
    client.post("/v1/runners", json=body, headers=headers).raise_for_status()
    beat = heartbeat_body(at)
    client.post(f"/v1/runners/{p}-r/heartbeat", json=beat, headers=headers).raise_for_status()
    for name in ("a", "b"):
        sandbox = sandbox_body(f"{p}-{name}", requirements=requirements_body(pool_name=f"{p}-pool"))
        client.post("/v1/sandboxes", json=sandbox, headers=headers).raise_for_status()


def _schedule(p: str, name: str, at: datetime, token: int, **overrides: Any) -> dict[str, Any]:
    body = schedule_body(
        f"{p}-{name}", at, requirements=requirements_body(pool_name=f"{p}-pool"), **overrides
    )
    body["fencing_token"] = f"{token:064x}"
    return body


def _requests(p: str, at: datetime) -> list[Request]:
    """Valid requests, replays, refusals and every kind of bad input."""
    a = _schedule(p, "a", at, 1)
    raw_a = json.dumps(a).encode()
    path_a = f"/v1/sandboxes/{p}-a/schedule"
    bad_types = {**a, "retry_limit": "2"}
    bad_time = {**a, "claim_expires_at": "yesterday"}
    extra = {**a, "surprise": True}
    missing = {k: v for k, v in a.items() if k != "instance_id"}
    none = _schedule(p, "none", at, 2)
    far = {**a, "now": (at + timedelta(hours=1)).isoformat()}
    return [
        (path_a, b"not json", JSON),
        (path_a, b"[1, 2]", JSON),
        (path_a, b"{}", JSON),
        (path_a, b"", JSON),
        (path_a, json.dumps(missing).encode(), JSON),
        (path_a, json.dumps(extra).encode(), JSON),
        (path_a, json.dumps(bad_types).encode(), JSON),
        (path_a, json.dumps(bad_time).encode(), JSON),
        (path_a, b'{"now": NaN}', JSON),
        (path_a, json.dumps(far).encode(), JSON),  # the scheduler's clock refuses it
        (path_a, raw_a, {"content-type": "text/plain"}),
        (f"/v1/sandboxes/{'x' * (MAX_NAME_LENGTH + 1)}/schedule", raw_a, JSON),
        (f"/v1/sandboxes/{p}-%E2%80%AEa/schedule", raw_a, JSON),  # a look-alike id
        (f"/v1/sandboxes/{p}-none/schedule", json.dumps(none).encode(), JSON),
        (path_a, raw_a, JSON),  # placed: 201
        (path_a, raw_a, JSON),  # a replay: 200
        (path_a, raw_a, {"content-type": "application/json; charset=utf-8"}),  # a replay
        (path_a, raw_a, {}),  # no content type: refused (422)
        (path_a, raw_a, {**JSON, CHUNKED: "1"}),  # the body in chunks: a replay
        (path_a, json.dumps(_schedule(p, "a", at, 3)).encode(), JSON),  # another token
        (f"/v1/sandboxes/{p}-b/schedule", json.dumps(_schedule(p, "b", at, 4)).encode(), JSON),
    ]


def _answer(response: httpx.Response, p: str) -> tuple[int, str, Any, str | None]:
    """An answer with its ids made the same across prefixes and its request id left out."""
    text = response.text.replace(p, "P")
    body: Any = json.loads(text) if text else None
    if isinstance(body, dict):
        body.pop("request_id", None)
    return (
        response.status_code,
        response.headers.get("content-type", ""),
        body,
        response.headers.get("retry-after"),
    )


def _exchange(
    client: httpx.Client, p: str, at: datetime, headers: dict[str, str]
) -> list[tuple[int, str, Any, str | None]]:
    _setup(client, p, at, headers)
    answers = []
    for path, body, extra in _requests(p, at):
        content: Any = body
        if CHUNKED in extra:  # chunked transfer encoding, the body in three messages
            content = iter([body[:7], body[7:50], body[50:]])
        response = client.post(path, content=content, headers={**headers, **extra})
        answers.append(_answer(response, p))
    return answers


def test_the_direct_route_answers_as_the_fastapi_route(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = store.open()
    at = store.clock()
    answered_directly: list[str] = []
    parsed = direct._parsed

    def counting(scope: Any, body: bytes) -> Any:
        result = parsed(scope, body)
        if result is not None:
            answered_directly.append(result[0])
        return result

    monkeypatch.setattr(direct, "_parsed", counting)
    with _service(app, fast=False) as slow:
        expected = _exchange(slow, "slow", at, {})
    assert answered_directly == []  # the route is not installed there
    with _service(app, fast=True) as fast:
        answers = _exchange(fast, "fast", at, {})
        metrics = fast.get("/metrics").text
    for index, (got, want) in enumerate(zip(answers, expected, strict=True)):
        assert got == want, (index, _requests("x", at)[index][0])
    statuses = [status for status, *_ in answers]
    assert statuses[-7:-4] == [201, 200, 200], statuses
    assert statuses[-3] == 200, statuses  # the chunked replay
    assert statuses[-1] == 409, statuses
    assert statuses[:13] == [422] * 13, statuses
    # valid requests were answered by the direct route, not handed on
    assert answered_directly.count("fast-a") >= 5
    assert "fast-b" in answered_directly
    assert 'route="/v1/sandboxes/{sandbox_id}/schedule",status="201"' in metrics


def test_the_direct_route_checks_access_as_the_fastapi_route(store: Store) -> None:
    app = store.open()
    at = store.clock()
    admin = issue_token(app, role="admin").token
    runner = issue_token(app, role="runner", runner_ids=["r"]).token
    control = issue_token(app, role="control-plane").token
    results = {}
    for fast, p in ((False, "slow"), (True, "fast")):
        with _service(app, fast=fast) as client:
            _setup(client, p, at, {"authorization": f"Bearer {control}"})
            raw = json.dumps(_schedule(p, "a", at, 1)).encode()
            path = f"/v1/sandboxes/{p}-a/schedule"
            results[fast] = [
                _answer(client.post(path, content=raw, headers={**JSON, **extra}), p)
                for extra in (
                    {},
                    {"authorization": "Bearer nonsense"},
                    {"authorization": f"Bearer {runner}"},
                    {"authorization": f"Bearer {admin}"},
                    {"authorization": f"Bearer {control}"},
                )
            ]
    assert results[True] == results[False]
    assert [status for status, *_ in results[True]] == [401, 401, 403, 403, 201]
