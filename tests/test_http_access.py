"""Access to the HTTP service: bearer tokens and roles (infrastructure/http/access.py).

The route x role check is generated from the service's own OpenAPI document: every
operation must have an entry in the access table (an operation without one fails
here), and for each one a request without a token is 401, one with each role the
table does not name is 403, and one with each role it names is neither. Then what an
attacker would try: a runner token acting for another runner (by path, body, a body
field against the path, duplicate keys, another runner's assignment), malformed,
huge, doubled, unknown, expired and revoked tokens, and unknown routes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.persistence import OperationalError
from fastapi.testclient import TestClient

from secondbox_scheduler.domain.access_tokens import ROLES
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.access.cache import TokenCache
from secondbox_scheduler.infrastructure.access.tokens import (
    IssuedToken,
    issue_token,
    load_tokens,
    revoke_token,
)
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.access import ROUTE_ACCESS, access_of
from tests.conftest import Clock
from tests.factories import (
    create_sandbox,
    register,
    requirements,
    schedule_request,
)

METHODS = ("get", "put", "post", "delete", "patch")
DOCUMENT = create_app(SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"}))
OPERATIONS = sorted(
    (method.upper(), path)
    for path, item in DOCUMENT.openapi()["paths"].items()
    for method in item
    if method in METHODS
)


@dataclass
class Service:
    app: SchedulerApplication
    client: TestClient
    tokens: dict[str, IssuedToken]  # by role; the runner token names runner-1 only
    spare: IssuedToken  # a token the checks may revoke
    fences: dict[str, str]  # sandbox -> its generation 1 fencing token (hex)

    def headers(self, role: str | None) -> dict[str, str]:
        if role is None:
            return {}
        return {"Authorization": f"Bearer {self.tokens[role].token}"}


def _fill(template: str, service: Service) -> str:
    path = (
        template.replace("{runner_id}", "runner-1")
        .replace("{sandbox_id}", "sbx-1")
        .replace("{generation}", "1")
        .replace("{token_id}", service.spare.token_id)
    )
    return f"{path}?timeout=0" if path.endswith("/events/stream") else path  # ends at once


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """runner-1 holds sbx-1's assignment, runner-2 (another pool) sbx-2's; a token of
    every role (the runner token for runner-1)."""
    clock = Clock()
    url = f"sqlite:///{tmp_path_factory.mktemp('access') / 's.db'}"
    env = {"SECONDBOX_DATABASE_URL": url, "SECONDBOX_TOKEN_REFRESH_SECONDS": "0"}
    app = SchedulerApplication(env=env, now=clock)
    register(app, "runner-1", at=clock())
    register(app, "runner-2", at=clock(), pool_name="pool-b")
    create_sandbox(app, "sbx-1")
    create_sandbox(app, "sbx-2", pool_name="pool-b")
    fences = {}
    for sandbox, wanted in (("sbx-1", requirements()), ("sbx-2", requirements(pool_name="pool-b"))):
        assignment, _ = app.schedule(schedule_request(sandbox, clock(), requirements=wanted))
        fences[sandbox] = assignment.fencing_token.hex()
    tokens = {
        role: issue_token(app, role=role, runner_ids=["runner-1"] if role == "runner" else [])
        for role in ROLES
    }
    spare = issue_token(app, role="auditor")
    with TestClient(create_app(app)) as client:
        yield Service(app, client, tokens, spare, fences)
    app.close()


def test_every_operation_of_the_document_has_an_entry_in_the_access_table() -> None:
    """A new route must join the table: an operation without an entry fails here (and
    is refused to every token meanwhile); an entry without an operation is stale."""
    assert len(OPERATIONS) > 25
    assert sorted(set(OPERATIONS) - set(ROUTE_ACCESS)) == []
    assert sorted(set(ROUTE_ACCESS) - set(OPERATIONS)) == []


def test_no_two_templates_of_a_method_can_match_one_path() -> None:
    """Each path names one entry: no literal segment stands where another template of
    the same method has a parameter (or another literal) at the same place."""

    def overlap(a: str, b: str) -> bool:
        left, right = a.strip("/").split("/"), b.strip("/").split("/")
        return len(left) == len(right) and all(
            x == y or x.startswith("{") or y.startswith("{")
            for x, y in zip(left, right, strict=True)
        )

    keys = sorted(ROUTE_ACCESS)
    clashes = [
        (a, b)
        for i, a in enumerate(keys)
        for b in keys[i + 1 :]
        if a[0] == b[0] and overlap(a[1], b[1])
    ]
    assert clashes == []


@pytest.mark.parametrize(
    ("method", "template"), OPERATIONS, ids=[f"{m} {t}" for m, t in OPERATIONS]
)
def test_every_operation_refuses_no_token_and_a_wrong_role_and_takes_the_right_ones(
    method: str, template: str, service: Service
) -> None:
    access = access_of(method, template)
    assert access is not None
    path = _fill(template, service)
    body: dict[str, Any] | None = None
    if method in ("POST", "PUT"):
        body = {"runner_id": "runner-1"} if access.runner == "body" else {}

    def call(role: str | None) -> int:
        response = service.client.request(method, path, json=body, headers=service.headers(role))
        if response.status_code in (401, 403):
            assert response.json()["code"] in ("unauthorized", "forbidden")
        status: int = response.status_code
        return status

    if access.public:
        assert {call(None), *(call(role) for role in ROLES)} <= {200, 503}
        return
    assert call(None) == 401
    for role in ROLES:
        status = call(role)
        if role in access.roles:
            assert status not in (401, 403), role
        else:
            assert status == 403, role


def _registration(runner_id: str) -> dict[str, Any]:
    return {
        "runner_id": runner_id,
        "pool_name": "pool-a",
        "backend_kind": "firecracker",
        "architecture": "x86_64",
        "capabilities": ["toolchain"],
        "allocatable": {"vcpu_count": 1, "memory_bytes": 2**30, "disk_bytes": 2**30},
        "guest_protocol_minimum": 1,
        "guest_protocol_maximum": 3,
    }


def test_a_runner_token_cannot_act_for_another_runner(service: Service) -> None:
    client, head = service.client, service.app.head_position()
    runner = service.headers("runner")
    at = service.app.now().isoformat()
    refused = [
        client.post("/v1/runners", json=_registration("runner-3"), headers=runner),
        client.post("/v1/runners/runner-2/heartbeat", json={"at": at}, headers=runner),
        # the body names the token's runner, the path another: the path is who acts
        client.post(
            "/v1/runners/runner-2/heartbeat",
            json={"at": at, "runner_id": "runner-1"},
            headers=runner,
        ),
        client.post("/v1/runners/runner-2/drain", headers=runner),
        client.get("/v1/runners/runner-1", headers=runner),  # reads: not a runner's
        *(
            client.post(
                f"/v1/sandboxes/sbx-2/generations/1/{report}",
                json=body | {"fencing_token": service.fences["sbx-2"]},
                headers=runner,
            )
            for report, body in (
                ("running", {}),
                ("fail", {"failure_class": "transport"}),
                ("release", {"release_proof": {"exit": "clean"}}),
            )
        ),
        client.post(  # a generation with no assignment: no runner the token names
            "/v1/sandboxes/sbx-1/generations/2/running",
            json={"fencing_token": service.fences["sbx-1"]},
            headers=runner,
        ),
        client.post(
            "/v1/sandboxes/sbx-1/generations/01x/running",
            json={"fencing_token": service.fences["sbx-1"]},
            headers=runner,
        ),
        client.post(  # not JSON: no runner id to read
            "/v1/runners", content=b"{runner_id: runner-1", headers=runner
        ),
    ]
    assert [r.status_code for r in refused] == [403] * len(refused), [r.text for r in refused]
    assert all(r.json()["code"] == "forbidden" for r in refused)
    assert service.app.head_position() == head  # nothing written


def test_duplicate_runner_ids_in_a_body_are_read_as_the_route_reads_them(service: Service) -> None:
    """The check reads the very bytes the route parses, with the same parser: whichever
    key wins for one wins for the other, so the runner checked is the runner written."""
    runner = service.headers("runner") | {"Content-Type": "application/json"}
    other_last = json.dumps(_registration("runner-1"))[:-1] + ', "runner_id": "runner-9"}'
    mine_last = json.dumps(_registration("runner-9"))[:-1] + ', "runner_id": "runner-1"}'
    first = service.client.post("/v1/runners", content=other_last, headers=runner)
    assert first.status_code == 403
    second = service.client.post("/v1/runners", content=mine_last, headers=runner)
    assert second.status_code in (200, 201, 409), second.text
    assert {r.id for r in service.app.fold_runner_snapshots()} == {"runner-1", "runner-2"}


def test_a_runner_token_acts_for_its_own_runner(service: Service) -> None:
    runner = service.headers("runner")
    at = service.app.now().isoformat()
    beat = service.client.post("/v1/runners/runner-1/heartbeat", json={"at": at}, headers=runner)
    assert beat.status_code == 200, beat.text
    running = service.client.post(
        "/v1/sandboxes/sbx-1/generations/1/running",
        json={"fencing_token": service.fences["sbx-1"]},
        headers=runner,
    )
    assert running.status_code == 200, running.text
    entries = service.app.fold_assignments("sbx-1")
    assert entries[-1].state == "running"
    token = service.tokens["runner"]
    timeline = service.client.get(
        "/v1/sandboxes/sbx-1/timeline", headers=service.headers("auditor")
    ).json()["entries"]
    assert timeline[-1]["actor"] == {"kind": "token", "name": token.token_id, "role": "runner"}


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Basic dXNlcjpwYXNz",
        "Bearer",
        "Bearer sbt_0123456789ab_" + "A" * 43,  # well formed, unknown id
        "Bearer " + "A" * 10_000,  # huge
        "Bearer sbt_XYZ",
    ],
    ids=["none", "basic", "empty", "unknown", "huge", "malformed"],
)
def test_a_request_without_a_valid_token_is_401_with_a_bearer_challenge(
    authorization: str | None, service: Service
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = service.client.get("/v1/runners", headers=headers)
    assert response.status_code == 401
    assert response.json()["code"] == "unauthorized"
    challenge = response.headers["WWW-Authenticate"]
    assert challenge.startswith('Bearer realm="secondbox-scheduler"')
    assert ('error="invalid_token"' in challenge) == (authorization is not None)
    if authorization:
        assert authorization.split(" ")[-1] not in response.text


def test_the_right_id_with_a_wrong_secret_reads_as_an_unknown_token(service: Service) -> None:
    real = service.tokens["control-plane"]
    forged = real.token[:-4] + ("AAAA" if not real.token.endswith("AAAA") else "BBBB")
    unknown = "sbt_0123456789ab_" + real.token[-43:]
    answers = [
        service.client.get("/v1/runners", headers={"Authorization": f"Bearer {t}"}).json()
        for t in (forged, unknown)
    ]
    assert answers[0] == answers[1]  # the same refusal: no oracle for a token's id
    doubled = service.client.get(
        "/v1/runners",
        headers=[("Authorization", f"Bearer {real.token}")] * 2,
    )
    assert doubled.status_code == 401
    lower = service.client.get("/v1/runners", headers={"Authorization": f"bearer {real.token}"})
    assert lower.status_code == 200


def test_unknown_routes_need_a_token_before_they_are_404(service: Service) -> None:
    assert service.client.get("/v1/nothing").status_code == 401
    assert service.client.get("/v1/nothing", headers=service.headers("auditor")).status_code == 404
    assert service.client.get("/openapi.json").status_code == 401
    document = service.client.get("/openapi.json", headers=service.headers("runner"))
    assert document.status_code == 200


def test_the_health_probes_stay_open_and_metrics_need_a_token_unless_left_open(
    service: Service,
) -> None:
    assert service.client.get("/healthz").status_code == 200
    assert service.client.get("/readyz").status_code in (200, 503)
    assert service.client.get("/metrics").status_code == 401
    assert service.client.get("/metrics", headers=service.headers("auditor")).status_code == 200
    with TestClient(create_app(service.app, open_metrics=True)) as open_client:
        assert open_client.get("/metrics").status_code == 200
        assert open_client.get("/v1/runners").status_code == 401


def test_an_admin_issues_lists_and_revokes_tokens_over_http(service: Service) -> None:
    admin = service.headers("admin")
    made = service.client.post("/v1/tokens", json={"role": "auditor"}, headers=admin)
    assert made.status_code == 201, made.text
    issued = made.json()
    assert set(issued) >= {"id", "role", "token"}
    mine = {"Authorization": f"Bearer {issued['token']}"}
    assert service.client.get("/v1/runners", headers=mine).status_code == 200
    listed = service.client.get("/v1/tokens", headers=admin)
    assert issued["id"] in {t["id"] for t in listed.json()["tokens"]}
    assert issued["token"] not in listed.text
    assert "sha256" not in listed.text
    assert service.client.get("/v1/tokens", headers=mine).status_code == 403
    revoked = service.client.delete(f"/v1/tokens/{issued['id']}", headers=admin)
    assert revoked.json() == {"id": issued["id"], "revoked": True}
    refused = service.client.get("/v1/runners", headers=mine)
    assert refused.status_code == 401
    assert refused.json()["detail"].endswith(f"token {issued['id']} is revoked")
    again = service.client.delete(f"/v1/tokens/{issued['id']}", headers=admin)
    assert again.json()["revoked"] is False
    unknown = service.client.delete("/v1/tokens/0123456789ab", headers=admin)
    assert unknown.status_code == 404
    assert unknown.json()["code"] == "access_token_not_found"


def test_an_expired_token_is_refused(service: Service) -> None:
    clock = service.app._now
    assert isinstance(clock, Clock)
    token = issue_token(service.app, role="auditor", expires_at=clock() + timedelta(hours=1))
    headers = {"Authorization": f"Bearer {token.token}"}
    assert service.client.get("/v1/runners", headers=headers).status_code == 200
    clock.advance(seconds=2 * 3600)
    try:
        expired = service.client.get("/v1/runners", headers=headers)
    finally:
        clock.advance(seconds=-2 * 3600)
    assert expired.status_code == 401
    assert expired.json()["detail"].endswith(f"token {token.token_id} is expired")


def test_a_route_missing_from_the_table_is_refused_to_every_token(service: Service) -> None:
    app = create_app(service.app)

    @app.get("/v1/unlisted")
    def unlisted() -> dict[str, str]:
        return {"listed": "no"}

    with TestClient(app) as client:
        for role in ROLES:
            answer = client.get("/v1/unlisted", headers=service.headers(role))
            assert answer.status_code == 403, role
            assert "in no role's access" in answer.json()["detail"]


def test_with_no_token_issued_the_service_is_open_and_callers_anonymous(
    tmp_path: Path, clock: Clock
) -> None:
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'open.db'}"}, now=clock
    )
    try:
        with TestClient(create_app(app)) as client:
            body = _registration("r1")
            assert client.post("/v1/runners", json=body).status_code == 201
            entries = client.get("/v1/runners/r1/timeline").json()["entries"]
        assert entries[0]["actor"] == {"kind": "anonymous", "name": "testclient", "role": None}
    finally:
        app.close()


def test_tokens_never_read_fail_the_request_closed_and_tokens_read_are_kept(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica whose store fails before it ever read the tokens answers 503 (never
    open); one that read them keeps them while the store fails (its /metrics then still
    answers, store_up 0, to a token it knew)."""
    failing = False
    read = TokenCache._read

    def reading(self: TokenCache) -> None:
        if failing:
            raise OperationalError("the store went away")
        read(self)

    monkeypatch.setattr(TokenCache, "_read", reading)
    headers = service.headers("auditor")
    with TestClient(create_app(service.app)) as client:
        assert client.get("/metrics", headers=headers).status_code == 200  # read once
        failing = True
        assert client.get("/metrics", headers=headers).status_code == 200  # kept
        assert client.get("/metrics").status_code == 401
    with TestClient(create_app(service.app)) as client:  # a replica that never read them
        answer = client.get("/metrics", headers=headers)
        assert answer.status_code == 503
        assert answer.json()["code"] == "store_unavailable"
        assert client.get("/healthz").status_code == 200


