"""An unreachable store fails fast, with a typed error that says what is wrong.

Unknown host, refused connection, missing database, refused role and a server that
never answers each get their own error (``StoreUnavailableError`` with a ``reason``)
within the connect timeout, from the API and, as one line and exit code 4, from the
command line; so do a SQLite path that is not a database and one that cannot be opened.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from secondbox_scheduler.infrastructure import SchedulerApplication, StoreUnavailableError

TIMEOUT_SECONDS = 2
PASSWORD = "s3cret-never-shown"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.fixture
def nologin_role(postgres_schema: Any) -> Iterator[str]:
    name = f"nologin_{uuid.uuid4().hex[:8]}"
    conninfo = postgres_schema.server.conninfo()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" NOLOGIN')
    try:
        yield name
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{name}"')


def url_for(postgres_schema: Any, **parts: Any) -> str:
    server = postgres_schema.server
    fields = {"user": server.user, "host": server.host, "port": server.port,
              "dbname": server.dbname, **parts}  # fmt: skip
    return f"postgresql://{fields['user']}@{fields['host']}:{fields['port']}/{fields['dbname']}"


def cases(postgres_schema: Any, silent: int, role: str) -> dict[str, str]:
    return {
        "unknown-host": url_for(postgres_schema, host="no-such-host.invalid"),
        "connection-refused": url_for(postgres_schema, port=free_port()),
        "database-missing": url_for(postgres_schema, dbname="no_such_database_xyz"),
        # with a password, which no message may show
        "authentication-failed": url_for(postgres_schema, user=f"{role}:{PASSWORD}"),
        "timeout": url_for(postgres_schema, port=silent),
    }


@pytest.mark.postgres
def test_each_connection_failure_has_its_own_typed_error_within_the_timeout(
    postgres_schema: Any, silent_server: int, nologin_role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the timeout, without a clock: each failure is one connection attempt
    (no retry loop), made with the configured connect timeout, and the silent server's
    error is libpq's timeout (which only the connect timeout raises). An elapsed-time
    bound (< timeout + 3 s) said the same, and could fail on a loaded machine."""
    attempts: list[str | None] = []
    connect = psycopg.connect

    def counted(conninfo: str = "", *args: Any, **kwargs: Any) -> Any:
        attempts.append(conninfo_to_dict(conninfo).get("connect_timeout"))  # type: ignore[arg-type]
        return connect(conninfo, *args, **kwargs)

    monkeypatch.setattr(psycopg, "connect", counted)
    messages = set()
    for reason, url in cases(postgres_schema, silent_server, nologin_role).items():
        attempts.clear()
        with pytest.raises(StoreUnavailableError) as raised:
            SchedulerApplication(
                env={
                    "SECONDBOX_DATABASE_URL": url,
                    "POSTGRES_CONNECT_TIMEOUT": str(TIMEOUT_SECONDS),
                }
            )
        assert raised.value.reason == reason, str(raised.value)
        assert attempts == [str(TIMEOUT_SECONDS)], (reason, attempts)  # once, with the timeout
        # (was `"***" not in message or "@" in message`: no URL had a password, and
        # every message has an "@", so it held whatever the message said)
        assert PASSWORD not in str(raised.value), str(raised.value)
        messages.add(str(raised.value))
    assert len(messages) == 5


@pytest.mark.postgres
def test_the_command_line_says_which_failure_in_one_line(
    postgres_schema: Any, silent_server: int, nologin_role: str
) -> None:
    found = {}
    for reason, url in cases(postgres_schema, silent_server, nologin_role).items():
        result = subprocess.run(
            [sys.executable, "-m", "secondbox_scheduler.infrastructure.cli", "runners",
             "--database-url", url],
            capture_output=True, text=True, timeout=60,
            env={"PATH": "/usr/bin:/bin", "POSTGRES_CONNECT_TIMEOUT": str(TIMEOUT_SECONDS)},
        )  # fmt: skip
        assert result.returncode == 4, (reason, result.stderr)  # store unavailable
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (reason, result.stderr)
        found[reason] = lines[0]
    assert len(set(found.values())) == 5


def test_a_sqlite_path_that_is_not_a_database_is_a_typed_error(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("these are my notes, not a database\n" * 100)
    with pytest.raises(StoreUnavailableError) as raised:
        SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{text}"})
    assert raised.value.reason == "not-a-database"
    assert text.read_text().startswith("these are my notes")  # untouched
    with pytest.raises(StoreUnavailableError) as raised:
        SchedulerApplication(
            env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path}/missing/dir/s.db"}
        )
    assert raised.value.reason == "cannot-open"


def test_the_command_line_refuses_a_text_file_as_a_database_in_one_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n" * 100)
    result = subprocess.run(
        [sys.executable, "-m", "secondbox_scheduler.infrastructure.cli", "audit", "verify",
         "--database-url", f"sqlite:///{text}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 4  # store unavailable
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
