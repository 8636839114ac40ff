"""The cell router on two real PostgreSQL stores: cell ``a`` on the tests' server, cell
``b`` on a throwaway cluster this module starts (and stops, to take the cell down).

Routing by pool and by id, ids unique across cells (also when two routers race to
create one id in two cells), unknown ids naming the cells asked, a stopped cell's typed
error while the other cell goes on placing, and a router built while a cell was down
serving it once it is up.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from secondbox_scheduler.domain.cell_claims import KIND_SANDBOX
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    RunnerNotFoundError,
    SandboxNotFoundError,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.config import Cell, CellsConfig
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from tests.conftest import Clock
from tests.factories import HEARTBEAT_TIMEOUT, register, requirements, schedule_request
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
    name = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    return name


@pytest.fixture
def cells(postgres_server: PostgresServer, cluster_b: ThrowawayCluster) -> CellsConfig:
    """Two cells, each in a new schema: a (pool-a) here, b (pool-b) on the cluster."""
    return CellsConfig(
        (
            Cell("a", postgres_server.url(_schema(postgres_server)), frozenset({POOL_A})),
            Cell("b", cluster_b.server.url(_schema(cluster_b.server)), frozenset({POOL_B})),
        )
    )


@pytest.fixture
def routers(cells: CellsConfig, clock: Clock) -> Iterator[Callable[[], CellRouter]]:
    opened: list[CellRouter] = []

    def open_router() -> CellRouter:
        router = CellRouter(cells, now=clock, env={"POSTGRES_CONNECT_TIMEOUT": "2"})
        opened.append(router)
        return router

    yield open_router
    for router in opened:
        router.close()


def register_in(router: CellRouter, runner_id: str, pool: str, clock: Clock) -> None:
    register(router, runner_id, at=clock(), pool_name=pool)  # type: ignore[arg-type]


def create_in(router: CellRouter, sandbox_id: str, pool: str) -> str:
    return router.create_sandbox(
        sandbox_id=sandbox_id,
        workspace_id=f"workspace-{sandbox_id}",
        profile_revision_id="profile-1",
        requirements=requirements(pool_name=pool),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )


def schedule_in(router: CellRouter, sandbox_id: str, pool: str, clock: Clock) -> Any:
    request = schedule_request(sandbox_id, clock(), requirements=requirements(pool_name=pool))
    return router.schedule(request)


def ids_kept_by(router: CellRouter, kind: str, cell: str, prefix: str, count: int) -> list[str]:
    """``count`` ids whose claim the directory keeps in ``cell``."""
    found = []
    for n in range(1000):
        candidate = f"{prefix}-{n}"
        if router.directory_of(kind, candidate) == cell:
            found.append(candidate)
            if len(found) == count:
                return found
    raise AssertionError("the directory never chose the cell")


def held(app: SchedulerApplication, sandbox_id: str) -> bool:
    try:
        app.sandbox_home(sandbox_id)
    except SandboxNotFoundError:
        return False
    return True


def test_commands_go_to_the_cell_of_their_pool_and_of_their_id(
    routers: Callable[[], CellRouter], clock: Clock
) -> None:
    router = routers()
    register_in(router, "ra", POOL_A, clock)
    register_in(router, "rb", POOL_B, clock)
    assert create_in(router, "sa", POOL_A) == "ra"
    assert create_in(router, "sb", POOL_B) == "rb"
    assignment, created = schedule_in(router, "sb", POOL_B, clock)
    assert created
    assert assignment.runner_id == "rb"
    a, b = router.application("a"), router.application("b")
    assert [r.id for r in a.runner_snapshots()] == ["ra"]
    assert [r.id for r in b.runner_snapshots()] == ["rb"]
    assert held(b, "sb")
    assert not held(a, "sb")
    assert held(a, "sa")
    assert not held(b, "sa")
    assert b.get_assignment("sb") == assignment
    assert router.get_assignment("sb") == assignment
    assert [r.cell for r in router.runner_rows()] == ["a", "b"]
    # another router, with nothing cached, finds the same cells through the directory
    other = routers()
    assert other.cell_of_sandbox("sb") == "b"
    assert other.cell_of_runner("ra") == "a"
    assert other.runner_assignments("rb") == [assignment]


def test_a_pool_no_cell_owns_is_refused_naming_the_field(
    routers: Callable[[], CellRouter], clock: Clock
) -> None:
    router = routers()
    with pytest.raises(InvalidRequestError) as caught:
        create_in(router, "s-nowhere", "pool-z")
    assert caught.value.field == "requirements.pool_name"
    assert "pool-z" in str(caught.value)
    assert "a, b" in str(caught.value)


def test_an_id_another_cell_holds_is_refused_naming_that_cell(
    routers: Callable[[], CellRouter], clock: Clock
) -> None:
    router = routers()
    register_in(router, "r1", POOL_A, clock)
    register_in(router, "r2", POOL_B, clock)
    with pytest.raises(AlreadyExistsError, match="cell 'a'"):
        routers().register_runner(
            runner_id="r1",
            pool_name=POOL_B,
            backend_kind="firecracker",
            architecture="x86_64",
            capabilities={},
            allocatable={"vcpu_count": 1},
            guest_protocol_minimum=1,
            guest_protocol_maximum=3,
        )
    create_in(router, "s1", POOL_A)
    with pytest.raises(AlreadyExistsError, match="cell 'a'"):
        create_in(routers(), "s1", POOL_B)
    assert not held(router.application("b"), "s1")
    assert create_in(router, "s1", POOL_A) == "r1"  # the same creation again: a replay


def race(first: CellRouter, second: CellRouter, sandbox_id: str) -> dict[str, object]:
    """Each router creates ``sandbox_id`` at once, in a pool of its own cell."""
    start = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def create(router: CellRouter, pool: str) -> None:
        start.wait()
        try:
            outcomes[pool] = create_in(router, sandbox_id, pool)
        except AlreadyExistsError as error:
            outcomes[pool] = error

    threads = [
        threading.Thread(target=create, args=(first, POOL_A)),
        threading.Thread(target=create, args=(second, POOL_B)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_two_routers_racing_to_create_one_id_in_two_cells_make_it_in_one(
    routers: Callable[[], CellRouter], clock: Clock
) -> None:
    first, second = routers(), routers()
    register_in(first, "ra", POOL_A, clock)
    register_in(first, "rb", POOL_B, clock)
    for n in range(6):
        sandbox_id = f"race-{n}"
        outcomes = race(first, second, sandbox_id)
        won = [pool for pool, outcome in outcomes.items() if isinstance(outcome, str)]
        assert len(won) == 1, outcomes
        holders = [cell for cell in "ab" if held(first.application(cell), sandbox_id)]
        assert holders == ["a" if won == [POOL_A] else "b"]


def test_an_unknown_id_names_the_cells_asked(
    routers: Callable[[], CellRouter], clock: Clock
) -> None:
    router = routers()
    with pytest.raises(SandboxNotFoundError) as caught:
        router.mark_running("ghost", 1, b"\x01" * 16)
    message = str(caught.value)
    assert "'ghost'" in message
    assert "a" in message
    assert "b" in message
    assert f"{router.directory_of(KIND_SANDBOX, 'ghost')} (its directory)" in message
    with pytest.raises(RunnerNotFoundError, match="asked cells"):
        router.record_heartbeat(runner_id="ghost", at=clock())


def test_a_stopped_cell_fails_its_own_commands_while_the_other_places(
    routers: Callable[[], CellRouter], cluster_b: ThrowawayCluster, clock: Clock
) -> None:
    router = routers()
    register_in(router, "ra", POOL_A, clock)
    register_in(router, "rb", POOL_B, clock)
    create_in(router, "sb", POOL_B)
    placed_in_a = ids_kept_by(router, KIND_SANDBOX, "a", "sa", 3)
    create_in(router, placed_in_a[0], POOL_A)
    cluster_b.halt()
    try:
        with pytest.raises(CellUnavailableError) as caught:
            schedule_in(router, "sb", POOL_B, clock)
        assert caught.value.cell == "b"
        assert caught.value.retryable
        with pytest.raises(CellUnavailableError) as caught:
            router.record_heartbeat(runner_id="rb", at=clock())
        assert caught.value.cell == "b"
        # cell a goes on: an existing sandbox placed, new ones whose directory is a made
        assert schedule_in(router, placed_in_a[0], POOL_A, clock)[1]
        for sandbox_id in placed_in_a[1:]:
            assert create_in(router, sandbox_id, POOL_A) == "ra"
            assert schedule_in(router, sandbox_id, POOL_A, clock)[0].runner_id == "ra"
        # a new router (nothing cached) finds a's sandboxes without cell b
        assert routers().get_assignment(placed_in_a[1]) is not None
        # a list over every cell names the cell that did not answer
        across = router.runner_snapshots_across()
        assert [row.cell for row in across.rows] == ["a"]
        assert set(across.unavailable) == {"b"}
        # creating an id whose directory cell is b needs b: refused naming it
        kept_by_b = ids_kept_by(router, KIND_SANDBOX, "b", "sx", 1)[0]
        with pytest.raises(CellUnavailableError) as caught:
            create_in(router, kept_by_b, POOL_A)
        assert caught.value.cell == "b"
    finally:
        cluster_b.start()
    assert schedule_in(router, "sb", POOL_B, clock)[0].runner_id == "rb"  # b is back


def test_a_router_built_while_a_cell_is_down_serves_it_once_it_is_up(
    routers: Callable[[], CellRouter], cluster_b: ThrowawayCluster, clock: Clock
) -> None:
    cluster_b.halt()
    try:
        router = routers()
        register_in(router, "ra", POOL_A, clock)
        with pytest.raises(CellUnavailableError) as caught:
            router.application("b")
        assert caught.value.cell == "b"
    finally:
        cluster_b.start()
    register_in(router, "rb", POOL_B, clock)
    assert router.get_runner("rb").pool_name == POOL_B


def test_a_runner_moves_to_another_cell_once_deregistered_in_its_own(
    cells: CellsConfig, routers: Callable[[], CellRouter], clock: Clock
) -> None:
    """Moving a pool (docs/operations.md): drain, let the assignments end, deregister,
    change the cells file, register the runners again: they are now the new cell's."""
    router = routers()
    register_in(router, "mover", POOL_A, clock)
    router.start_drain("mover")
    router.deregister_runner("mover")
    a, b = cells.cells
    moved = CellsConfig(
        (Cell("a", a.database_url, frozenset()), Cell("b", b.database_url, b.pools | {POOL_A}))
    )
    with pytest.raises(InvalidRequestError):
        CellsConfig(
            (Cell("a", a.database_url, a.pools), Cell("b", b.database_url, b.pools | a.pools))
        )
    after = CellRouter(moved, now=clock)
    try:
        register_in(after, "mover", POOL_A, clock)
        assert after.cell_of_runner("mover") == "b"
        # the router that still caches cell a finds the runner in b
        clock.advance(seconds=1)
        router.record_heartbeat(runner_id="mover", at=clock())
        assert router.cell_of_runner("mover") == "b"
    finally:
        after.close()
    # a registered runner's id does not move
    register_in(router, "stayer", POOL_A, clock)
    with CellRouter(moved, now=clock) as later, pytest.raises(AlreadyExistsError, match="'a'"):
        register_in(later, "stayer", POOL_A, clock)
