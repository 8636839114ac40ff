"""A CI-sized run of `secondbox-scheduler verify`: concurrent replicas with kills, on PostgreSQL."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from secondbox_scheduler.infrastructure.fault_injection import FaultRunConfig, run_fault_injection
from secondbox_scheduler.infrastructure.fault_injection.run import LOG_DIR_PREFIX, log_directory


@pytest.mark.slow
def test_concurrent_replicas_with_kills_keep_every_promise(
    postgres_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no log_dir: the logs go to a new temporary directory (here under tmp_path), and
    # nothing lands in the caller's current directory
    caller = tmp_path / "caller"
    temporary = tmp_path / "tmp"
    caller.mkdir()
    temporary.mkdir()
    monkeypatch.chdir(caller)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    config = FaultRunConfig(
        database_url=postgres_server.url(),
        workers=3,
        duration=12.0,
        runners=4,
        sandboxes=60,
        kill_workers=3,
    )
    report = run_fault_injection(config)
    assert report.ok, report.violations
    assert report.kills == 3
    assert report.acknowledged_schedules > 0
    assert report.operations["release"] > 0
    assert report.events > 0
    assert list(caller.iterdir()) == []
    assert report.log_dir.is_dir()
    assert report.log_dir.parent == temporary
    assert report.log_dir.name.startswith(LOG_DIR_PREFIX)
    assert sorted(path.name for path in report.log_dir.glob("worker-*.jsonl")) == [
        "worker-0.jsonl",
        "worker-1.jsonl",
        "worker-2.jsonl",
    ]
    assert report.to_dict()["log_dir"] == str(report.log_dir)


def test_a_named_log_dir_is_created_and_cleared_of_an_earlier_runs_worker_files(
    tmp_path: Path,
) -> None:
    named = tmp_path / "logs" / "run"
    assert log_directory(FaultRunConfig(database_url="", log_dir=named)) == named
    (named / "worker-0.jsonl").write_text("{}\n")
    (named / "worker-0.log").write_text("earlier\n")
    (named / "notes.txt").write_text("mine\n")
    assert log_directory(FaultRunConfig(database_url="", log_dir=named)) == named
    assert [path.name for path in named.iterdir()] == ["notes.txt"]
