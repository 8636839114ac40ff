"""``secondbox-scheduler verify``: concurrent replicas with faults, then every promise checked.

The supervisor creates a fresh PostgreSQL database, registers a fleet with hot spots
(most sandboxes homed on two runners), starts N worker processes
(:mod:`infrastructure.verify_worker`) that schedule, release, drain, heartbeat and
reconcile concurrently until the deadline, SIGKILLs random workers at random moments
and restarts them, optionally restarts PostgreSQL mid-run, and then checks:

- ``audit verify`` over the whole log finds nothing (which includes: no runner over its
  allocatable at any position);
- every acknowledged schedule is in the store with the same assignment (id, token);
- every request a kill interrupted, retried by the restarted worker, got the same
  assignment back;
- the read models caught up from the log equal a rebuild from zero.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from secondbox_scheduler.domain.values import Capacity
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit_replay import verify as audit_verify
from secondbox_scheduler.infrastructure.verify_worker import HEARTBEAT_TIMEOUT, requirements
from secondbox_scheduler.projections.read_models import rebuild

CAPABILITIES = ["compute", "network-policy", "storage", "cleanup", "local-workspace",
                "client-selected-image"]  # fmt: skip


WORKER_MODULE = "secondbox_scheduler.infrastructure.verify_worker"


@dataclass
class VerifyConfig:
    database_url: str
    workers: int = 4
    duration: float = 30.0
    runners: int = 6
    sandboxes: int = 120
    kill_workers: int = 0
    restart_postgres: bool = False
    seed: int = 7
    keep: bool = False
    directory: Path = field(default_factory=lambda: Path("verify-run"))


@dataclass
class VerifyReport:
    database: str
    operations: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    faults: int = 0
    kills: int = 0
    restarts_of_postgres: int = 0
    contention_retries: int = 0
    contention_errors: int = 0
    acknowledged_schedules: int = 0
    retried_in_flight: int = 0
    events: int = 0
    audit_events_per_second: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "database": self.database,
            "operations": dict(sorted(self.operations.items())),
            "refusals": dict(sorted(self.refusals.items())),
            "faults": self.faults,
            "kills": self.kills,
            "postgres_restarts": self.restarts_of_postgres,
            "contention_retries": self.contention_retries,
            "contention_errors": self.contention_errors,
            "acknowledged_schedules": self.acknowledged_schedules,
            "retried_in_flight": self.retried_in_flight,
            "events": self.events,
            "audit_events_per_second": round(self.audit_events_per_second, 1),
            "violations": self.violations,
        }


def fresh_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("verify needs a postgresql:// URL (replicas coordinate through it)")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}", query=""))


def drop_database(url: str, name: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def restart_postgres() -> bool:
    """Restart the local cluster with pg_ctlcluster; False where this machine can't."""
    if not shutil.which("pg_ctlcluster"):
        return False
    versions = sorted(Path("/etc/postgresql").glob("*"))
    if not versions:
        return False
    result = subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1].name, "main", "restart"],
        capture_output=True,
    )
    return result.returncode == 0


def setup_fleet(app: SchedulerApplication, config: VerifyConfig) -> tuple[list[str], list[str]]:
    runners = [f"runner-{i:02d}" for i in range(config.runners)]
    for index, runner_id in enumerate(runners):
        hot = index < 2  # the hot spots: most free instances, so ranked first
        app.register_runner(
            runner_id=runner_id, pool_name="verify", backend_kind="firecracker",
            architecture="x86_64", capabilities=CAPABILITIES,
            allocatable=Capacity(vcpu_count=10**6, memory_bytes=10**6, disk_bytes=10**6,
                                 instances=40 if hot else 8, operations=10**6),
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )  # fmt: skip
        app.record_heartbeat(runner_id=runner_id, at=app.now())
    sandboxes = [f"sbx-{i:04d}" for i in range(config.sandboxes)]
    for sandbox_id in sandboxes:
        app.create_sandbox(
            sandbox_id=sandbox_id, workspace_id=f"ws-{sandbox_id}",
            profile_revision_id="verify-profile", requirements=requirements("verify"),
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )  # fmt: skip
    return runners, sandboxes


