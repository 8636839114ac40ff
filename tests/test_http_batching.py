"""Concurrent ``schedule`` requests over HTTP, batched by the service's batcher, get the
answers they get one request per transaction: the same statuses and problem codes,
a runner's capacity never exceeded, a repeated request answered as a replay of the
same assignment, and each request's own caller recorded on its events (not the caller
whose thread committed the batch). On SQLite and PostgreSQL.

The same scenario runs against a service with batching on (a leader waits up to
``WAIT_MS`` for a full batch, so that the concurrent requests do meet in batches) and
one with batching off, on fresh ids each time; their answers are compared.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import httpx

from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.server import serving_in_thread
from secondbox_scheduler.infrastructure.settings import BATCH_WAIT_MS, BATCHING
from tests.conftest import Store
from tests.http_helpers import (
    capacity_body,
    heartbeat_body,
    requirements_body,
    runner_body,
    sandbox_body,
    schedule_body,
)

WAIT_MS = "200"  # batching on: a leader waits this long for the others to queue
ROOM = 3  # instances on the tight runner; TIGHT sandboxes ask for one each
TIGHT = 6
DOUBLED = 3  # sandboxes on the roomy runner, each scheduled twice at once


def wall() -> datetime:
    return datetime.now(UTC)


def _setup(client: httpx.Client, prefix: str, token: str) -> None:
    """A tight runner (room for ROOM) and a roomy one, each alone in its pool; the
    sandboxes homed on them."""
    headers = {"authorization": f"Bearer {token}"}
    for runner, pool, room in (("tight", "tight", ROOM), ("roomy", "roomy", 100)):
        body = runner_body(
            f"{prefix}-{runner}", pool_name=f"{prefix}-{pool}",
            allocatable=capacity_body(instances=room, vcpu_count=2 * room,
                                      memory_bytes=4 * room * 2**30, operations=room),
        )  # fmt: skip
        client.post("/v1/runners", json=body, headers=headers).raise_for_status()
        beat = heartbeat_body(wall())
        client.post(f"/v1/runners/{prefix}-{runner}/heartbeat", json=beat, headers=headers)
    for kind, pool, count in (("tight", "tight", TIGHT), ("roomy", "roomy", DOUBLED),
                              ("lone", "roomy", 1)):  # fmt: skip
        for index in range(count):
            body = sandbox_body(
                f"{prefix}-{kind}-{index}",
                requirements=requirements_body(pool_name=f"{prefix}-{pool}"),
            )
            client.post("/v1/sandboxes", json=body, headers=headers).raise_for_status()


def _requests(prefix: str, tokens: list[str]) -> list[tuple[str, dict[str, Any], str]]:
    """(sandbox id, body, bearer token) of every concurrent request."""
    now = wall()
    found: list[tuple[str, dict[str, Any], str]] = []
    for index in range(TIGHT):
        sandbox_id = f"{prefix}-tight-{index}"
        body = schedule_body(sandbox_id, now, requirements=requirements_body(
            pool_name=f"{prefix}-tight"))  # fmt: skip
        found.append((sandbox_id, body, tokens[index % 2]))
    for index in range(DOUBLED):
        sandbox_id = f"{prefix}-roomy-{index}"
        body = schedule_body(sandbox_id, now, requirements=requirements_body(
            pool_name=f"{prefix}-roomy"))  # fmt: skip
        found += [(sandbox_id, body, tokens[index % 2])] * 2  # the same request twice
    invalid = schedule_body(f"{prefix}-roomy-0", now, fencing_token="00")
    found.append((f"{prefix}-roomy-0", invalid, tokens[0]))
    found.append((f"{prefix}-nowhere", schedule_body(f"{prefix}-nowhere", now), tokens[1]))
    wrong = schedule_body(
        f"{prefix}-lone-0", now, workspace_id="another-workspace",
        requirements=requirements_body(pool_name=f"{prefix}-roomy"),
    )  # fmt: skip
    found.append((f"{prefix}-lone-0", wrong, tokens[0]))
    return found


def _send_at_once(
    base: str, requests: list[tuple[str, dict[str, Any], str]]
) -> list[httpx.Response]:
    """Every request from a thread of its own, released together."""
    answers: list[httpx.Response | None] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def send(index: int) -> None:
        sandbox_id, body, token = requests[index]
        with httpx.Client(base_url=base, timeout=60) as client:
            start.wait()
            answers[index] = client.post(
                f"/v1/sandboxes/{sandbox_id}/schedule", json=body,
                headers={"authorization": f"Bearer {token}"},
            )  # fmt: skip

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(answer is not None for answer in answers)
    return [answer for answer in answers if answer is not None]


def _shape(response: httpx.Response) -> tuple[int, str | None, str | None]:
    """What a serial execution fixes about an answer: status, problem code, field."""
    body = response.json()
    if response.status_code >= 400:
        return response.status_code, body["code"], body.get("field")
    return response.status_code, None, None


def _run(store: Store, prefix: str, batching: bool) -> dict[str, Any]:
    env = {BATCHING: "on" if batching else "off", BATCH_WAIT_MS: WAIT_MS if batching else "0"}
    app = SchedulerApplication(env={**store.env, **env}, now=wall)
    store.opened.append(app)  # closed with the store
    setup = issue_token(app, role="control-plane").token
    callers = [issue_token(app, role="control-plane") for _ in range(2)]
    with serving_in_thread(create_app(app)) as base:
        with httpx.Client(base_url=base, timeout=60) as client:
            _setup(client, prefix, setup)
        requests = _requests(prefix, [caller.token for caller in callers])
        answers = _send_at_once(base, requests)
    by_token = {caller.token: caller.token_id for caller in callers}
    return {"app": app, "requests": requests, "answers": answers, "by_token": by_token}


def _check(run: dict[str, Any], prefix: str) -> Counter[tuple[str, tuple[Any, ...]]]:
    """The run's answers by kind of request, after checking what must hold in any order."""
    app: SchedulerApplication = run["app"]
    requests, answers = run["requests"], run["answers"]
    shapes: Counter[tuple[str, tuple[Any, ...]]] = Counter()
    for (sandbox_id, _, _), answer in zip(requests, answers, strict=True):
        kind = sandbox_id.removeprefix(prefix).split("-")[1]
        shapes[(kind, _shape(answer))] += 1
    # the tight runner: never more than its room, and every placement answered is held
    tight = app.load(runner_uuid(f"{prefix}-tight"), Runner, copy=False)
    assert tight is not None
    assert tight.reserved["instances"] == ROOM
    placed = {
        sandbox_id for (sandbox_id, _, _), answer in zip(requests, answers, strict=True)
        if answer.status_code == 201
    }  # fmt: skip
    assert {s for s in placed if "-tight-" in s} == {
        record["sandbox_id"] for record in tight.reservations.values()
    }
    # a request sent twice: one creation and one replay of the same assignment
    for index in range(DOUBLED):
        sandbox_id = f"{prefix}-roomy-{index}"
        pair = [
            answer for (s, body, _), answer in zip(requests, answers, strict=True)
            if s == sandbox_id and answer.status_code < 400
        ]  # fmt: skip
        assert sorted(answer.status_code for answer in pair) == [200, 201]
        first, second = (answer.json()["assignment"] for answer in pair)
        assert first == second
    # each placement's events record the caller of its own request
    for (sandbox_id, _, token), answer in zip(requests, answers, strict=True):
        if answer.status_code != 201:
            continue
        events = list(app.events.get(sandbox_uuid(sandbox_id)))
        fenced = [e for e in events if type(e).__name__ == "AssignmentFenced"]
        assert fenced, [type(e).__name__ for e in events]
        expected = {"kind": "token", "name": run["by_token"][token], "role": "control-plane"}
        assert all(getattr(event, "actor", None) == expected for event in fenced), sandbox_id
    return shapes


def test_concurrent_http_schedules_answer_as_one_request_per_transaction(store: Store) -> None:
    batched = _run(store, "on", batching=True)
    serial = _run(store, "off", batching=False)
    sizes = batched["app"].metrics.batch_sizes
    assert max(sizes) >= 4, sizes  # the requests did meet in batches
    assert set(serial["app"].metrics.batch_sizes) <= {1}
    expected = Counter(
        {
            ("tight", (201, None, None)): ROOM,
            ("tight", (409, "home_runner_unavailable", None)): TIGHT - ROOM,
            ("roomy", (201, None, None)): DOUBLED,
            ("roomy", (200, None, None)): DOUBLED,
            ("roomy", (422, "invalid_request", "fencing_token")): 1,
            # an unknown sandbox: the request matches no sandbox (decide_placement)
            ("nowhere", (409, "profile_revision_mismatch", None)): 1,
            ("lone", (409, "profile_revision_mismatch", None)): 1,
        }
    )
    batched_shapes, serial_shapes = _check(batched, "on"), _check(serial, "off")
    assert batched_shapes == serial_shapes == expected
