"""The command line over cells (two databases of the tests' server, one per cell): lists
naming each row's cell, the federation checkpoint and ``audit verify --cells``, a command
that acts on one store refusing a cells file, and a cell's backup and restore (``pg_dump``
into a new database) checked against a checkpoint taken before the dump.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from secondbox_scheduler.infrastructure.cells.config import CELLS, parse_cells
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.cli import cli
from tests.conftest import Clock
from tests.factories import HEARTBEAT_TIMEOUT, register, requirements, schedule_request
from tests.postgres_server import PostgresServer

POOL_A, POOL_B = "pool-a", "pool-b"


def _database(server: PostgresServer, created: list[str]) -> str:
    name = f"cell_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    created.append(name)
    return name


def _url(server: PostgresServer, dbname: str) -> str:
    return server.url().rsplit("/", 1)[0] + f"/{dbname}"


@pytest.fixture
def databases(postgres_server: PostgresServer) -> Iterator[list[str]]:
    created: list[str] = []
    yield created
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def cells_text(urls: dict[str, str]) -> str:
    pools = {"a": POOL_A, "b": POOL_B}
    return "".join(
        f'[cells.{name}]\ndatabase_url = "{url}"\npools = ["{pools[name]}"]\n\n'
        for name, url in urls.items()
    )


@pytest.fixture
def cells_file(
    postgres_server: PostgresServer, databases: list[str], tmp_path: Path, clock: Clock
) -> Path:
    """Two cells with a runner and a placed sandbox each."""
    urls = {name: _url(postgres_server, _database(postgres_server, databases)) for name in "ab"}
    path = tmp_path / "cells.toml"
    path.write_text(cells_text(urls))
    with CellRouter(parse_cells(path.read_text()), now=clock) as router:
        for cell, pool in (("a", POOL_A), ("b", POOL_B)):
            register(router, f"r{cell}", at=clock(), pool_name=pool)  # type: ignore[arg-type]
            place(router, f"s{cell}", pool, clock)
    return path


def place(router: CellRouter, sandbox_id: str, pool: str, clock: Clock) -> None:
    router.create_sandbox(
        sandbox_id=sandbox_id,
        workspace_id=f"workspace-{sandbox_id}",
        profile_revision_id="profile-1",
        requirements=requirements(pool_name=pool),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    router.schedule(
        schedule_request(sandbox_id, clock(), requirements=requirements(pool_name=pool))
    )


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.output


def test_runners_and_assignments_over_cells_name_each_rows_cell(cells_file: Path) -> None:
    code, out = run("runners", "--cells", str(cells_file), "--json")
    assert code == 0, out
    assert [(row["cell"], row["id"]) for row in json.loads(out)] == [("a", "ra"), ("b", "rb")]
    code, out = run("assignments", "--sandbox", "sb", "--json", env={CELLS: str(cells_file)})
    assert code == 0, out
    rows = json.loads(out)
    assert [(row["cell"], row["runner_id"]) for row in rows] == [("b", "rb")]
    code, out = run("--cells", str(cells_file), "runners")  # before the command
    assert code == 0, out
    assert "cell" in out


def test_a_command_on_one_store_refuses_a_cells_file(cells_file: Path) -> None:
    for args in (["--cells", str(cells_file), "simulate"], ["audit", "state"]):
        code, out = run(*args, env={CELLS: str(cells_file)})
        assert code == 2, out
        assert "acts on one store" in out


def test_the_federation_checkpoint_is_accepted_and_a_cell_rolled_back_refused(
    cells_file: Path, clock: Clock
) -> None:
    code, out = run("audit", "checkpoint", "--cells", str(cells_file), "--json")
    assert code == 0, out
    federation = json.loads(out)["checkpoint"]
    assert [entry.split("=")[0] for entry in federation.split(",")] == ["a", "b"]
    code, out = run("audit", "verify", "--cells", str(cells_file), "--checkpoint", federation)
    assert code == 0, out
    assert "cell a: OK" in out
    assert "cell b: OK" in out
    # later events extend the checkpoint
    with CellRouter(parse_cells(cells_file.read_text()), now=clock) as router:
        place(router, "sa2", POOL_A, clock)
    code, out = run("audit", "verify", "--cells", str(cells_file), "--checkpoint", federation)
    assert code == 0, out
    # a checkpoint naming another set of cells is refused
    code, out = run("audit", "verify", "--cells", str(cells_file), "--checkpoint", "a=none")
    assert code == 2, out
    assert "not in the checkpoint: b" in out


def pg_dump() -> str:
    found = shutil.which("pg_dump") or str(Path("/usr/lib/postgresql/15/bin/pg_dump"))
    return found


def dump_into(server: PostgresServer, source: str, target: str) -> None:
    """``pg_dump`` of one database restored with ``psql`` into another (the documented
    copy of a cell, docs/operations.md)."""
    dump = subprocess.run(
        [pg_dump(), "--no-owner", "--dbname", server.conninfo(source)],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(
        ["psql", "--quiet", "--set", "ON_ERROR_STOP=1", "--dbname", server.conninfo(target)],
        input=dump,
        check=True,
        capture_output=True,
    )


def test_a_restored_dump_verifies_against_a_checkpoint_taken_before_it_but_not_an_older_one(
    cells_file: Path,
    postgres_server: PostgresServer,
    databases: list[str],
    tmp_path: Path,
    clock: Clock,
) -> None:
    config = parse_cells(cells_file.read_text())
    a_db = config.cell("a").database_url.rsplit("/", 1)[1]
    early = _database(postgres_server, databases)
    dump_into(postgres_server, a_db, early)  # a dump older than the checkpoint below
    with CellRouter(config, now=clock) as router:
        place(router, "sa2", POOL_A, clock)
    code, out = run("audit", "checkpoint", "--cells", str(cells_file))
    assert code == 0, out
    federation = out.strip()
    with CellRouter(config, now=clock) as router:
        place(router, "sa3", POOL_A, clock)
    restored = _database(postgres_server, databases)
    dump_into(postgres_server, a_db, restored)  # the dump taken after the checkpoint

    def cells_with_a(dbname: str) -> Path:
        path = tmp_path / f"cells-{dbname}.toml"
        path.write_text(
            cells_text({"a": _url(postgres_server, dbname), "b": config.cell("b").database_url})
        )
        return path

    code, out = run(
        "audit", "verify", "--cells", str(cells_with_a(restored)), "--checkpoint", federation
    )
    assert code == 0, out
    code, out = run(
        "audit", "verify", "--cells", str(cells_with_a(early)), "--checkpoint", federation
    )
    assert code == 1, out
    assert "violation cell a" in out
    assert "chain-truncated" in out
    assert "cell b: OK" in out
