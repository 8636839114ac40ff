"""``secondbox-scheduler verify --profile failover``: losing a cell's primary mid-run.

:func:`run_failover` makes two cells on this machine, each a primary and a standby
(synchronous, or asynchronous with ``replication="async"``) from the local PostgreSQL
binaries on free ports (:mod:`.failover_cells`), managed by Patroni over a local etcd
(``promote="patroni"``, :mod:`.patroni`) or promoted by hand (``promote="manual"``:
``pg_ctl promote``). It registers a fleet in each cell's pool through a cell router and
starts worker processes (:mod:`.failover_worker`), each with a router of its own over
both cells, that place, release and advance their sandboxes in both, journaling every
acknowledged answer; random workers are SIGKILLed and restarted. At a third of the run it
partitions the replication link of cell ``a``'s leader for ``LAG_SECONDS`` (a standby
that lags, :mod:`.link`), takes each cell's audit checkpoint (kept here, outside the
cells), then SIGKILLs cell ``a``'s leader (its PostgreSQL and its Patroni) and lets the
standby take over; the routers follow through the multi-host URL. Then it checks:

- no acknowledged placement is lost (each is in its cell's store with the same
  assignment id and token), with synchronous replication; with asynchronous
  replication it counts the lost ones, the checkpoint check must detect a loss, and
  every command must refuse each lost one's fencing token;
- no runner is oversubscribed (each runner's reservations within its allocatable);
- each cell's audit verifies, also against the checkpoint taken before the failover;
- the other cell kept placing during the outage (from the kill to cell ``a``'s first
  acknowledged answer after it).

Everything it started (clusters, etcd, Patroni, workers) is removed at the end, also when
interrupted: a ``finally``, handlers for SIGINT, SIGTERM and SIGHUP that end the run
through it, and an ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import checkpoint, parse_checkpoint, verify
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.tools.fault_injection.clusters import (
    clusters_directory,
    kill_clusters_under,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.failover_cells import (
    FailoverCell,
    ManualCell,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.failover_worker import (
    PROOF,
    read_journal,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import (
    CAPABILITIES,
    HEARTBEAT_TIMEOUT,
    requirements,
)

WORKER_MODULE = "secondbox_scheduler.infrastructure.tools.fault_injection.failover_worker"
PROMOTIONS = ("patroni", "manual")
REPLICATIONS = ("sync", "async")
CELLS = ("a", "b")  # cell "a" loses its leader; "b" is the healthy cell
FAILOVER_AT = 0.35  # of the duration
MANUAL_PROMOTE_DELAY = 2.0  # seconds between the kill and pg_ctl promote (an operator's)
# how long the doomed leader's standby receives nothing before the kill (a slow network:
# asynchronous replication loses what was acknowledged meanwhile; synchronous, nothing)
LAG_SECONDS = 3.0


@dataclass
class FailoverConfig:
    duration: float = 60.0
    workers: int = 4
    kill_workers: int = 2
    promote: str = "patroni"
    replication: str = "sync"
    runners: int = 4  # per cell
    sandboxes: int = 48  # per cell
    seed: int = 7
    log_dir: Path | None = None


@dataclass
class FailoverReport:
    promote: str
    replication: str
    log_dir: Path | None
    acknowledged: int = 0
    acknowledged_lost: int = 0
    lost: list[dict[str, Any]] = field(default_factory=list)
    lost_tokens_refused: int = 0  # lost placements whose token every command refused
    oversubscribed: int = 0
    audit: dict[str, dict[str, Any]] = field(default_factory=dict)
    loss_detected: bool = False
    healthy_cell_placements_during_outage: int = 0
    outage_seconds: float | None = None
    killed: str = ""
    worker_kills: int = 0
    faults: int = 0
    operations: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def audit_ok(self) -> bool:
        return bool(self.audit) and all(cell["ok"] for cell in self.audit.values())

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "profile": "failover", "promote": self.promote,
            "replication": self.replication, "acknowledged": self.acknowledged,
            "acknowledged_lost": self.acknowledged_lost, "oversubscribed": self.oversubscribed,
            "audit_ok": self.audit_ok, "loss_detected": self.loss_detected,
            "lost_tokens_refused": self.lost_tokens_refused,
            "healthy_cell_placements_during_outage": self.healthy_cell_placements_during_outage,
            "outage_seconds": None if self.outage_seconds is None
            else round(self.outage_seconds, 2),
            "failed_cell": CELLS[0], "killed_leader": self.killed,
            "worker_kills": self.worker_kills, "faults": self.faults,
            "operations": dict(sorted(self.operations.items())), "audit": self.audit,
            "lost": self.lost[:10], "violations": self.violations,
            "log_dir": None if self.log_dir is None else str(self.log_dir),
        }  # fmt: skip


class Cleanup:
    """What the run started, removed once: at the end, on a signal, or at exit."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], object]] = []
        self.done = False
        self.previous: dict[int, Any] = {}

    def add(self, step: Callable[[], object]) -> None:
        self.steps.append(step)

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        for step in reversed(self.steps):
            with contextlib.suppress(Exception):
                step()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def interrupted(signum: int, _: FrameType | None) -> None:
            raise SystemExit(128 + signum)  # through the run's finally

        atexit.register(self.run)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self.previous[int(signum)] = signal.signal(signum, interrupted)
        try:
            yield
        finally:
            self.run()
            for number, handler in self.previous.items():
                signal.signal(number, handler)
            atexit.unregister(self.run)