def run_verify(config: VerifyConfig, say: Callable[[str], None] = lambda _: None) -> VerifyReport:
    name = f"secondbox_verify_{int(time.time())}"
    url = fresh_database(config.database_url, name)
    report = VerifyReport(database=name)
    directory = config.directory
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob("worker-*.jsonl"), *directory.glob("worker-*.log")]:
        old.unlink()
    try:
        setup = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
        runners, sandboxes = setup_fleet(setup, config)
        setup.close()
        say(f"fleet of {len(runners)} runners, {len(sandboxes)} sandboxes in database {name}")
        deadline = time.time() + config.duration
        rng = random.Random(config.seed)
        configs = [
            {
                "index": index, "database_url": url, "seed": config.seed, "deadline": deadline,
                "journal": str(directory / f"worker-{index}.jsonl"), "runners": runners,
                "sandboxes": sandboxes[index :: config.workers],
            }
            for index in range(config.workers)
        ]  # fmt: skip

        def start(worker: dict[str, Any]) -> subprocess.Popen[bytes]:
            log = (directory / f"worker-{worker['index']}.log").open("ab")
            return subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, json.dumps(worker)],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip

        processes = [start(worker) for worker in configs]
        kill_times = sorted(
            time.time() + rng.uniform(0.1, 0.8) * config.duration
            for _ in range(config.kill_workers)
        )
        restart_at = time.time() + 0.5 * config.duration if config.restart_postgres else None
        while time.time() < deadline:
            time.sleep(0.05)
            if kill_times and time.time() >= kill_times[0]:
                kill_times.pop(0)
                victim = rng.randrange(config.workers)
                processes[victim].kill()
                processes[victim].wait()
                report.kills += 1
                say(f"killed worker {victim} (SIGKILL); restarting it")
                processes[victim] = start(configs[victim])
            if restart_at is not None and time.time() >= restart_at:
                restart_at = None
                if restart_postgres():
                    report.restarts_of_postgres += 1
                    say("restarted PostgreSQL")
                else:
                    say("could not restart PostgreSQL on this machine; skipped")
        for process in processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
        say("workers done; checking")
        check(url, configs, report)
    finally:
        if not config.keep:
            drop_database(config.database_url, name)
    return report


def check(url: str, configs: list[dict[str, Any]], report: VerifyReport) -> None:
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": url, "SECONDBOX_READ_MODELS": "external"}
    )
    try:
        audit = audit_verify(app, measure_raw=False)
        report.events = audit.events
        report.audit_events_per_second = audit.events_per_second
        report.violations += [f"audit: {violation}" for violation in audit.violations]
        for worker in configs:
            records = [
                json.loads(line)
                for line in Path(worker["journal"]).read_text().splitlines()
                if line.strip()
            ]
            last_stats: dict[str, int] = {}
            for record in records:
                kind = record["kind"]
                if kind == "ack":
                    report.operations[record["op"]] += 1
                elif kind == "refused":
                    report.refusals[record["error"]] += 1
                elif kind == "fault":
                    report.faults += 1
                elif kind == "start":
                    if last_stats:
                        report.contention_retries += last_stats.get("contention_retries", 0)
                        report.contention_errors += last_stats.get("contention_errors", 0)
                    last_stats = {}
                elif kind == "stats":
                    last_stats = record
                if kind == "ack" and record["op"] == "schedule":
                    report.acknowledged_schedules += 1
                    stored = app.get_assignment(record["sandbox"], record["generation"])
                    if stored is None or (stored.id, stored.fencing_token.hex()) != (
                        record["assignment"],
                        record["token"],
                    ):
                        report.violations.append(f"acknowledged schedule lost or changed: {record}")
                    if record["retried"]:
                        report.retried_in_flight += 1
                        if record["assignment"] != record["request"]:
                            report.violations.append(
                                f"retried request got another assignment: {record}"
                            )
            report.contention_retries += last_stats.get("contention_retries", 0)
            report.contention_errors += last_stats.get("contention_errors", 0)
        read_models = app.read_models
        assert read_models is not None
        read_models.catch_up()
        live = [view.rows() for view in read_models.views.values()]  # type: ignore[attr-defined]
        rebuild(read_models)
        rebuilt = [view.rows() for view in read_models.views.values()]  # type: ignore[attr-defined]
        if live != rebuilt:
            report.violations.append("read models caught up from the log differ from a rebuild")
    finally:
        app.close()


__all__ = ["VerifyConfig", "VerifyReport", "run_verify"]
