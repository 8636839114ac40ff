"""The HTTP service over a cell router: cell ``a`` in a database of the tests' server,
cell ``b`` on a throwaway cluster this module starts and stops.

A service built while a cell is down serves it once it is up (its applications are
built when first needed); a stopped cell's commands answer 503 ``cell_unavailable``
with ``Retry-After`` naming the cell while the other cell places (201); the runner list
names each row's cell and the cells that did not answer; ``/metrics`` labels every
cell's series; ``/readyz`` stays ready while a cell answers.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from secondbox_scheduler.domain.cell_claims import KIND_SANDBOX
from secondbox_scheduler.infrastructure.cells.config import Cell, CellsConfig
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.http import create_app
from tests.conftest import Clock
from tests.factories import register, requirements, schedule_request
from tests.postgres_server import PostgresServer, ThrowawayCluster

POOL_A, POOL_B = "pool-a", "pool-b"


@pytest.fixture(scope="module")
def cluster_b() -> Iterator[ThrowawayCluster]:
    cluster = ThrowawayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def _schema(server: PostgresServer) -> str:
    name = f"h_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    return name


@pytest.fixture
def router(
    postgres_server: PostgresServer, cluster_b: ThrowawayCluster, clock: Clock
) -> Iterator[CellRouter]:
    config = CellsConfig(
        (
            Cell("a", postgres_server.url(_schema(postgres_server)), frozenset({POOL_A})),
            Cell("b", cluster_b.server.url(_schema(cluster_b.server)), frozenset({POOL_B})),
        )
    )
    with CellRouter(config, now=clock, env={"POSTGRES_CONNECT_TIMEOUT": "2"}) as router:
        yield router


def runner_body(runner_id: str, pool: str) -> dict[str, Any]:
    return {
        "runner_id": runner_id,
        "pool_name": pool,
        "backend_kind": "firecracker",
        "architecture": "x86_64",
        "capabilities": {"compute": True},
        "allocatable": {"vcpu_count": 8, "memory_bytes": 2**34, "instances": 4},
        "guest_protocol_minimum": 1,
        "guest_protocol_maximum": 3,
    }


def sandbox_body(sandbox_id: str, pool: str) -> dict[str, Any]:
    return {
        "sandbox_id": sandbox_id,
        "workspace_id": f"workspace-{sandbox_id}",
        "profile_revision_id": "profile-1",
        "requirements": requirements(pool_name=pool).model_dump(mode="json"),
        "heartbeat_timeout_seconds": 60,
    }


def test_a_service_built_while_a_cell_is_down_serves_it_once_it_is_up(
    router: CellRouter, cluster_b: ThrowawayCluster
) -> None:
    cluster_b.halt()
    try:
        client = TestClient(create_app(router))
        down = client.post("/v1/runners", json=runner_body("rb", POOL_B))
        assert down.status_code == 503
        assert down.json()["code"] == "cell_unavailable"
        assert "'b'" in down.json()["detail"]
        assert down.headers["Retry-After"]
        assert client.post("/v1/runners", json=runner_body("ra", POOL_A)).status_code == 201
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["cells"]["a"] == "ok"
        assert ready.json()["cells"]["b"].startswith("unavailable")
    finally:
        cluster_b.start()
    assert client.post("/v1/runners", json=runner_body("rb", POOL_B)).status_code == 201


def test_a_stopped_cell_answers_503_naming_it_while_the_other_cell_places(
    router: CellRouter, cluster_b: ThrowawayCluster, clock: Clock
) -> None:
    client = TestClient(create_app(router))
    for runner_id, pool in (("ra", POOL_A), ("rb", POOL_B)):
        register(router, runner_id, at=clock(), pool_name=pool)  # type: ignore[arg-type]
    assert client.post("/v1/sandboxes", json=sandbox_body("sb", POOL_B)).status_code == 201
    # the same creation again through the router: found recorded in its cell, 200
    assert client.post("/v1/sandboxes", json=sandbox_body("sb", POOL_B)).status_code == 200
    new_in_a = next(
        f"sa-{n}" for n in range(100) if router.directory_of(KIND_SANDBOX, f"sa-{n}") == "a"
    )
    listed = client.get("/v1/runners").json()
    assert [(row["cell"], row["id"]) for row in listed["runners"]] == [("a", "ra"), ("b", "rb")]
    assert listed["unavailable_cells"] == {}
    scrape = client.get("/metrics").text
    assert 'secondbox_scheduler_cell_up{cell="b"} 1.0' in scrape
    assert 'cell="a"' in scrape
    cluster_b.halt()
    try:
        answer = client.post("/v1/runners/rb/heartbeat", json={"at": clock().isoformat()})
        assert answer.status_code == 503
        assert answer.json()["code"] == "cell_unavailable"
        assert answer.headers["Retry-After"]
        created = client.post("/v1/sandboxes", json=sandbox_body(new_in_a, POOL_A))
        assert created.status_code == 201, created.json()
        assert created.json()["home_runner_id"] == "ra"
        listed = client.get("/v1/runners").json()
        assert [row["id"] for row in listed["runners"]] == ["ra"]
        assert set(listed["unavailable_cells"]) == {"b"}
        assert 'secondbox_scheduler_cell_up{cell="b"} 0.0' in client.get("/metrics").text
    finally:
        cluster_b.start()
    router.schedule(
        schedule_request(new_in_a, clock(), requirements=requirements(pool_name=POOL_A))
    )
    assigned = client.get(f"/v1/sandboxes/{new_in_a}/assignments")
    assert assigned.headers["Secondbox-Cell"] == "a"
    assert [(row["cell"], row["runner_id"]) for row in assigned.json()["assignments"]] == [
        ("a", "ra")
    ]
    held = client.get("/v1/runners/rb/assignments")
    assert held.headers["Secondbox-Cell"] == "b"


def test_metrics_count_each_cells_commands_from_the_first(router: CellRouter, clock: Clock) -> None:
    client = TestClient(create_app(router))
    register(router, "ra", at=clock(), pool_name=POOL_A)  # type: ignore[arg-type]
    sandbox_id = next(
        f"m-{n}" for n in range(100) if router.directory_of(KIND_SANDBOX, f"m-{n}") == "a"
    )
    assert client.post("/v1/sandboxes", json=sandbox_body(sandbox_id, POOL_A)).status_code == 201
    router.schedule(
        schedule_request(sandbox_id, clock(), requirements=requirements(pool_name=POOL_A))
    )
    scrape = client.get("/metrics").text
    assert 'secondbox_scheduler_placements_total{cell="a"} 1.0' in scrape


def test_the_lists_page_cell_by_cell_and_the_feed_follows_one_cells_log(
    router: CellRouter, clock: Clock
) -> None:
    client = TestClient(create_app(router))
    ids = {"a": [f"ra{n}" for n in range(3)], "b": [f"rb{n}" for n in range(2)]}
    for cell, pool in (("a", POOL_A), ("b", POOL_B)):
        for runner_id in ids[cell]:
            assert client.post("/v1/runners", json=runner_body(runner_id, pool)).status_code == 201
    seen: list[tuple[str, str]] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/runners", params=params).json()
        assert len(page["runners"]) <= 2
        assert page["unavailable_cells"] == {}
        seen += [(row["cell"], row["id"]) for row in page["runners"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == [("a", r) for r in ids["a"]] + [("b", r) for r in ids["b"]]
    assert pages >= 3
    refused = client.get("/v1/runners", params={"cursor": "nowhere~x"})
    assert refused.status_code == 422
    assert refused.json()["field"] == "cursor"
    unnamed = client.get("/v1/events")
    assert unnamed.status_code == 422
    assert unnamed.json()["field"] == "cell"
    events = client.get("/v1/events", params={"cell": "b"}).json()["events"]
    registered = {e["runner_id"] for e in events if e["type"] == "Runner.Registered"}
    assert registered == set(ids["b"])  # (b's log may also hold other ids' cell claims)
    assert len(events) >= 2
