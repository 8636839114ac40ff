"""No command prints a database password: not in headers, JSON, logs, reports or errors.

Every command runs as a real process with a password in its PostgreSQL URL (the test
server trusts local connections, so any password works), and all it writes to stdout
and stderr is searched for it.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

PASSWORD = "s3cretPW"
CLI = "secondbox_scheduler.infrastructure.cli"


def run(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "SECONDBOX_LOG_LEVEL": "DEBUG"},
    )


@pytest.mark.postgres
def test_no_command_prints_the_password_of_its_database_url(postgres_schema: Any) -> None:
    server = postgres_schema.server
    url = (
        f"postgresql://{server.user}:{PASSWORD}@{server.host}:{server.port}/{server.dbname}"
        f"?schema={postgres_schema.name}"
    )
    bare = f"postgresql://{server.user}:{PASSWORD}@{server.host}:{server.port}/{server.dbname}"
    db = ["--database-url", url]
    first = [
        run("simulate", *db, "--runners", "6", "--sandboxes", "8", "--cycles", "1"),
        run("simulate", *db, "--runners", "6", "--sandboxes", "8", "--cycles", "1", "--json"),
    ]
    outputs = [process.communicate(timeout=300) for process in first]
    later = [
        run("runners", *db),
        run("runners", *db, "--json"),
        run("assignments", *db, "--sandbox", "sbx-0001"),
        run("assignments", *db, "--sandbox", "no-such-sandbox"),
        run("projections", "status", *db, "--json"),
        run("projections", "rebuild", *db),
        run("reconcile", "--once", *db, "--json"),
        run("release", *db, "--sandbox", "sbx-0001", "--generation", "1", "--token", "00" * 32,
            "--proof", "stopped=yes"),
        run("audit", "verify", *db),
        run("audit", "verify", *db, "--json"),
        run("audit", "state", *db, "--at", "10", "--json"),
        run("audit", "timeline", *db, "--sandbox", "sbx-0001"),
        run("audit", "explain", *db, "--sandbox", "sbx-0001", "--json"),
        run("audit", "explain", *db, "--sandbox", "no-such-sandbox"),
        run("runners", "--database-url", url.replace(f"/{server.dbname}?", "/no_such_db?")),
        run("runners", "--database-url", f"mysql://root:{PASSWORD}@127.0.0.1/x"),
        run("verify", "--database-url", bare, "--workers", "1", "--duration", "1",
            "--runners", "2", "--sandboxes", "2", "--json"),
        run("bench", "--quick", "--only", "history", "--database-url", url, "--json"),
    ]  # fmt: skip
    outputs += [process.communicate(timeout=300) for process in later]
    for process, (out, err) in zip([*first, *later], outputs, strict=True):
        assert out or err, process.args
        assert PASSWORD not in out, (process.args, out)
        assert PASSWORD not in err, (process.args, err)
    assert any("***" in out + err for out, err in outputs)  # URLs are shown, masked
