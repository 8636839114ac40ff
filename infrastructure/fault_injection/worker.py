"""One worker process of the fault-injection run, ``secondbox-scheduler verify``.

Started as ``python -m secondbox_scheduler.infrastructure.fault_injection.worker CONFIG``
(CONFIG: the worker's settings as JSON) by :mod:`.run`.

It owns a partition of the sandboxes (so its retried requests have one right answer)
and shares every runner with the other workers (the hot spots). It journals each
request before sending it (``intent``) and each answer after (``ack``), flushed to the
OS, so a SIGKILL loses nothing acknowledged; on restart it first retries the request
that was in flight and records whether it got the same assignment back.

Under the ``adversarial`` profile it also misbehaves on purpose now and then
(:mod:`.adversary`: each misbehaviour must be refused as documented and write nothing)
and probes the Runner aggregate's own guards on the live state (:mod:`.probes`); both
are journaled (``misbehaviour`` and ``probe`` records) for the final checks.
"""

from __future__ import annotations

import json
import random
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.fault_injection.adversary import Adversary
from secondbox_scheduler.infrastructure.fault_injection.fleet import HEARTBEAT_TIMEOUT, requirements
from secondbox_scheduler.infrastructure.fault_injection.probes import guard_probes
from secondbox_scheduler.infrastructure.reconciler import Reconciler

PROOF = {"verified-by": "secondbox-verify"}


class Worker:
    def __init__(self, config: dict[str, Any], journal: TextIO, previous: list[dict[str, Any]]):
        self.config = config
        self.index: int = config["index"]
        self.journal = journal
        self.rng = random.Random(f"{config['seed']}-{self.index}-{len(previous)}")
        self.app = SchedulerApplication(
            env={"SECONDBOX_DATABASE_URL": config["database_url"], "SECONDBOX_READ_MODELS": "on"}
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

    def in_flight(self) -> dict[str, Any] | None:
        """The last journaled schedule intent that has no ack."""
        last: dict[str, Any] | None = None
        for record in self.previous:
            if record["kind"] == "intent":
                last = record
            elif record["kind"] == "ack" and last and record.get("request") == last["request"]:
                last = None
        return last

    def schedule_with(self, sandbox_id: str, token: bytes) -> tuple[DurableAssignment, bool]:
        assignment_id = f"{sandbox_id}-{self.rng.getrandbits(64):016x}"
        return self.schedule(sandbox_id, assignment_id, token.hex(), retried=False)

    def schedule(
        self, sandbox_id: str, assignment_id: str, token: str, retried: bool
    ) -> tuple[DurableAssignment, bool]:
        now = self.app.now()
        request = ScheduleRequest(
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
        self.write({"kind": "intent", "request": assignment_id, "sandbox": sandbox_id,
                    "token": token})  # fmt: skip
        assignment, created = self.app.schedule(request)
        self.write({
            "kind": "ack", "op": "schedule", "request": assignment_id, "sandbox": sandbox_id,
            "generation": assignment.generation, "assignment": assignment.id,
            "token": assignment.fencing_token.hex(), "created": created, "retried": retried,
        })  # fmt: skip
        self.tokens[(sandbox_id, assignment.generation)] = assignment.fencing_token.hex()
        return assignment, created

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
            self.schedule(sandbox_id, f"{sandbox_id}-{self.rng.getrandbits(64):016x}",
                          self.rng.randbytes(32).hex(), retried=False)  # fmt: skip
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
            }
        )

    def run(self, deadline: float) -> None:
        pending = self.in_flight()  # the request a kill interrupted, if any
        while time.time() < deadline:
            try:
                if pending is not None:
                    request, pending = pending, None
                    self.schedule(request["sandbox"], request["request"], request["token"], True)
                else:
                    self.step()
            except SchedulerError as error:
                self.write({"kind": "refused", "error": type(error).__name__})
            except Exception as error:  # PostgreSQL restarting, connection lost, ...
                self.write({"kind": "fault", "error": f"{type(error).__name__}: {error}"[:200]})
                time.sleep(0.5)
                pending = self.in_flight_from_journal()
            self.ops += 1
            if self.ops % 50 == 0:
                self.stats()
        self.stats()

    def in_flight_from_journal(self) -> dict[str, Any] | None:
        path = Path(self.config["journal"])
        self.previous = [json.loads(line) for line in path.read_text().splitlines() if line]
        return self.in_flight()


def main() -> None:
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