def make_cells(
    config: FailoverConfig, directory: Path, cleanup: Cleanup, say: Callable[[str], None]
) -> list[FailoverCell]:
    synchronous = config.replication == "sync"
    cells: list[FailoverCell] = []
    if config.promote == "patroni":
        from secondbox_scheduler.infrastructure.tools.fault_injection.patroni import (
            Etcd,
            PatroniCell,
        )

        etcd = Etcd(directory / "etcd")
        cleanup.add(etcd.stop)
        say(f"etcd on 127.0.0.1:{etcd.port}")
        for name in CELLS:
            patroni = PatroniCell(name, directory, synchronous, etcd)
            cleanup.add(patroni.remove)
            cells.append(patroni)
    else:
        for name in CELLS:
            manual = ManualCell(name, directory, synchronous)
            cleanup.add(manual.remove)
            cells.append(manual)
    for cell in cells:
        say(f"cell {cell.name}: {cell.url()} (leader {cell.leader().name}, {config.replication})")
    return cells


def cell_app(cell: FailoverCell) -> SchedulerApplication:
    return SchedulerApplication(
        env={
            "SECONDBOX_DATABASE_URL": cell.url(),
            "SECONDBOX_CELL": cell.name,
            "SECONDBOX_READ_MODELS": "off",
            "SECONDBOX_RECONNECT_SECONDS": "30",
        }
    )


def setup_fleet(config: FailoverConfig, cells: list[FailoverCell]) -> list[dict[str, Any]]:
    """Each cell's runners and sandboxes, registered and created in its own pool."""
    from secondbox_scheduler.domain.values import Capacity

    described = []
    for cell in cells:
        app = cell_app(cell)
        try:
            pool = f"pool-{cell.name}"
            runners = [f"{cell.name}-runner-{i:02d}" for i in range(config.runners)]
            for index, runner_id in enumerate(runners):
                app.register_runner(
                    runner_id=runner_id, pool_name=pool, backend_kind="firecracker",
                    architecture="x86_64", capabilities=CAPABILITIES,
                    allocatable=Capacity(vcpu_count=10**6, memory_bytes=10**6, disk_bytes=10**6,
                                         instances=40 if index < 2 else 8, operations=10**6),
                    guest_protocol_minimum=1, guest_protocol_maximum=1,
                )  # fmt: skip
                app.record_heartbeat(runner_id=runner_id, at=app.now())
            sandboxes = [f"{cell.name}-sbx-{i:04d}" for i in range(config.sandboxes)]
            for sandbox_id in sandboxes:
                app.create_sandbox(
                    sandbox_id=sandbox_id, workspace_id=f"ws-{sandbox_id}",
                    profile_revision_id="verify-profile", requirements=requirements(pool),
                    heartbeat_timeout=HEARTBEAT_TIMEOUT,
                )  # fmt: skip
        finally:
            app.close()
        described.append({"name": cell.name, "database_url": cell.url(), "pool": pool,
                          "runners": runners, "sandboxes": sandboxes})  # fmt: skip
    return described


def run_failover(
    config: FailoverConfig, say: Callable[[str], None] = lambda _: None
) -> FailoverReport:
    if config.promote not in PROMOTIONS:
        raise ValueError(f"--promote must be one of {list(PROMOTIONS)}, not {config.promote!r}")
    if config.replication not in REPLICATIONS:
        raise ValueError(
            f"--replication must be one of {list(REPLICATIONS)}, not {config.replication!r}"
        )
    directory = clusters_directory("secondbox-failover-")
    # the journals outlive the clusters when the run fails (or when --log-dir says where)
    logs = config.log_dir or Path(tempfile.mkdtemp(prefix="secondbox-failover-logs-"))
    logs = logs.resolve()
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("worker-*"):
        old.unlink()
    report = FailoverReport(config.promote, config.replication, logs)
    cleanup = Cleanup()
    finished: list[bool] = []

    def drop_logs() -> None:
        if config.log_dir is None and finished and report.ok:
            shutil.rmtree(logs, ignore_errors=True)
            report.log_dir = None

    cleanup.add(drop_logs)
    cleanup.add(lambda: shutil.rmtree(directory, ignore_errors=True))
    cleanup.add(lambda: kill_clusters_under(directory))  # one an interruption left unnamed
    with cleanup.installed():
        cells = make_cells(config, directory, cleanup, say)
        described = setup_fleet(config, cells)
        say(f"fleet: {config.runners} runners, {config.sandboxes} sandboxes per cell; "
            f"worker journals in {logs}")  # fmt: skip
        run_load(config, cells, described, logs, report, cleanup, say)
        say("checking")
        check(cells, described, logs, report)
        finished.append(True)
    return report


