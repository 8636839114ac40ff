"""The HTTP/JSON API over a real uvicorn server and a real HTTP client, on SQLite and
PostgreSQL: the commands and queries, idempotent retries, problem details with the
statuses a client acts on (422, 404, 409, 503 with Retry-After), and nothing written by
a refused request."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.audit.queries import timeline
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.server import listening_socket, serving_in_thread
from tests.conftest import Clock, Store
from tests.factories import only_refusals_since, topics_since
from tests.http_helpers import (
    TcpProxy,
    api_client,
    capacity_body,
    error_of,
    heartbeat_body,
    runner_body,
    sandbox_body,
    schedule_body,
    token_hex,
)
from tests.test_concurrency import Interfering

DOCS = Path(__file__).resolve().parent.parent / "docs"


def prepare(client: httpx.Client, clock: Clock, *sandboxes: str) -> None:
    """Runner r1 registered and fresh; each sandbox created (homed on r1)."""
    assert client.post("/v1/runners", json=runner_body("r1")).status_code == 201
    response = client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(clock()))
    assert response.status_code == 200, response.text
    for sandbox_id in sandboxes:
        response = client.post("/v1/sandboxes", json=sandbox_body(sandbox_id))
        assert response.status_code == 201, response.text


def test_a_sandbox_lifecycle_over_http(store: Store, clock: Clock) -> None:
    app = store.open()
    with api_client(app) as client:
        registered = client.post("/v1/runners", json=runner_body("r1"))
        assert registered.status_code == 201
        assert registered.json()["created"] is True
        assert registered.json()["runner"]["allocatable"] == capacity_body()
        again = client.post("/v1/runners", json=runner_body("r1"))  # a retried registration
        assert (again.status_code, again.json()["created"]) == (200, False)
        beat = client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(clock()))
        assert beat.json() == {"runner_id": "r1", "outcome": "evidence"}

        created = client.post("/v1/sandboxes", json=sandbox_body("s1"))
        assert (created.status_code, created.json()) == (
            201,
            {"sandbox_id": "s1", "home_runner_id": "r1"},
        )
        assert client.post("/v1/sandboxes", json=sandbox_body("s1")).status_code == 200
        assert client.get("/v1/sandboxes/s1").json()["home_runner_id"] == "r1"

        body = schedule_body("s1", clock())
        placed = client.post("/v1/sandboxes/s1/schedule", json=body)
        assert placed.status_code == 201, placed.text
        assignment = placed.json()["assignment"]
        assert placed.json()["created"] is True
        assert assignment["fencing_token"] == body["fencing_token"]
        assert (assignment["runner_id"], assignment["generation"]) == ("r1", 1)
        assert assignment["state"] == "assigned"
        replay = client.post("/v1/sandboxes/s1/schedule", json=body)
        assert (replay.status_code, replay.json()["created"]) == (200, False)
        assert replay.json()["assignment"] == assignment

        fence = {"fencing_token": body["fencing_token"]}
        running = client.post("/v1/sandboxes/s1/generations/1/running", json=fence)
        assert running.json()["state"] == "running"
        proof = {**fence, "release_proof": {"stopped": "yes"}}
        released = client.post("/v1/sandboxes/s1/generations/1/release", json=proof)
        assert released.json() == {"released": True}
        repeat = client.post("/v1/sandboxes/s1/generations/1/release", json=proof)
        assert repeat.json() == {"released": False}
        advanced = client.post("/v1/sandboxes/s1/generations/1/advance")
        assert advanced.json() == {"sandbox_id": "s1", "generation": 2}

        second = client.post("/v1/sandboxes/s1/schedule", json=schedule_body("s1", clock(), 2))
        assert second.status_code == 201, second.text
        assert second.json()["assignment"]["generation"] == 2

        every = client.get("/v1/sandboxes/s1/assignments").json()["assignments"]
        assert [(a["generation"], a["state"]) for a in every] == [(1, "released"), (2, "assigned")]
        first = client.get("/v1/sandboxes/s1/assignment", params={"generation": 1}).json()
        assert first["release_proof"] == {"stopped": "yes"}
        current = client.get("/v1/sandboxes/s1/assignment").json()
        assert current == second.json()["assignment"]
        held = client.get("/v1/runners/r1/assignments").json()["assignments"]
        assert [a["generation"] for a in held] == [2]
        runner = client.get("/v1/runners", params={"pool_name": "pool-a"}).json()["runners"]
        assert [r["id"] for r in runner] == ["r1"]
        assert runner[0]["reserved"] == current["capacity"]
        assert client.get("/v1/runners/r1").json() == runner[0]

        decisions = client.get("/v1/sandboxes/s1/explain").json()["decisions"]
        assert [d["title"].split(":")[0] for d in decisions] == [
            "home runner chosen by create_sandbox",
            "generation 1",
            "generation 2",
        ]
        events = [e["event"] for e in client.get("/v1/sandboxes/s1/timeline").json()["entries"]]
        assert events.count("Sandbox.AssignmentFenced") == 2
        runner_events = client.get("/v1/runners/r1/timeline").json()["entries"]
        assert "Runner.CapacityReleased" in [e["event"] for e in runner_events]
    assert verify(app, measure_raw=False).ok


def test_runner_commands_answer_the_runner_as_it_now_is(store: Store, clock: Clock) -> None:
    app = store.open()
    with api_client(app) as client:
        prepare(client, clock)
        drained = client.post("/v1/runners/r1/drain").json()["runner"]
        assert drained["drain_phase"] == "draining"
        assert client.post("/v1/runners/r1/drain").json()["runner"] == drained  # a repeat
        active = client.post("/v1/runners/r1/cancel-drain").json()["runner"]
        assert active["drain_phase"] == "active"
        bigger = capacity_body(instances=9)
        changed = client.put("/v1/runners/r1/allocatable", json=bigger)
        assert changed.json()["runner"]["allocatable"] == bigger
        gone = client.delete("/v1/runners/r1")
        assert gone.json() == {"runner_id": "r1", "deregistered": True}
        error_of(client.delete("/v1/runners/r1"), 404, "runner_not_found")
        error_of(client.post("/v1/runners", json=runner_body("r1")), 409, "already_exists")


# (method, path, body, field, a fragment of the rule): each is refused with 422 naming
# the field, by the API's own validation or by the scheduler's rules.
def invalid_requests(now: Any) -> list[tuple[str, str, Any, str, str]]:
    good = schedule_body("s1", now)
    schedule = "/v1/sandboxes/s1/schedule"
    return [
        ("POST", schedule, {**good, "requirements": {**good["requirements"], "pool_name": ""}},
         "requirements.pool_name", "must not be empty"),
        ("POST", schedule, {**good, "now": (now - timedelta(hours=1)).isoformat()},
         "now", "scheduler's clock"),
        ("POST", schedule, {**good, "fencing_token": "zz" * 32}, "fencing_token", "pattern"),
        ("POST", schedule, {**good, "fencing_token": "ab" * 31}, "fencing_token", "at least"),
        ("POST", schedule, {k: v for k, v in good.items() if k != "instance_id"},
         "instance_id", "Field required"),
        ("POST", schedule, {**good, "sandbox_id": "s1"}, "sandbox_id", "Extra inputs"),
        ("POST", schedule, {**good, "retry_limit": "2"}, "retry_limit", "integer"),
        ("POST", schedule, {**good, "heartbeat_timeout_seconds": 0},
         "heartbeat_timeout_seconds", "greater than 0"),
        ("POST", schedule, {**good, "claim_expires_at": "tomorrow"}, "claim_expires_at", "ISO"),
        ("POST", schedule, "{not json", "body", "JSON"),
        ("POST", "/v1/runners", runner_body("a/b"), "runner_id", "pattern"),
        ("POST", "/v1/runners", runner_body(".."), "runner_id", "'.' or '..'"),
        ("POST", "/v1/runners", runner_body("r2", capabilities=["compute\x1b[2J"]),
         "capabilities", "control characters"),
        ("POST", "/v1/runners/r1/heartbeat", heartbeat_body(now + timedelta(minutes=5)),
         "at", "scheduler's clock"),
        ("POST", "/v1/sandboxes/s1/generations/0/running", {"fencing_token": "ab" * 32},
         "generation", "greater than or equal to 1"),
        ("POST", "/v1/sandboxes/s1/generations/1/reconcile-claim",
         {"owner": "me", "until": (now + timedelta(hours=2)).isoformat()}, "until", "at most"),
        ("POST", "/v1/sandboxes/s1/generations/1/fail",
         {"fencing_token": "ab" * 32, "failure_class": "gremlins"}, "failure_class", "Input"),
        ("PUT", "/v1/runners/r1/allocatable", capacity_body(instances=-1),
         "instances", "greater than or equal to 0"),
    ]  # fmt: skip


def test_invalid_input_is_a_422_naming_the_field_and_rule_and_writes_nothing(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    with api_client(app) as client:
        prepare(client, clock, "s1")
        placed = client.post("/v1/sandboxes/s1/schedule", json=schedule_body("s1", clock()))
        assert placed.status_code == 201
        for method, path, body, field, rule in invalid_requests(clock()):
            head = app.head_position()
            if isinstance(body, str):
                headers = {"content-type": "application/json"}
                response = client.request(method, path, content=body, headers=headers)
            else:
                response = client.request(method, path, json=body)
            detail = error_of(response, 422, "invalid_request")
            assert detail["field"] == field or detail["field"].startswith(f"{field}."), (
                path,
                detail,
            )
            assert rule in detail["rule"], (path, detail)
            assert app.head_position() == head, (path, topics_since(app, head))


def test_unknown_things_are_404_in_the_same_shape(store: Store, clock: Clock) -> None:
    app = store.open()
    with api_client(app) as client:
        prepare(client, clock, "s1")
        error_of(client.get("/v1/runners/nobody"), 404, "runner_not_found")
        error_of(client.get("/v1/runners/nobody/timeline"), 404, "runner_not_found")
        error_of(client.get("/v1/sandboxes/nothing"), 404, "sandbox_not_found")
        error_of(client.get("/v1/sandboxes/nothing/explain"), 404, "sandbox_not_found")
        error_of(client.get("/v1/sandboxes/nothing/assignment"), 404, "sandbox_not_found")
        error_of(client.get("/v1/sandboxes/s1/assignment"), 404, "assignment_not_found")
        error_of(client.get("/v2/anything"), 404, "not_found")
        not_allowed = error_of(client.delete("/v1/sandboxes"), 405, "method_not_allowed")
        assert not_allowed["message"]


def test_a_stale_fence_is_a_409_and_writes_nothing(store: Store, clock: Clock) -> None:
    app = store.open()
    with api_client(app) as client:
        prepare(client, clock, "s1")
        body = schedule_body("s1", clock())
        assert client.post("/v1/sandboxes/s1/schedule", json=body).status_code == 201
        head = app.head_position()
        wrong = {"fencing_token": token_hex()}
        for path in ("running", "fail"):
            extra = {"failure_class": "transport"} if path == "fail" else {}
            response = client.post(f"/v1/sandboxes/s1/generations/1/{path}", json=wrong | extra)
            error_of(response, 409, "stale_fence")
        proof = {"fencing_token": body["fencing_token"], "release_proof": {"a": "b"}}
        error_of(
            client.post("/v1/sandboxes/s1/generations/2/release", json=proof), 409, "stale_fence"
        )
        error_of(client.post("/v1/sandboxes/s1/generations/1/advance"), 409, "invalid_transition")
        assert app.head_position() == head


def test_a_refused_placement_is_a_409_with_reasons_and_records_only_evidence(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    with api_client(app) as client:
        prepare(client, clock, "s1")
        client.post("/v1/runners/r1/drain")
        head = app.head_position()
        refused = client.post("/v1/sandboxes/s1/schedule", json=schedule_body("s1", clock()))
        detail = error_of(refused, 409, "home_runner_unavailable")
        assert detail["reasons"] == {"draining": 1}
        assert "0/1 runners are available: 1 draining" in detail["message"]
        assert only_refusals_since(app, head)
        nowhere = client.post(
            "/v1/sandboxes", json=sandbox_body("s2", heartbeat_timeout_seconds=30)
        )
        assert error_of(nowhere, 409, "no_compatible_runner")["reasons"] == {"draining": 1}
        error_of(
            client.post("/v1/sandboxes", json=sandbox_body("s1", workspace_id="other")),
            409,
            "already_exists",
        )


def test_contention_is_a_503_with_retry_after_and_the_retry_succeeds(
    store: Store, clock: Clock
) -> None:
    app, rival = store.open(), store.open()
    with api_client(app) as client:
        prepare(client, clock, "s1")
        body = schedule_body("s1", clock(), serialization_retry_limit=0)
        app.save_in_order = Interfering(app, rival, times=1)  # type: ignore[method-assign]
        lost = client.post("/v1/sandboxes/s1/schedule", json=body)
        assert (
            "lost 1 optimistic-concurrency race"
            in error_of(lost, 503, "serialization_contention")["message"]
        )
        retried = client.post("/v1/sandboxes/s1/schedule", json=body)
        assert (retried.status_code, retried.json()["created"]) == (201, True)


@pytest.mark.postgres
def test_an_unreachable_store_is_a_503_and_the_service_recovers(
    postgres_schema: Any, clock: Clock
) -> None:
    server = postgres_schema.server
    proxy = TcpProxy(server.host, server.port)
    env = {
        **postgres_schema.env(),
        "POSTGRES_PORT": str(proxy.port),
        "POSTGRES_CONNECT_TIMEOUT": "1",
    }
    app = SchedulerApplication(env=env, now=clock)
    try:
        with api_client(app) as client:
            prepare(client, clock, "s1")
            proxy.cut()
            body = schedule_body("s1", clock())
            lost = client.post("/v1/sandboxes/s1/schedule", json=body)
            assert error_of(lost, 503, "store_unavailable")["reason"] == "unavailable"
            not_ready = client.get("/readyz")
            assert not_ready.status_code == 503
            assert int(not_ready.headers["retry-after"]) >= 1
            assert not_ready.json()["ready"] is False
            assert not_ready.json()["store"] == "unavailable: connection-refused"
            assert client.get("/healthz").status_code == 200
            assert "secondbox_scheduler_store_up 0.0" in client.get("/metrics").text
            proxy.restore()
            placed = retried(lambda: client.post("/v1/sandboxes/s1/schedule", json=body))
            assert placed.status_code == 201, placed.text  # the same request, retried
            assert client.get("/readyz").status_code == 200
    finally:
        app.close()
        proxy.cut()


def retried(call: Callable[[], httpx.Response], attempts: int = 20) -> httpx.Response:
    """``call()`` again while it answers 503, as a client does (a short pause here)."""
    for _ in range(attempts - 1):
        response = call()
        if response.status_code != 503:
            return response
        time.sleep(0.25)
    return call()


def test_ids_travel_percent_encoded(store: Store, clock: Clock) -> None:
    app = store.open()
    runner_id = "runner 1?#%é"
    with api_client(app) as client:
        assert client.post("/v1/runners", json=runner_body(runner_id)).status_code == 201
        path = f"/v1/runners/{quote(runner_id, safe='')}"
        assert client.get(path).json()["id"] == runner_id
        beat = client.post(f"{path}/heartbeat", json=heartbeat_body(clock()))
        assert beat.json()["runner_id"] == runner_id


def test_readiness_judges_the_read_models_lag(store: Store, clock: Clock) -> None:
    external = SchedulerApplication(
        env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock
    )
    store.opened.append(external)
    with api_client(external, max_read_model_lag=1) as client:
        prepare(client, clock)  # registration and heartbeat: 3 events, none applied
        lagging = client.get("/readyz")
        assert lagging.status_code == 503
        assert int(lagging.headers["retry-after"]) >= 1
        readiness = lagging.json()
        assert (readiness["ready"], readiness["store"], readiness["read_models"]) == (
            False,
            "ok",
            "external",
        )
        assert max(p["lag_events"] for p in readiness["projections"]) == 3
        assert external.read_models is not None
        external.read_models.catch_up()
        assert client.get("/readyz").json()["ready"] is True
    with api_client(store.open(), max_read_model_lag=0) as client:  # inline: caught up first
        client.post("/v1/runners", json=runner_body("r2"))
        ready = client.get("/readyz").json()
        assert ready["read_models"] == "inline"
        assert ready["ready"] is True


def test_the_curl_client_of_the_docs_runs_against_the_service(tmp_path: Path) -> None:
    """docs/examples/curl-client.sh, as operations.md shows it (system clock, SQLite),
    with a control-plane token: every event it causes records that token's actor."""
    curl = shutil.which("curl")
    assert curl is not None, "the documented client needs curl (apt-get install curl)"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path}/c.db"})
    try:
        token = issue_token(app, role="control-plane")
        with serving_in_thread(create_app(app)) as url:
            done = subprocess.run(
                ["bash", str(DOCS / "examples" / "curl-client.sh"), url],
                env={**os.environ, "SANDBOX": "sbx-docs", "TOKEN": token.token},
                capture_output=True,
                text=True,
                timeout=120,
            )
        entries = timeline(app, sandbox_id="sbx-docs")
        actors = {e.actor["name"] if e.actor else None for e in entries}
    finally:
        app.close()
    assert actors == {token.token_id}
    assert done.returncode == 0, done.stdout + done.stderr
    answers = [line for line in done.stdout.splitlines() if " -> " in line]
    assert answers == [
        "POST /v1/runners -> 201",
        "POST /v1/runners/runner-1/heartbeat -> 200",
        "POST /v1/sandboxes -> 201",
        "POST /v1/sandboxes/sbx-docs/schedule -> 201",
        "POST /v1/sandboxes/sbx-docs/schedule -> 200",
        "POST /v1/sandboxes/sbx-docs/generations/1/running -> 200",
        "POST /v1/sandboxes/sbx-docs/generations/1/release -> 200",
        "POST /v1/sandboxes/sbx-docs/generations/1/advance -> 200",
    ]
    assert app.metrics.placements == 1


def test_the_listening_socket_disables_nagle_for_every_connection() -> None:
    """A pre-bound socket without protocol number made asyncio skip TCP_NODELAY on the
    accepted connections: every answer's body then waited for the client's delayed ACK
    (about 40 ms a request on Linux)."""
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY only then
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()
