"""Each exit code of the command line, through the real console script in its own
process (docs/spec.md (section 8.4), infrastructure/exit_codes.py): 0 ok, 1 a violation
found, 2 a usage error, 3 refused by a rule, 4 the store unavailable, 70 an internal
error; every failure is one line on stderr, never a traceback. (Without the ``[cli]``
extra the script exits 2 too: tests/test_packaging.py, in an install without it.)
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from secondbox_scheduler import __version__
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.exit_codes import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_STORE_UNAVAILABLE,
    EXIT_USAGE,
    EXIT_VIOLATION,
)
from tests.factories import register

SCRIPT = Path(sys.executable).parent / "secondbox-scheduler"
TOKEN = "00" * 32


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite store with one runner."""
    url = f"sqlite:///{tmp_path_factory.mktemp('codes') / 'store.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        register(app, "r1", at=app.now())
    finally:
        app.close()
    return url


def test_0_ok(store: str) -> None:
    version = run("--version")
    assert (version.returncode, version.stdout) == (EXIT_OK, f"secondbox-scheduler {__version__}\n")
    runners = run("runners", "--database-url", store, "--json")
    assert runners.returncode == EXIT_OK, runners.stderr
    assert [r["id"] for r in json.loads(runners.stdout)] == ["r1"]


def test_1_a_violation_found(tmp_path: Path) -> None:
    path = tmp_path / "tampered.db"
    url = f"sqlite:///{path}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        register(app, "r1", at=app.now())
    finally:
        app.close()
    with sqlite3.connect(path) as conn:  # an edited row: a runner that offers more
        (state,) = conn.execute("SELECT state FROM stored_events WHERE rowid = 1").fetchone()
        edited = bytes(state).replace(b'"instances":4', b'"instances":9')
        assert edited != bytes(state)
        conn.execute("UPDATE stored_events SET state = ? WHERE rowid = 1", (edited,))
    conn.close()
    found = run("audit", "verify", "--database-url", url)
    assert found.returncode == EXIT_VIOLATION, (found.stdout, found.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--hots", "0.0.0.0"],  # no such option (the parser's own usage error)
        ["release", "--sandbox", "s1", "--generation", "1", "--token", "zz", "--proof", "a=b"],
        ["runners", "--database-url", "mysql://host/db"],  # the field and the rule named
    ],
    ids=["unknown-option", "bad-value", "bad-url"],
)
def test_2_a_usage_error(store: str, args: list[str]) -> None:
    if "--database-url" not in args:
        args = [*args, "--database-url", store]
    refused = run(*args)
    assert refused.returncode == EXIT_USAGE, refused.stderr
    assert refused.stdout == ""
    assert "Traceback" not in refused.stderr


def test_3_refused_by_a_rule(store: str) -> None:
    refused = run("release", "--sandbox", "nope", "--generation", "1", "--token", TOKEN,
                  "--proof", "stopped=yes", "--database-url", store)  # fmt: skip
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    assert "sandbox 'nope' not found" in one_line(refused)


def test_4_the_store_unavailable(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = run("runners", "--database-url", f"postgresql://postgres@127.0.0.1:{port}/x")
    assert unreachable.returncode == EXIT_STORE_UNAVAILABLE, unreachable.stderr
    assert "store unavailable" in one_line(unreachable)
    missing = run("runners", "--database-url", f"sqlite:///{tmp_path}/missing.db")
    assert missing.returncode == EXIT_STORE_UNAVAILABLE, missing.stderr
    assert "no database at" in one_line(missing)


def test_70_an_internal_error(store: str) -> None:
    """A fault of ours (here a query that raises what no command expects), through the
    console script's own entry point in a process of its own."""
    probe = (
        "import sys\n"
        "from secondbox_scheduler.infrastructure import SchedulerApplication\n"
        "from secondbox_scheduler.infrastructure.command_line import main\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('a bug')\n"
        "SchedulerApplication.runner_snapshots = broken\n"
        f"sys.argv = ['secondbox-scheduler', 'runners', '--database-url', {store!r}]\n"
        "main()\n"
    )
    fault = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert fault.returncode == EXIT_INTERNAL, fault.stderr
    line = one_line(fault)
    assert "unexpected RuntimeError: a bug" in line
    assert "please report it" in line
