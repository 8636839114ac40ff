"""The fault-injection run behind ``secondbox-scheduler verify``: replicas killed mid-way.

:func:`run_fault_injection` creates a fresh PostgreSQL database, registers a fleet with
hot spots (:mod:`.fleet`), starts N worker processes (:mod:`.worker`) that schedule,
release, drain, heartbeat and reconcile concurrently until the deadline, SIGKILLs random
workers at random moments and restarts them, optionally restarts PostgreSQL mid-run (only
the cluster of this machine that the URL names, proved before anything runs:
:mod:`.restart`), and then runs the final checks (:mod:`.checks`). The workers' journals
and logs go to the configured ``log_dir`` or to a new temporary directory, named in the
report.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.fault_injection.actors import run_actors
from secondbox_scheduler.infrastructure.tools.fault_injection.checks import check, count_probe
from secondbox_scheduler.infrastructure.tools.fault_injection.config import (
    PROFILES,
    FaultRunConfig,
    FaultRunReport,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.database import (
    drop_database,
    fault_run_database,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import setup_fleet
from secondbox_scheduler.infrastructure.tools.fault_injection.insider import MISSED, insider_phase
from secondbox_scheduler.infrastructure.tools.fault_injection.restart import prove_local_cluster

WORKER_MODULE = "secondbox_scheduler.infrastructure.tools.fault_injection.worker"
LOG_DIR_PREFIX = "secondbox-fault-run-"


def log_directory(config: FaultRunConfig) -> Path:
    """Where this run's journals and logs go: ``config.log_dir`` (created, and emptied of
    an earlier run's worker files, which a restarted worker would otherwise read as its
    own), or a new temporary directory."""
    if config.log_dir is None:
        return Path(tempfile.mkdtemp(prefix=LOG_DIR_PREFIX))
    directory = config.log_dir.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob("worker-*.jsonl"), *directory.glob("worker-*.log")]:
        old.unlink()
    return directory


def insider(url: str, runners: list[str], report: FaultRunReport) -> None:
    """The insider phase's attempts into the report; each one missed is a violation."""
    try:
        attempts = insider_phase(url, runners)
    except Exception as error:  # the phase itself broke: never a pass
        report.violations.append(f"insider phase failed: {type(error).__name__}: {error}")
        return
    for attempt in attempts:
        report.insider.append(attempt.to_record())
        if attempt.outcome == MISSED:
            report.violations.append(f"insider {attempt.name}: missed: {attempt.detail}")


def run_fault_injection(
    config: FaultRunConfig, say: Callable[[str], None] = lambda _: None
) -> FaultRunReport:
    if config.profile not in PROFILES:
        raise ValueError(f"profile must be one of {list(PROFILES)}, not {config.profile!r}")
    # before anything runs: the server to restart is the URL's, or none (RestartRefused)
    cluster = prove_local_cluster(config.database_url) if config.restart_postgres else None
    name = f"secondbox_verify_{int(time.time())}"
    url = fault_run_database(config.database_url, name)
    directory = log_directory(config)
    report = FaultRunReport(database=name, log_dir=directory, batching=config.batching)
    try:
        setup = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
        runners, sandboxes = setup_fleet(setup, config)
        setup.close()
        batching = "on" if config.batching else "off"
        say(f"fleet of {len(runners)} runners, {len(sandboxes)} sandboxes in database {name} "
            f"(profile {config.profile}, batching {batching})")  # fmt: skip
        say(f"worker journals and logs in {directory}")
        deadline = time.time() + config.duration
        rng = random.Random(config.seed)
        configs = [
            {
                "index": index, "database_url": url, "seed": config.seed, "deadline": deadline,
                "profile": config.profile, "batching": config.batching,
                "journal": str(directory / f"worker-{index}.jsonl"), "runners": runners,
                "sandboxes": sandboxes[index :: config.workers],
            }
            for index in range(config.workers)
        ]  # fmt: skip

        def start(worker: dict[str, Any]) -> subprocess.Popen[bytes]:
            log = (directory / f"worker-{worker['index']}.log").open("ab")
            process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
            assert process.stdin is not None  # the config (and its URL) never on a command line
            process.stdin.write(json.dumps(worker).encode() + b"\n")
            process.stdin.close()
            return process

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
                crashed = processes[victim].poll()  # exited before the kill: not the kill's
                if crashed:
                    report.violations.append(
                        f"worker {victim} exited with exit code {crashed} (see worker-{victim}.log)"
                    )
                processes[victim].kill()
                processes[victim].wait()
                report.kills += 1
                say(f"killed worker {victim} (SIGKILL); restarting it")
                processes[victim] = start(configs[victim])
            if restart_at is not None and time.time() >= restart_at:
                restart_at = None
                assert cluster is not None
                if cluster.restart(directory / "postgres-restart.log"):
                    report.restarts_of_postgres += 1
                    say(f"restarted PostgreSQL ({cluster.data_directory}, port {cluster.port})")
                else:
                    report.violations.append(
                        f"--restart-postgres: pg_ctl failed to restart {cluster.data_directory} "
                        f"(see {directory / 'postgres-restart.log'})"
                    )
        for index, process in enumerate(processes):
            try:
                code = process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                report.violations.append(f"worker {index} did not finish (killed after 120 s)")
                continue
            if code != 0:  # the workers the run killed on purpose were replaced
                report.violations.append(
                    f"worker {index} exited with exit code {code} (see worker-{index}.log)"
                )
        adversarial = config.profile == "adversarial"
        if adversarial:
            say("workers done; the actors")
            for probe in run_actors(url):
                count_probe(probe.to_record(), report)
        say("checking")
        check(url, configs, report, adversarial=adversarial)
        if adversarial:
            say("the insider phase (the application role)")
            insider(url, runners, report)
    finally:
        if not config.keep:
            drop_database(config.database_url, name)
    return report
