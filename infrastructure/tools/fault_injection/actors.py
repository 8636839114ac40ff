"""Deterministic actors of ``verify --profile adversarial``, run once the workers are done
(on runners and sandboxes of their own, in pools of their own, on a clock of their own
that stands still at the moment they start), and the ranking check of every home
decision in the log.

- **an earlier generation's token**: a sandbox placed, released, advanced and placed
  again; the first generation's token at either generation, a forged token and the
  current token at the next generation, on ``mark_running``, ``release`` and ``fail``:
  each ``StaleFenceError``, nothing written (the log's head does not move);
- **the staleness boundary** (docs/spec.md section 3: fresh when ``last_heartbeat_at >=
  now - heartbeat_timeout``): a runner whose last heartbeat is exactly at ``now -
  heartbeat_timeout`` is chosen as a home and placed on; one a microsecond older is
  refused as a home (``NoCompatibleRunnerError``), and a placement a microsecond later
  on the first is refused (``HomeRunnerUnavailableError``), neither writing a sandbox
  or an assignment;
- **lying clocks** (docs/spec.md section 6a): a schedule request whose ``now`` is a
  year, or the documented tolerance and a second, ahead of or behind the clock, and a
  heartbeat a year or the tolerance and a second ahead or a year behind: each
  ``InvalidRequestError`` naming the field, nothing written; and the application's
  tolerance is the documented default;
- **the ranking** (docs/spec.md section 3): runners equal but for free vCPU, or free
  memory: the home is the one with the most;
- :func:`ranking_check`: every ``Sandbox.Created`` in the log, checked against the
  runners as the log stood at its position (the audit fold): each ranked candidate's
  recorded amounts are its real free amounts and locality, and the home is the first
  of the listed compatible candidates by the spec's ranking, computed here and not by
  ``domain/placement/ranking.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.errors import (
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication, system_now
from secondbox_scheduler.infrastructure.audit.log_fold import log_events
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import (
    CAPABILITIES,
    requirements,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.probes import Probe

# docs/spec.md (section 6a): the default clock tolerance, stated here and not read from
# domain/limits.py, so that a changed default is caught
SPEC_CLOCK_TOLERANCE = timedelta(seconds=5)
TIMEOUT = timedelta(seconds=60)  # the actors' heartbeat timeout
TICK = timedelta(microseconds=1)
PROOF = {"verified-by": "secondbox-verify actors"}
ROOM = Capacity(vcpu_count=64, memory_bytes=2**30, disk_bytes=2**30, instances=8, operations=64)


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


class Actors:
    def __init__(self, app: SchedulerApplication, clock: Clock) -> None:
        self.app = app
        self.clock = clock
        self.probes: list[Probe] = []

    # -- helpers ---------------------------------------------------------------------------

    def head(self) -> int:
        return int(self.app.recorder.max_notification_id() or 0)

    def runner(self, runner_id: str, pool: str, heartbeat: datetime, **room: int) -> None:
        self.app.register_runner(
            runner_id=runner_id, pool_name=pool, backend_kind="firecracker",
            architecture="x86_64", capabilities=CAPABILITIES,
            allocatable=Capacity(**{**ROOM.as_dict(), **room}),
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )  # fmt: skip
        self.app.record_heartbeat(runner_id=runner_id, at=heartbeat)

    def create(self, sandbox_id: str, pool: str) -> str:
        return self.app.create_sandbox(
            sandbox_id=sandbox_id, workspace_id=f"ws-{sandbox_id}",
            profile_revision_id="verify-profile", requirements=requirements(pool),
            heartbeat_timeout=TIMEOUT,
        )  # fmt: skip

    def request(self, sandbox_id: str, pool: str, now: datetime | None = None) -> ScheduleRequest:
        at = now or self.clock()
        assignment_id = f"{sandbox_id}-{secrets.token_hex(8)}"
        return ScheduleRequest(
            assignment_id=assignment_id, assignment_command_id=f"cmd-{assignment_id}",
            instance_id=f"inst-{sandbox_id}", sandbox_id=sandbox_id,
            workspace_id=f"ws-{sandbox_id}", start_mutation_id=f"start-{assignment_id}",
            profile_revision_id="verify-profile", requirements=requirements(pool),
            fencing_token=secrets.token_bytes(32), claim_expires_at=at + timedelta(minutes=5),
            operation_deadline=at + timedelta(minutes=5), retry_limit=2,
            serialization_retry_limit=12, heartbeat_timeout=TIMEOUT,
            now=at, effect_started_at=at, plan_ready_at=at,
        )  # fmt: skip

    def refused(
        self,
        name: str,
        error: type[SchedulerError],
        call: Callable[[], object],
        field: str | None = None,
        writes: Callable[[], bool] | None = None,
    ) -> None:
        """``call`` must raise ``error`` (naming ``field``) and write nothing: the head does
        not move, or (a placement refusal records its evidence) ``writes()`` is False."""
        head = self.head()
        try:
            answer = call()
        except error as refusal:
            named = getattr(refusal, "field", None)
            if field is not None and named != field:
                self.probes.append(Probe(name, False, f"refused naming {named!r}, not {field!r}"))
                return
            wrote = writes() if writes is not None else self.head() != head
            self.probes.append(Probe(name, not wrote, "refused, but wrote" if wrote else ""))
            return
        except SchedulerError as other:
            self.probes.append(Probe(name, False, f"{type(other).__name__}: {other}"))
            return
        self.probes.append(Probe(name, False, f"accepted: {answer!r}"))

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.probes.append(Probe(name, ok, "" if ok else detail))

    # -- the actors ----------------------------------------------------------------------------

    def run(self) -> list[Probe]:
        self.earlier_generation()
        self.lying_clocks()
        self.ranking()
        self.staleness_boundary()  # last: it moves the clock a tick
        return self.probes

    def earlier_generation(self) -> None:
        now = self.clock()
        self.runner("actor-gen", "actors-gen", now)
        sandbox_id = "actor-gen-sbx"
        self.create(sandbox_id, "actors-gen")
        first, _ = self.app.schedule(self.request(sandbox_id, "actors-gen"))
        self.app.release(sandbox_id, 1, first.fencing_token, PROOF)
        self.app.advance_generation(sandbox_id, 1)
        second, _ = self.app.schedule(self.request(sandbox_id, "actors-gen"))
        old, current, forged = first.fencing_token, second.fencing_token, secrets.token_bytes(32)
        cases = [
            ("an earlier generation's token at the current generation", 2, old),
            ("an earlier generation's token at its own generation", 1, old),
            ("a forged token at the current generation", 2, forged),
            ("the current token at the next generation", 3, current),
        ]
        for label, generation, token in cases:
            for command, call in self._fenced(sandbox_id, generation, token):
                self.refused(f"actor: {label} ({command})", StaleFenceError, call)

    def _fenced(
        self, sandbox_id: str, generation: int, token: bytes
    ) -> list[tuple[str, Callable[[], object]]]:
        app = self.app
        return [
            ("running", lambda: app.mark_running(sandbox_id, generation, token)),
            ("release", lambda: app.release(sandbox_id, generation, token, PROOF)),
            ("fail", lambda: app.fail(sandbox_id, generation, token, "transport")),
        ]

    def lying_clocks(self) -> None:
        self.check(
            "actor: the clock tolerance is the documented default",
            self.app.clock_tolerance == SPEC_CLOCK_TOLERANCE,
            f"it is {self.app.clock_tolerance}, docs/spec.md (6a) says {SPEC_CLOCK_TOLERANCE}",
        )
        now, year, past_tolerance = self.clock(), timedelta(days=365), SPEC_CLOCK_TOLERANCE
        past_tolerance += timedelta(seconds=1)
        sandbox_id = "actor-gen-sbx"  # any sandbox: the time is refused before anything
        for label, at in [
            ("a year ahead", now + year), ("a year behind", now - year),
            ("the tolerance and a second ahead", now + past_tolerance),
            ("the tolerance and a second behind", now - past_tolerance),
        ]:  # fmt: skip
            request = self.request(sandbox_id, "actors-gen", at)
            self.refused(
                f"actor: lying clock, a request {label}", InvalidRequestError,
                lambda request=request: self.app.schedule(request), field="now",  # type: ignore[misc]
            )  # fmt: skip
        for label, at in [
            ("a year ahead", now + year), ("a year behind", now - year),
            ("the tolerance and a second ahead", now + past_tolerance),
        ]:  # fmt: skip
            self.refused(
                f"actor: lying clock, a heartbeat {label}", InvalidRequestError,
                lambda at=at: self.app.record_heartbeat(runner_id="actor-gen", at=at),  # type: ignore[misc]
                field="at",
            )  # fmt: skip

    def ranking(self) -> None:
        now = self.clock()
        for dimension, amounts in [
            ("vcpu_count", (16, 48, 32)),
            ("memory_bytes", (2**28, 2**30, 2**29)),
        ]:
            pool = f"actors-rank-{dimension}"
            for index, amount in enumerate(amounts):
                self.runner(f"{pool}-{index}", pool, now, **{dimension: amount})
            home = self.create(f"{pool}-sbx", pool)
            self.check(
                f"actor: ranking, most free {dimension} first", home == f"{pool}-1",
                f"home {home}, not {pool}-1 (free {dimension} {amounts})",
            )  # fmt: skip

    def staleness_boundary(self) -> None:
        now = self.clock()
        self.runner("actor-fresh", "actors-fresh", now - TIMEOUT)
        self.runner("actor-stale", "actors-stale", now - TIMEOUT - TICK)
        try:
            home = self.create("actor-fresh-sbx", "actors-fresh")
            self.check("actor: heartbeat exactly at the boundary, chosen as home",
                       home == "actor-fresh", f"home {home}")  # fmt: skip
            self.create("actor-fresh-sbx2", "actors-fresh")
        except SchedulerError as error:
            self.check("actor: heartbeat exactly at the boundary, chosen as home", False,
                       f"{type(error).__name__}: {error}")  # fmt: skip
            return
        try:
            self.app.schedule(self.request("actor-fresh-sbx", "actors-fresh"))
            self.check("actor: heartbeat exactly at the boundary, placed", True, "")
        except SchedulerError as error:
            self.check("actor: heartbeat exactly at the boundary, placed", False,
                       f"{type(error).__name__}: {error}")  # fmt: skip
        self.refused(
            "actor: heartbeat one tick past the boundary, refused as home",
            NoCompatibleRunnerError, lambda: self.create("actor-stale-sbx", "actors-stale"),
            writes=lambda: bool(list(self.app.events.get(sandbox_uuid("actor-stale-sbx")))),
        )  # fmt: skip
        self.clock.at = now + TICK
        self.refused(
            "actor: heartbeat one tick past the boundary, placement refused",
            HomeRunnerUnavailableError,
            lambda: self.app.schedule(self.request("actor-fresh-sbx2", "actors-fresh")),
            writes=lambda: self.app.get_assignment("actor-fresh-sbx2") is not None,
        )  # fmt: skip


def run_actors(url: str) -> list[Probe]:
    clock = Clock(system_now())
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": url, "SECONDBOX_BATCHING": "off"}, now=clock
    )
    try:
        return Actors(app, clock).run()
    finally:
        app.close()


# -- the ranking of every home decision in the log -------------------------------------------


def spec_key(runner: RunnerSnapshot, preferred: set[str]) -> tuple[int, int, int, int, str]:
    """docs/spec.md (section 3): artifact locality, then free instances, vCPU and memory,
    most first, then id."""
    free = runner.free()
    locality = sum(1 for digest in runner.artifact_digests if digest in preferred)
    return (-locality, -free.instances, -free.vcpu_count, -free.memory_bytes, runner.id)


def recorded_amounts(runner: RunnerSnapshot, preferred: set[str]) -> dict[str, int]:
    locality, instances, vcpu, memory, _ = spec_key(runner, preferred)
    return {"artifact_locality": -locality, "free_instances": -instances,
            "free_vcpu_count": -vcpu, "free_memory_bytes": -memory}  # fmt: skip


def ranking_check(app: SchedulerApplication) -> list[Probe]:
    fold = AuditFold()
    probes: list[Probe] = []
    name = "ranking: each home is the first by the spec's ranking"
    for position, event in log_events(app, None):
        if isinstance(event, Sandbox.Created):
            probes.append(_ranked(name, position, event, fold.runner_snapshots()))
        fold.apply(position, event)
    return probes


def _ranked(name: str, position: int, event: Any, runners: list[RunnerSnapshot]) -> Probe:
    by_id = {runner.id: runner for runner in runners}
    preferred = set(event.requirements.get("preferred_artifact_digests", []))
    decision = event.home_decision
    compatible = [c for c in decision.get("candidates", []) if not c.get("failures")]
    for candidate in compatible:
        runner = by_id.get(candidate["runner_id"])
        if runner is None:
            return Probe(name, False, f"{position}: candidate {candidate['runner_id']} unknown")
        real = recorded_amounts(runner, preferred)
        stated = {k: candidate.get("rank", {}).get(k) for k in real}
        if "rank" in candidate and stated != real:
            return Probe(name, False, f"{position} ({event.sandbox_id}): candidate "
                         f"{runner.id} recorded {stated}, its state says {real}")  # fmt: skip
    if not compatible:
        return Probe(name, False, f"{position} ({event.sandbox_id}): no compatible candidate")
    first = min(spec_key(by_id[c["runner_id"]], preferred) for c in compatible)[-1]
    if first != event.home_runner_id:
        return Probe(name, False, f"{position} ({event.sandbox_id}): home "
                     f"{event.home_runner_id}, the spec's ranking puts {first} first")  # fmt: skip
    return Probe(name, True)
