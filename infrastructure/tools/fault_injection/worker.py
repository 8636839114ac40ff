"""One worker process of the fault-injection run, ``secondbox-scheduler verify``.

Started as ``python -m secondbox_scheduler.infrastructure.tools.fault_injection.worker CONFIG``
(CONFIG: the worker's settings as JSON) by :mod:`.run`.

It owns a partition of the sandboxes (so its retried requests have one right answer)
and shares every runner with the other workers (the hot spots). It journals each
request before sending it (``intent``) and each answer after (``ack``, or ``refused``
naming the request), flushed to the OS, so a SIGKILL loses nothing acknowledged; on
restart it first retries every request that was in flight and records whether each got
the same assignment back.

With batching on (the default, as in production) it schedules groups of its sandboxes
at once, by ``schedule_many`` or by concurrent ``schedule`` calls that the placement
batcher commits together, so a kill can interrupt several placements of one
transaction; with batching off, one request per transaction.

Under the ``adversarial`` profile it also misbehaves on purpose now and then
(:mod:`.adversary`: each misbehaviour must be refused as documented and write nothing)
and probes the Runner aggregate's own guards on the live state (:mod:`.probes`); both
are journaled (``misbehaviour`` and ``probe`` records) for the final checks.

An exception that is neither a typed refusal nor the store's fault is journaled as
``unexpected`` (a violation in the final checks), and the worker carries on.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import psycopg
from eventsourcing.persistence import InterfaceError, OperationalError

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.gc_tuning import tune_gc
from secondbox_scheduler.infrastructure.reconciler import Reconciler
from secondbox_scheduler.infrastructure.tools.fault_injection.adversary import Adversary
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import (
    HEARTBEAT_TIMEOUT,
    requirements,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.probes import guard_probes

PROOF = {"verified-by": "secondbox-verify"}
GROUP = 8  # at most this many of the worker's sandboxes scheduled at once (batching on)

JOURNALED = "journaled_by_worker"  # set on a refusal already written to the journal

Outcome = tuple[DurableAssignment, bool] | SchedulerError

# The store's own faults (PostgreSQL restarting, a connection lost), journaled as
# ``fault``: expected when the run restarts PostgreSQL. Every other exception that is not
# a typed refusal (SchedulerError) is a bug, journaled as ``unexpected``: a violation.
STORE_FAULTS = (OperationalError, InterfaceError, psycopg.OperationalError, psycopg.InterfaceError)


class Worker:
    def __init__(self, config: dict[str, Any], journal: TextIO, previous: list[dict[str, Any]]):
        self.config = config
        self.index: int = config["index"]
        self.journal = journal
        self.rng = random.Random(f"{config['seed']}-{self.index}-{len(previous)}")
        self.batching: bool = config.get("batching", True)
        self.app = SchedulerApplication(
            env={
                "SECONDBOX_DATABASE_URL": config["database_url"],
                "SECONDBOX_READ_MODELS": "on",
                "SECONDBOX_BATCHING": "on" if self.batching else "off",
            }
        )
        self.sandboxes: list[str] = config["sandboxes"]
        self.runners: list[str] = config["runners"]
        self.previous = previous
        self.ops = 0
        self.profile: str = config.get("profile", "standard")
        # every token this worker was given, by (sandbox, generation): the adversary's ammunition
        self.tokens: dict[tuple[str, int], str] = {
            (record["sandbox"], record["generation"]): record["token"]
            for record in previous
            if record["kind"] == "ack" and record["op"] == "schedule"
        }
        self.adversary = Adversary(self.app, self.rng, self.tokens, self.schedule_with)

    def write(self, record: dict[str, Any]) -> None:
        self.journal.write(json.dumps(record, sort_keys=True) + "\n")
        self.journal.flush()

    def in_flight(self) -> list[dict[str, Any]]:
        """The journaled schedule intents that have no answer (ack or refusal), in order."""
        pending: dict[str, dict[str, Any]] = {}
        for record in self.previous:
            if record["kind"] == "intent":
                pending[record["request"]] = record
            elif record["kind"] in ("ack", "refused") and "request" in record:
                pending.pop(record["request"], None)
        return list(pending.values())

    def schedule_with(self, sandbox_id: str, token: bytes) -> tuple[DurableAssignment, bool]:
        assignment_id = f"{sandbox_id}-{self.rng.getrandbits(64):016x}"
        return self.schedule(sandbox_id, assignment_id, token.hex(), retried=False)

    def schedule(
        self, sandbox_id: str, assignment_id: str, token: str, retried: bool
    ) -> tuple[DurableAssignment, bool]:
        """One request, alone: its assignment, or its typed refusal raised."""
        request = self.request(sandbox_id, assignment_id, token)
        self.write_intent(request, token)
        return self.answered(request, self.outcome_of(request), retried)

    def schedule_group(self, items: list[tuple[str, str, str]], retried: bool) -> None:
        """Several requests (sandbox, assignment id, token) at once: every intent is
        journaled first, then the answers. ``schedule_many`` or concurrent ``schedule``
        calls (the batcher groups them), chosen at random."""
        requests = [self.request(*item) for item in items]
        for request, (_, _, token) in zip(requests, items, strict=True):
            self.write_intent(request, token)
        outcomes: list[Outcome]
        if len(requests) == 1 or self.rng.random() < 0.5:
            outcomes = self.app.schedule_many(requests)
        else:
            with ThreadPoolExecutor(len(requests)) as pool:
                outcomes = list(pool.map(self.outcome_of, requests))
        for request, outcome in zip(requests, outcomes, strict=True):
            with suppress(SchedulerError):  # journaled as refused
                self.answered(request, outcome, retried)

    def outcome_of(self, request: ScheduleRequest) -> Outcome:
        try:
            return self.app.schedule(request)
        except SchedulerError as error:
            return error

    def request(self, sandbox_id: str, assignment_id: str, token: str) -> ScheduleRequest:
        now = self.app.now()
        return ScheduleRequest(
            assignment_id=assignment_id, assignment_command_id=f"cmd-{assignment_id}",
            instance_id=f"inst-{sandbox_id}", sandbox_id=sandbox_id,
            workspace_id=f"ws-{sandbox_id}", start_mutation_id=f"start-{assignment_id}",
            profile_revision_id="verify-profile",
            requirements=requirements("verify", self.profile),
            fencing_token=bytes.fromhex(token), claim_expires_at=now + timedelta(minutes=5),
            operation_deadline=now + timedelta(minutes=5), retry_limit=2,
            serialization_retry_limit=12, heartbeat_timeout=HEARTBEAT_TIMEOUT,
            now=now, effect_started_at=now, plan_ready_at=now,
        )  # fmt: skip

    def write_intent(self, request: ScheduleRequest, token: str) -> None:
        self.write({"kind": "intent", "request": request.assignment_id,
                    "sandbox": request.sandbox_id, "token": token})  # fmt: skip

    def answered(
        self, request: ScheduleRequest, outcome: Outcome, retried: bool
    ) -> tuple[DurableAssignment, bool]:
        """Journal the answer to ``request``; a refusal is raised after it is written."""
        if isinstance(outcome, SchedulerError):
            self.write({"kind": "refused", "error": type(outcome).__name__,
                        "request": request.assignment_id})  # fmt: skip
            setattr(outcome, JOURNALED, True)  # run() must not journal it again
            raise outcome
        assignment, created = outcome
        self.write({
            "kind": "ack", "op": "schedule", "request": request.assignment_id,
            "sandbox": request.sandbox_id, "generation": assignment.generation,
            "assignment": assignment.id, "token": assignment.fencing_token.hex(),
            "created": created, "retried": retried,
        })  # fmt: skip
        self.tokens[(request.sandbox_id, assignment.generation)] = assignment.fencing_token.hex()
        return assignment, created

    def new_placements(self, first: str) -> None:
        """Schedule ``first`` (which has no assignment), and with batching on up to
        GROUP - 1 more of the worker's sandboxes that have none either."""
        chosen = [first]
        if self.batching:
            for sandbox_id in self.rng.sample(self.sandboxes, min(GROUP, len(self.sandboxes))):
                if (
                    len(chosen) < GROUP
                    and sandbox_id not in chosen
                    and self.app.get_assignment(sandbox_id) is None
                ):
                    chosen.append(sandbox_id)
        items = [
            (s, f"{s}-{self.rng.getrandbits(64):016x}", self.rng.randbytes(32).hex())
            for s in chosen
        ]
        if len(items) == 1:
            self.schedule(*items[0], retried=False)
        else:
            self.schedule_group(items, retried=False)

    def misbehave(self) -> bool:
        """Adversarial profile: one misbehaviour or a round of guard probes, now and then."""
        roll = self.rng.random()
        if roll < 0.2:
            probe = self.adversary.misbehave(self.rng.choice(self.sandboxes), self.runners)
            if probe is not None:
                self.write({**probe.to_record(), "kind": "misbehaviour"})
            return True
        if roll < 0.25:
            for probe in guard_probes(self.app, self.rng.choice(self.runners), self.app.now()):
                self.write(probe.to_record())
            return True
        return False

    def step(self) -> None:
        if self.profile == "adversarial" and self.misbehave():
            return
        sandbox_id = self.rng.choice(self.sandboxes)
        roll = self.rng.random()
        if roll < 0.05:
            runner = self.rng.choice(self.runners)
            for runner_id in self.runners:
                self.app.record_heartbeat(runner_id=runner_id, at=self.app.now())
            self.write({"kind": "ack", "op": "heartbeat", "runner": runner})
            return
        if roll < 0.07:
            runner = self.rng.choice(self.runners)
            (self.app.start_drain if self.rng.random() < 0.5 else self.app.cancel_drain)(runner)
            self.write({"kind": "ack", "op": "drain", "runner": runner})
            return
        if roll < 0.10:
            Reconciler(self.app, f"verify-worker-{self.index}", heartbeat_timeout=HEARTBEAT_TIMEOUT,
                       interval=timedelta(minutes=5)).run_once()  # fmt: skip
            self.write({"kind": "ack", "op": "reconcile"})
            return
        current = self.app.get_assignment(sandbox_id)
        if current is None:
            self.new_placements(sandbox_id)
        elif current.state == "released":
            generation = self.app.advance_generation(sandbox_id, current.generation)
            self.write({"kind": "ack", "op": "advance", "sandbox": sandbox_id,
                        "generation": generation})  # fmt: skip
        elif current.state == "assigned" and self.rng.random() < 0.5:
            self.app.mark_running(sandbox_id, current.generation, current.fencing_token)
            self.write({"kind": "ack", "op": "running", "sandbox": sandbox_id})
        else:
            self.app.release(sandbox_id, current.generation, current.fencing_token, PROOF)
            self.write({"kind": "ack", "op": "release", "sandbox": sandbox_id,
                        "generation": current.generation})  # fmt: skip

    def stats(self) -> None:
        metrics = self.app.metrics
        self.write(
            {
                "kind": "stats",
                "ops": self.ops,
                "contention_retries": metrics.contention_retries,
                "contention_errors": metrics.contention_errors,
                "batch_sizes": {str(size): n for size, n in metrics.batch_sizes.items()},
            }
        )

    def run(self, deadline: float) -> None:
        pending = self.in_flight()  # the requests a kill interrupted, if any
        while time.time() < deadline:
            try:
                if pending:
                    items = [(r["sandbox"], r["request"], r["token"]) for r in pending]
                    pending = []
                    self.schedule_group(items, retried=True)
                else:
                    self.step()
            except SchedulerError as error:
                if not getattr(error, JOURNALED, False):
                    self.write({"kind": "refused", "error": type(error).__name__})
            except STORE_FAULTS as error:  # PostgreSQL restarting, connection lost, ...
                self.write({"kind": "fault", "error": f"{type(error).__name__}: {error}"[:200]})
                time.sleep(0.5)
                pending = self.in_flight_from_journal()
            except Exception as error:  # a bug: neither a typed refusal nor the store's fault
                self.write({"kind": "unexpected", "error": f"{type(error).__name__}: {error}"[:200],
                            "traceback": traceback.format_exc()[-2000:]})  # fmt: skip
                time.sleep(0.5)
                pending = self.in_flight_from_journal()
            self.ops += 1
            if self.ops % 50 == 0:
                self.stats()
        self.stats()

    def in_flight_from_journal(self) -> list[dict[str, Any]]:
        path = Path(self.config["journal"])
        self.previous = [json.loads(line) for line in path.read_text().splitlines() if line]
        return self.in_flight()


def main() -> None:
    tune_gc()  # as every process of the scheduler (infrastructure/gc_tuning.py)
    config = json.loads(sys.stdin.readline())  # not argv: it holds the database URL
    path = Path(config["journal"])
    previous = (
        [json.loads(line) for line in path.read_text().splitlines() if line]
        if path.exists()
        else []
    )
    with path.open("a") as journal:
        worker = Worker(config, journal, previous)
        worker.write(
            {"kind": "start", "restarts": sum(1 for r in previous if r["kind"] == "start")}
        )
        worker.run(config["deadline"])
        worker.app.close()


if __name__ == "__main__":
    main()
