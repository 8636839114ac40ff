"""``verify --restart-postgres`` restarts only the cluster ``--database-url`` names,
proved to be one of this machine that pg_ctl controls; otherwise it refuses (exit 2)
before running (found by a red team: it restarted ``pg_ctlcluster <newest> main``
whatever the URL named, and reported success)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.tools.fault_injection.restart import (
    RestartRefused,
    ServerFacts,
    is_local_host,
    proof_problem,
    prove_local_cluster,
)
from tests.postgres_server import PostgresServer, ThrowawayCluster

FACTS = ServerFacts("/srv/pg/data", 5433, backend_pid=4242, major_version=15)
PID_FILE = "1000\n/srv/pg/data\n1700000000\n5433\n/tmp\n127.0.0.1\n  5433001  0\nready\n"


def test_the_proof_needs_the_same_directory_port_and_postmaster() -> None:
    assert proof_problem(FACTS, PID_FILE, backend_parent=1000) == ""
    assert "not on this machine" in proof_problem(FACTS, None, 1000)
    assert "not a running server's" in proof_problem(FACTS, "garbage", 1000)
    other_port = PID_FILE.replace("\n5433\n", "\n5432\n", 1)
    assert "on port 5432, not the server's" in proof_problem(FACTS, other_port, 1000)
    other_directory = PID_FILE.replace("/srv/pg/data", "/srv/other", 1)
    assert "names /srv/other" in proof_problem(FACTS, other_directory, 1000)
    # same paths, but the connection is served by another server's process (a container)
    assert "not a child of the postmaster 1000" in proof_problem(FACTS, PID_FILE, 77)
    assert "not visible here" in proof_problem(FACTS, PID_FILE, None)


def test_only_loopback_hosts_and_socket_directories_are_this_machine() -> None:
    assert is_local_host("127.0.0.1")
    assert is_local_host("::1")
    assert is_local_host("/var/run/postgresql")
    assert not is_local_host("192.0.2.1")  # TEST-NET: another machine
    assert not is_local_host("no-such-host.invalid")


@pytest.fixture
def unprivileged(postgres_server: PostgresServer) -> Iterator[str]:
    role = f"sbx_verify_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN CREATEDB')
    try:
        yield f"postgresql://{role}@{postgres_server.host}:{postgres_server.port}/postgres"
    finally:
        with psycopg.connect(postgres_server.conninfo(), autocommit=True) as admin:
            admin.execute(f'DROP ROLE "{role}"')


def _verify_databases(server: PostgresServer) -> set[str]:
    with psycopg.connect(server.conninfo(), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'secondbox_verify_%'"
        ).fetchall()
    return {str(row[0]) for row in rows}


@pytest.mark.postgres
@pytest.mark.parametrize("where", ["another machine", "a role that cannot see the data"])
def test_verify_refuses_a_restart_it_cannot_prove_before_running(
    postgres_server: PostgresServer, unprivileged: str, where: str
) -> None:
    url = (
        "postgresql://postgres@192.0.2.1:5432/postgres"
        if where == "another machine"
        else unprivileged
    )
    before = _verify_databases(postgres_server)
    run = CliRunner().invoke(
        cli, ["verify", "--restart-postgres", "--duration", "1", "--database-url", url]
    )
    assert run.exit_code == 2, run.output
    assert "--restart-postgres refused" in run.output
    expected = "is not this machine" if where == "another machine" else "data_directory"
    assert expected in run.output
    assert _verify_databases(postgres_server) == before  # nothing ran


@pytest.mark.postgres
def test_a_cluster_of_this_machine_is_proved_and_restarted(tmp_path: Path) -> None:
    cluster = ThrowawayCluster()
    try:
        server = cluster.server
        url = f"postgresql://{server.user}@{server.host}:{server.port}/{server.dbname}"

        def started() -> object:
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
            assert row is not None
            return row[0]

        proved = prove_local_cluster(url)
        assert proved.data_directory.resolve() == cluster.data.resolve()
        assert proved.port == server.port
        first = started()
        assert proved.restart(tmp_path / "restart.log")
        assert started() != first  # restarted: a new postmaster
        # the same server reached through another database is still the same cluster
        assert prove_local_cluster(url.rsplit("/", 1)[0] + "/template1") == proved
    finally:
        cluster.stop()
    with pytest.raises(RestartRefused, match="cannot ask the server"):
        prove_local_cluster(url)  # stopped: nothing to prove


@pytest.mark.postgres
def test_the_backends_parent_is_read_while_its_connection_is_open(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the connection closes its backend exits, and its parent can no longer be seen:
    read after the close, the proof failed whenever the backend exited first."""
    from secondbox_scheduler.infrastructure.tools.fault_injection import restart

    open_connections: list[psycopg.Connection[Any]] = []
    real_connect = psycopg.connect

    def connect(*args: Any, **kwargs: Any) -> psycopg.Connection[Any]:
        conn = real_connect(*args, **kwargs)
        open_connections.append(conn)
        return conn

    seen_open: list[bool] = []
    real_parent = restart.parent_pid

    def parent_pid(pid: int) -> int | None:
        seen_open.append(any(not conn.closed for conn in open_connections))
        return real_parent(pid)

    monkeypatch.setattr(psycopg, "connect", connect)
    monkeypatch.setattr(restart, "parent_pid", parent_pid)
    restart.server_facts(postgres_server.conninfo())
    assert seen_open == [True]