def test_a_revocation_on_another_replica_is_seen_within_the_refresh_interval(
    tmp_path: Path, clock: Clock
) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    first = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    second = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    try:
        token = issue_token(first, role="auditor")
        now = [0.0]
        cache = TokenCache(first, 2.0, monotonic=lambda: now[0])
        held = cache.current()
        assert held is not None
        assert held.tokens[token.token_id]["revoked_at"] is None
        assert revoke_token(second, token.token_id)
        now[0] = 1.9  # within the interval: the tokens as read
        assert cache.current().tokens[token.token_id]["revoked_at"] is None  # type: ignore[union-attr]
        now[0] = 2.0  # past it: read again, the revocation seen
        refreshed = cache.current()
        assert refreshed is not None
        assert refreshed.tokens[token.token_id]["revoked_at"] is not None
        stored = load_tokens(first)
        assert stored is not None
        assert refreshed.version == stored.version
    finally:
        first.close()
        second.close()


def test_the_store_keeps_only_the_tokens_digest(service: Service) -> None:
    stored = b"".join(
        n.state for n in service.app.recorder.select_notifications(start=1, limit=100_000)
    )
    for token in (*service.tokens.values(), service.spare):
        assert token.token.encode() not in stored
        assert token.token[-43:].encode() not in stored  # the secret


def test_no_log_line_holds_a_token(service: Service, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever the service logs while it checks tokens (at every level, the store's
    warnings included), a presented token is never in it."""
    forged = service.tokens["admin"].token[:-2] + "zz"
    with caplog.at_level("DEBUG"):
        for token in (service.tokens["admin"].token, forged):
            service.client.get("/v1/tokens", headers={"Authorization": f"Bearer {token}"})
            service.client.post("/v1/tokens", json={"role": "x"}, headers={"Authorization": token})
    assert caplog.records  # the service (and its libraries) logged something
    for token in (service.tokens["admin"].token, forged):
        assert token[-43:] not in caplog.text
