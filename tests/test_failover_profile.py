"""``verify --profile failover --promote manual``: the whole run on this machine's
PostgreSQL binaries (no Patroni, no etcd: the Patroni form needs them and runs outside
the suite, docs/verification.md). Each run's clusters go in a directory of the test's
own (``TMPDIR``), which must be empty afterwards, also when the run is interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.postgres
COMMAND = [sys.executable, "-m", "secondbox_scheduler.infrastructure.command_line", "verify",
           "--profile", "failover", "--promote", "manual"]  # fmt: skip


@pytest.fixture
def run_directory() -> Iterator[Path]:
    """Where the run makes its clusters: reachable by the ``postgres`` user (the
    PostgreSQL binaries run as that user under root, and tmp_path is private)."""
    directory = Path(tempfile.mkdtemp(prefix="secondbox-test-failover-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def processes_under(directory: Path) -> list[str]:
    """The command lines of the processes that name ``directory`` (its clusters)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(directory) in text:
            found.append(text)
    return found


def test_the_manual_failover_profile_loses_nothing_with_a_synchronous_standby(
    run_directory: Path,
) -> None:
    result = subprocess.run(
        [*COMMAND, "--duration", "20", "--json"], capture_output=True, text=True,
        timeout=240, check=False, env={**os.environ, "TMPDIR": str(run_directory)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"], report["violations"]
    assert (report["promote"], report["replication"]) == ("manual", "sync")
    assert report["acknowledged"] > 0
    assert report["acknowledged_lost"] == 0
    assert report["oversubscribed"] == 0
    assert report["audit_ok"] is True
    assert report["healthy_cell_placements_during_outage"] > 0
    assert report["outage_seconds"] is not None
    assert report["worker_kills"] == 2
    assert report["audit"]["a"]["checkpoint"]  # taken before the failover, verified
    assert list(run_directory.iterdir()) == []  # clusters and journals removed
    assert processes_under(run_directory) == []


def test_an_interrupted_failover_run_removes_its_clusters(run_directory: Path) -> None:
    process = subprocess.Popen(
        [*COMMAND, "--duration", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(run_directory)},
    )  # fmt: skip
    try:
        # interrupted once both of a cell's servers run (the polling is not a timing
        # assertion: it waits for a state, up to a generous bound)
        deadline = time.monotonic() + 120
        while len([p for p in processes_under(run_directory) if "postgres -D" in p]) < 2:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "no cluster started"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    assert processes_under(run_directory) == []
    # the clusters are gone; the journals of the unfinished run are kept
    left = [path.name for path in run_directory.iterdir()]
    assert all(name.startswith("secondbox-failover-logs-") for name in left), left