def run_load(
    config: FailoverConfig,
    cells: list[FailoverCell],
    described: list[dict[str, Any]],
    logs: Path,
    report: FailoverReport,
    cleanup: Cleanup,
    say: Callable[[str], None],
) -> None:
    rng = random.Random(config.seed)
    started = time.time()
    deadline = started + config.duration
    configs = [
        {
            "index": index, "seed": config.seed, "deadline": deadline,
            "journal": str(logs / f"worker-{index}.jsonl"),
            "cells": [{**cell, "sandboxes": cell["sandboxes"][index :: config.workers]}
                      for cell in described],
        }
        for index in range(config.workers)
    ]  # fmt: skip
    processes: list[subprocess.Popen[bytes]] = []

    def start(worker: dict[str, Any]) -> subprocess.Popen[bytes]:
        log = (logs / f"worker-{worker['index']}.log").open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        assert process.stdin is not None
        process.stdin.write(json.dumps(worker).encode() + b"\n")
        process.stdin.close()
        return process

    def stop_workers() -> None:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    cleanup.add(stop_workers)
    processes.extend(start(worker) for worker in configs)
    kill_times = sorted(
        started + rng.uniform(0.1, 0.9) * config.duration for _ in range(config.kill_workers)
    )
    failover_at: float | None = started + FAILOVER_AT * config.duration
    promotion: threading.Thread | None = None
    promoted: list[bool] = []
    while time.time() < deadline:
        time.sleep(0.05)
        if kill_times and time.time() >= kill_times[0]:
            kill_times.pop(0)
            victim = rng.randrange(config.workers)
            exited = processes[victim].poll()
            if exited:
                report.violations.append(f"worker {victim} exited with {exited} before its kill")
            processes[victim].kill()
            processes[victim].wait()
            report.worker_kills += 1
            say(f"killed worker {victim} (SIGKILL); restarting it")
            processes[victim] = start(configs[victim])
        if failover_at is not None and time.time() >= failover_at:
            failover_at = None
            apps = [cell_app(cell) for cell in cells]  # before the partition: no write then
            try:
                cells[0].lag_leader()
                say(f"partitioned the replication link of cell {cells[0].name}'s leader "
                    f"for {LAG_SECONDS:g} s")  # fmt: skip
                time.sleep(LAG_SECONDS)
                for app, held in zip(apps, described, strict=True):
                    head = checkpoint(app)  # kept here, outside the cells
                    held["checkpoint"] = None if head is None else str(head)
            finally:
                for app in apps:
                    app.close()
            report.killed = cells[0].kill_leader()
            described[0]["killed_at"] = time.time()
            marks = [d["checkpoint"] for d in described]
            what = "its PostgreSQL and Patroni" if config.promote == "patroni" else "PostgreSQL"
            say(f"checkpoints {marks}; killed the leader of cell {cells[0].name} "
                f"({report.killed}: {what}, SIGKILL)")  # fmt: skip

            def replace() -> None:
                if config.promote == "manual":
                    time.sleep(MANUAL_PROMOTE_DELAY)
                promoted.append(cells[0].replace_leader(timeout=120))

            promotion = threading.Thread(target=replace, daemon=True)
            promotion.start()
    for index, process in enumerate(processes):
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            report.violations.append(f"worker {index} did not finish (killed after 120 s)")
            continue
        if code != 0:
            report.violations.append(f"worker {index} exited with {code} (see worker-{index}.log)")
    if promotion is not None:
        promotion.join(timeout=130)
        if promoted != [True]:
            report.violations.append(f"cell {cells[0].name}: no new leader took over")
        else:
            say(f"cell {cells[0].name}: new leader {cells[0].leader().name}")


