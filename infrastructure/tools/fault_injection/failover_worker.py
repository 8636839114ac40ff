"""One worker process of ``verify --profile failover``: a cell router of its own over the
two cells, placing, releasing and advancing its sandboxes in both.

Started as ``python -m secondbox_scheduler.infrastructure.tools.fault_injection.failover_worker``
with its settings as one JSON line on standard input (they hold the cells' URLs) by
:mod:`.failover_run`. Every command goes through a
:class:`~secondbox_scheduler.infrastructure.cells.router.CellRouter` (the worker warms its
cache with the cells its sandboxes were created in, as a replica that knows them would).
It journals each schedule before sending it (``intent``) and each answer after (``ack``
with the cell and the time, or ``refused``), flushed to the OS, so that a SIGKILL loses
nothing acknowledged; restarted, it first retries the requests that were in flight (a
retried schedule replays). A cell that fails (``CellUnavailableError``, or the store's
own fault) is journaled as ``fault`` and left alone for a moment (as a client honours
``Retry-After``); each cell has a thread of its own, so the other cell's load goes on
meanwhile. A request in flight is retried once its cell answers again. Any other
exception is journaled as ``unexpected`` (a violation).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import psycopg
from eventsourcing.persistence import InterfaceError, OperationalError

from secondbox_scheduler.domain.cell_claims import KIND_RUNNER, KIND_SANDBOX
from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.values import ScheduleRequest
from secondbox_scheduler.infrastructure.cells.config import Cell, CellsConfig
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.gc_tuning import tune_gc
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import (
    HEARTBEAT_TIMEOUT,
    requirements,
)

PROOF = {"verified-by": "secondbox-verify-failover"}
CELL_FAULTS = (
    CellUnavailableError, StoreUnavailableError, OperationalError, InterfaceError,
    psycopg.OperationalError, psycopg.InterfaceError,
)  # fmt: skip
BACK_OFF_SECONDS = 0.5  # a failed cell is left alone this long (its Retry-After)


def router_of(config: dict[str, Any]) -> CellRouter:
    """The worker's router over the run's cells (a cells file's content, as objects)."""
    cells = CellsConfig(
        tuple(
            Cell(
                name=cell["name"],
                database_url=cell["database_url"],
                pools=frozenset([cell["pool"]]),
            )
            for cell in config["cells"]
        )
    )
    env = {
        "SECONDBOX_READ_MODELS": "off", "SECONDBOX_BATCHING": "off",
        "POSTGRES_CONNECT_TIMEOUT": "2", "SECONDBOX_RECONNECT_SECONDS": "2",
    }  # fmt: skip
    router = CellRouter(cells, env=env)
    for cell in config["cells"]:
        for sandbox_id in cell["sandboxes"]:
            router.remember(KIND_SANDBOX, sandbox_id, cell["name"])
        for runner_id in cell["runners"]:
            router.remember(KIND_RUNNER, runner_id, cell["name"])
    return router


class FailoverWorker:
    """The worker's load: a thread per cell (a stalled cell holds no other cell's
    requests, as in a service over cells), all through the worker's one router."""

    def __init__(self, config: dict[str, Any], journal: TextIO, previous: list[dict[str, Any]]):
        self.config = config
        self.journal = journal
        self.lock = threading.Lock()
        self.rngs = {
            c["name"]: random.Random(f"{config['seed']}-{config['index']}-{c['name']}-"
                                     f"{len(previous)}")
            for c in config["cells"]
        }  # fmt: skip
        self.router = router_of(config)
        self.cells: dict[str, list[str]] = {c["name"]: c["sandboxes"] for c in config["cells"]}
        self.pool_of = {c["name"]: c["pool"] for c in config["cells"]}
        self.cell_of = {s: name for name, sandboxes in self.cells.items() for s in sandboxes}
        # the schedules sent without an answer, by cell: retried first (their serial answer)
        self.pending: dict[str, list[dict[str, Any]]] = {name: [] for name in self.cells}
        for record in in_flight(previous):
            self.pending[record["cell"]].append(record)

    def write(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.journal.write(json.dumps(record, sort_keys=True) + "\n")
            self.journal.flush()

    def request(self, sandbox_id: str, assignment_id: str, token: str) -> ScheduleRequest:
        now = self.router.now()
        return ScheduleRequest(
            assignment_id=assignment_id, assignment_command_id=f"cmd-{assignment_id}",
            instance_id=f"inst-{sandbox_id}", sandbox_id=sandbox_id,
            workspace_id=f"ws-{sandbox_id}", start_mutation_id=f"start-{assignment_id}",
            profile_revision_id="verify-profile",
            requirements=requirements(self.pool_of[self.cell_of[sandbox_id]]),
            fencing_token=bytes.fromhex(token), claim_expires_at=now + timedelta(minutes=5),
            operation_deadline=now + timedelta(minutes=5), retry_limit=2,
            serialization_retry_limit=12, heartbeat_timeout=HEARTBEAT_TIMEOUT,
            now=now, effect_started_at=now, plan_ready_at=now,
        )  # fmt: skip

    def schedule(self, sandbox_id: str, assignment_id: str, token: str, retried: bool) -> None:
        cell = self.cell_of[sandbox_id]
        if not retried:
            intent = {"kind": "intent", "request": assignment_id, "sandbox": sandbox_id,
                      "token": token, "cell": cell, "at": time.time()}  # fmt: skip
            self.write(intent)
        try:
            assignment, created = self.router.schedule(
                self.request(sandbox_id, assignment_id, token)
            )
        except CELL_FAULTS:
            if not retried:  # interrupted: its answer is asked again, first
                self.pending[cell].append(intent)
            raise
        except SchedulerError as error:
            self.write({"kind": "refused", "error": type(error).__name__,
                        "request": assignment_id, "cell": cell, "at": time.time()})  # fmt: skip
            return
        self.write({
            "kind": "ack", "op": "schedule", "request": assignment_id, "sandbox": sandbox_id,
            "generation": assignment.generation, "assignment": assignment.id,
            "token": assignment.fencing_token.hex(), "created": created, "retried": retried,
            "cell": cell, "at": time.time(),
        })  # fmt: skip

    def step(self, cell: str) -> None:
        mine = self.pending[cell]
        if mine:  # interrupted requests first: each gets its serial answer
            request = mine[0]
            self.schedule(request["sandbox"], request["request"], request["token"], retried=True)
            mine.remove(request)
            return
        rng = self.rngs[cell]
        sandbox_id = rng.choice(self.cells[cell])
        current = self.router.get_assignment(sandbox_id)
        now = time.time()
        if current is None:
            assignment_id = f"{sandbox_id}-{rng.getrandbits(64):016x}"
            self.schedule(sandbox_id, assignment_id, rng.randbytes(32).hex(), retried=False)
        elif current.state == "released":
            generation = self.router.advance_generation(sandbox_id, current.generation)
            self.write({"kind": "ack", "op": "advance", "sandbox": sandbox_id,
                        "generation": generation, "cell": cell, "at": now})  # fmt: skip
        elif current.state == "assigned" and rng.random() < 0.3:
            self.router.mark_running(sandbox_id, current.generation, current.fencing_token)
            self.write({"kind": "ack", "op": "running", "sandbox": sandbox_id, "cell": cell,
                        "at": now})  # fmt: skip
        else:
            self.router.release(sandbox_id, current.generation, current.fencing_token, PROOF)
            self.write({"kind": "ack", "op": "release", "sandbox": sandbox_id,
                        "generation": current.generation, "cell": cell, "at": now})  # fmt: skip

    def run(self, deadline: float) -> None:
        threads = [
            threading.Thread(target=self.run_cell, args=(cell, deadline), name=f"cell-{cell}")
            for cell in self.cells
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def run_cell(self, cell: str, deadline: float) -> None:
        while time.time() < deadline:
            try:
                self.step(cell)
            except CELL_FAULTS as error:
                self.write({"kind": "fault", "cell": cell, "at": time.time(),
                            "error": f"{type(error).__name__}: {error}"[:300]})  # fmt: skip
                time.sleep(BACK_OFF_SECONDS)  # as a client honours Retry-After
            except SchedulerError as error:  # a typed refusal (a rival's release, ...)
                self.write({"kind": "refused", "error": type(error).__name__, "cell": cell,
                            "at": time.time()})  # fmt: skip
            except Exception as error:  # a bug
                self.write({"kind": "unexpected", "cell": cell, "at": time.time(),
                            "error": f"{type(error).__name__}: {error}"[:300],
                            "traceback": traceback.format_exc()[-2000:]})  # fmt: skip
                time.sleep(0.2)


def read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def in_flight(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The journaled schedule intents without an answer (ack or refusal), in order."""
    pending: dict[str, dict[str, Any]] = {}
    for record in records:
        if record["kind"] == "intent":
            pending[record["request"]] = record
        elif record["kind"] in ("ack", "refused") and "request" in record:
            pending.pop(record["request"], None)
    return list(pending.values())


def main() -> None:
    tune_gc()
    config = json.loads(sys.stdin.readline())  # not argv: it holds the cells' URLs
    path = Path(config["journal"])
    previous = read_journal(path)
    with path.open("a") as journal:
        worker = FailoverWorker(config, journal, previous)
        worker.write({"kind": "start", "at": time.time()})
        try:
            worker.run(config["deadline"])
        finally:
            worker.router.close()


if __name__ == "__main__":
    main()
