"""A CI-sized run of `secondbox-scheduler verify`: concurrent replicas with kills, on PostgreSQL,
under the adversarial profile (tight runners, misbehaving clients, guard and audit probes);
and the probes themselves, on one store, deterministically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from secondbox_scheduler.domain import Capacity
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import fold
from secondbox_scheduler.infrastructure.tools.fault_injection import (
    FaultRunConfig,
    run_fault_injection,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.probes import (
    audit_probes,
    guard_probes,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.run import (
    LOG_DIR_PREFIX,
    log_directory,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.worker import Worker
from tests.conftest import Clock
from tests.factories import CAPABILITIES, capacity, create_sandbox, register, schedule_request

DIMENSIONS = Capacity.DIMENSIONS


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
        profile="adversarial",
    )
    report = run_fault_injection(config)
    assert report.violations == []
    assert report.faults == 0, report.to_dict()  # a healthy system: no exception at all
    assert report.kills == 3
    outcomes = {attempt["outcome"] for attempt in report.insider}
    assert outcomes <= {"refused", "reported", "missed"}
    assert "refused" in outcomes
    assert report.probes["actor: heartbeat exactly at the boundary, placed"] == 1
    assert report.probes["ranking: each home is the first by the spec's ranking"] >= 60
    assert sum(report.misbehaviours.values()) > 0
    assert any(name.startswith("reserve past free") for name in report.probes)
    for dim in DIMENSIONS:  # the first three runners check every dimension
        assert report.probes[f"audit: reservation past allocatable {dim}"] == 3
    assert report.acknowledged_schedules > 0
    assert report.operations["release"] > 0
    assert report.events > 0
    assert max(report.batch_sizes) > 1  # batching on (the default): groups committed together
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


@pytest.mark.slow
def test_a_run_with_batching_off_keeps_every_promise(postgres_server: Any) -> None:
    config = FaultRunConfig(
        database_url=postgres_server.url(),
        workers=2,
        duration=6.0,
        runners=3,
        sandboxes=30,
        kill_workers=1,
        batching=False,
    )
    report = run_fault_injection(config)
    assert report.ok, report.violations
    assert report.faults == 0, report.to_dict()
    assert report.acknowledged_schedules > 0
    assert set(report.batch_sizes) == {1}  # one placement per transaction
    assert report.to_dict()["batching"] == "off"


# Started in each worker process (a sitecustomize module on PYTHONPATH, so that nothing
# in the package exists only for tests): every other mark_running raises a KeyError, a
# bug, not a refusal; with SECONDBOX_TEST_WORKER_EXIT set, a worker exits 3 when done.
PLANTED_BUG = """
import atexit, itertools, os
from secondbox_scheduler.infrastructure.application import SchedulerApplication

_calls = itertools.count()
_mark_running = SchedulerApplication.mark_running

def mark_running(self, *args, **kwargs):
    if next(_calls) % 2 == 0:
        raise KeyError("planted in mark_running")
    return _mark_running(self, *args, **kwargs)

if os.environ.get("SECONDBOX_TEST_PLANT_KEYERROR"):
    SchedulerApplication.mark_running = mark_running
if os.environ.get("SECONDBOX_TEST_WORKER_EXIT"):
    atexit.register(os._exit, 3)
"""


def plant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PLANTED_BUG)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv(variable, "1")


def small_run(postgres_server: Any, tmp_path: Path) -> FaultRunConfig:
    return FaultRunConfig(
        database_url=postgres_server.url(), workers=2, duration=8.0, runners=3,
        sandboxes=30, kill_workers=0, log_dir=tmp_path / "logs",
    )  # fmt: skip


@pytest.mark.slow
def test_an_unexpected_exception_in_a_worker_is_a_violation(
    postgres_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant(tmp_path, monkeypatch, "SECONDBOX_TEST_PLANT_KEYERROR")
    report = run_fault_injection(small_run(postgres_server, tmp_path))
    assert not report.ok, report.to_dict()
    assert any("KeyError" in violation for violation in report.violations), report.violations
    assert report.faults == 0, report.to_dict()  # a bug is not a fault of the environment
    assert report.to_dict()["ok"] is False


@pytest.mark.slow
def test_a_worker_exiting_non_zero_is_a_violation(
    postgres_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant(tmp_path, monkeypatch, "SECONDBOX_TEST_WORKER_EXIT")
    report = run_fault_injection(small_run(postgres_server, tmp_path))
    assert not report.ok, report.to_dict()
    assert any("exit code 3" in violation for violation in report.violations), report.violations


def test_every_unanswered_intent_of_a_killed_worker_is_retried(tmp_path: Path) -> None:
    def intent(request: str) -> dict[str, Any]:
        return {"kind": "intent", "request": request, "sandbox": f"s-{request}", "token": "00"}

    journal = [
        intent("a"), intent("b"), intent("c"), intent("d"),
        {"kind": "ack", "op": "schedule", "request": "b"},
        {"kind": "refused", "error": "HomeRunnerUnavailableError", "request": "d"},
        {"kind": "ack", "op": "release", "sandbox": "s-a"},
    ]  # fmt: skip
    worker = Worker.__new__(Worker)  # no application: only the journal is read
    worker.previous = journal
    assert [record["request"] for record in worker.in_flight()] == ["a", "c"]


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


def test_an_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="profile"):
        run_fault_injection(FaultRunConfig(database_url="postgresql://x/y", profile="chaos"))


def test_guard_probes_hold_on_a_live_runner(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock(), allocatable=capacity(instances=2))
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s1", clock()))
    register(app, "r2", at=clock(), capabilities=(*CAPABILITIES, "physical-storage-admission"))
    probes = guard_probes(app, "r1", clock())
    assert [probe for probe in probes if not probe.ok] == []
    names = {probe.name for probe in probes}
    assert {f"reserve past free {dim}" for dim in DIMENSIONS} <= names
    assert {f"allocatable below reserved {dim}" for dim in DIMENSIONS} <= names
    assert {"deregister while reserved", "release without proof"} <= names
    unchecked = {probe.name for probe in guard_probes(app, "r2", clock())}
    assert "reserve past free disk_bytes" not in unchecked
    assert "reserve past free operations" in unchecked
    app.start_drain("r1")
    draining = guard_probes(app, "r1", clock())
    assert all(probe.ok for probe in draining)
    assert {f"reserve while draining ({dim})" for dim in DIMENSIONS} <= {p.name for p in draining}
    assert app.get_runner("r1").reserved.instances == 1, "probes never save"


def test_audit_probes_are_each_reported_with_their_rule(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock(), allocatable=capacity(instances=2))
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s1", clock()))
    head = app.head_position()
    audit = fold(app)
    versions = {"r1": max(e.originator_version for e in app.events.get(audit.runner_streams["r1"]))}
    probes = audit_probes(audit, versions, clock())
    assert [probe for probe in probes if not probe.ok] == []
    assert {f"audit: reservation past allocatable {dim}" for dim in DIMENSIONS} <= {
        probe.name for probe in probes
    }
    assert audit.violations == []
    assert audit.runner_snapshots()[0].drain_phase == "active", "the forged drain stays a copy"
    assert app.head_position() == head