def journal_records(logs: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in sorted(logs.glob("worker-*.jsonl")):
        records += read_journal(path)
    return records


def refuse_lost_token(
    app: SchedulerApplication, record: dict[str, Any], report: FailoverReport
) -> None:
    """Every command that takes a fencing token refuses the lost assignment's."""
    sandbox, generation = record["sandbox"], record["generation"]
    token = bytes.fromhex(record["token"])
    commands: dict[str, Callable[[], object]] = {
        "mark_running": lambda: app.mark_running(sandbox, generation, token),
        "release": lambda: app.release(sandbox, generation, token, PROOF),
        "fail": lambda: app.fail(sandbox, generation, token, "transient"),
    }
    for name, command in commands.items():
        try:
            command()
        except CellUnavailableError:
            raise
        except SchedulerError:
            continue
        report.violations.append(
            f"{name} took the fencing token of lost assignment {record['assignment']}"
        )
        return
    report.lost_tokens_refused += 1


def check(
    cells: list[FailoverCell], described: list[dict[str, Any]], logs: Path, report: FailoverReport
) -> None:
    records = journal_records(logs)
    failed, healthy = CELLS
    killed_at = described[0].get("killed_at")
    acks = [r for r in records if r["kind"] == "ack"]
    for record in records:
        if record["kind"] == "ack":
            report.operations[record["op"]] = report.operations.get(record["op"], 0) + 1
        elif record["kind"] == "fault":
            report.faults += 1
        elif record["kind"] == "unexpected":
            report.violations.append(f"unexpected exception in a worker: {record['error']}")
    if killed_at is not None:
        after = [r["at"] for r in acks if r["cell"] == failed and r["at"] >= killed_at]
        recovered = min(after) if after else None
        if recovered is None:
            report.violations.append(f"cell {failed} answered nothing after its failover")
            recovered = max((r["at"] for r in records), default=killed_at)
        else:
            report.outage_seconds = recovered - killed_at
        report.healthy_cell_placements_during_outage = sum(
            1 for r in acks
            if r["cell"] == healthy and r["op"] == "schedule" and r["created"]
            and killed_at <= r["at"] <= recovered
        )  # fmt: skip
    apps = {cell.name: cell_app(cell) for cell in cells}
    try:
        for record in acks:
            if record["op"] != "schedule":
                continue
            report.acknowledged += 1
            stored = apps[record["cell"]].get_assignment(record["sandbox"], record["generation"])
            if stored is None or (stored.id, stored.fencing_token.hex()) != (
                record["assignment"],
                record["token"],
            ):
                report.acknowledged_lost += 1
                report.lost.append({k: record[k] for k in ("cell", "sandbox", "generation",
                                                           "assignment", "at")})  # fmt: skip
                refuse_lost_token(apps[record["cell"]], record, report)
        for cell, held in zip(cells, described, strict=True):
            app = apps[cell.name]
            for runner in app.fold_runner_snapshots(f"pool-{cell.name}"):
                room, used = runner.allocatable.as_dict(), runner.reserved.as_dict()
                if any(used[dim] > room[dim] for dim in room):
                    report.oversubscribed += 1
                    report.violations.append(f"runner {runner.id} oversubscribed: {used}")
            mark = held.get("checkpoint")
            audit = verify(app, measure_raw=False,
                           checkpoint=parse_checkpoint(mark) if mark else None)  # fmt: skip
            report.audit[cell.name] = {
                "ok": audit.ok, "events": audit.events, "checkpoint": mark,
                "violations": [v.to_dict() for v in audit.violations[:5]],
                "violation_count": len(audit.violations),
            }  # fmt: skip
            if not audit.ok:  # is it only the checkpoint that says so, or the log itself?
                report.audit[cell.name]["log_ok"] = verify(app, measure_raw=False).ok
    finally:
        for app in apps.values():
            app.close()
    failed_rules = {v["rule"] for v in report.audit.get(failed, {}).get("violations", [])}
    report.loss_detected = bool(failed_rules & {"chain-truncated", "chain-rewritten"})
    if not report.audit.get(healthy, {}).get("ok"):
        report.violations.append(f"audit of the healthy cell {healthy}: {report.audit[healthy]}")
    if report.replication == "sync":
        if report.acknowledged_lost:
            report.violations.append(
                f"{report.acknowledged_lost} acknowledged placements lost with synchronous "
                f"replication: {report.lost[:3]}"
            )
        if not report.audit.get(failed, {}).get("ok"):
            report.violations.append(f"audit of cell {failed}: {report.audit[failed]}")
    elif report.acknowledged_lost and not report.loss_detected:
        report.violations.append(
            f"{report.acknowledged_lost} acknowledged placements lost and the checkpoint "
            "check did not detect it"
        )
    elif not report.audit.get(failed, {}).get("ok") and not (
        report.loss_detected and report.audit[failed].get("log_ok")
    ):  # the checkpoint may show the truncation; the promoted log itself must be sound
        report.violations.append(f"audit of cell {failed}: {report.audit[failed]}")
    if killed_at is not None and not report.healthy_cell_placements_during_outage:
        report.violations.append(f"cell {healthy} placed nothing during cell {failed}'s outage")
