"""A client that misbehaves on purpose, for ``verify --profile adversarial``.

One per worker, on the worker's own sandboxes (so it knows every token it was given)
and on the shared runners. Each misbehaviour must be refused with the documented error
(docs/spec.md (sections 5 and 6)) and must write nothing: the events appended to the streams it
touched while it ran are read back, and none may be one that the misbehaving call could
have written (other workers write to the shared runners meanwhile, and their reconcilers
to any sandbox, so "nothing new at all" would be the wrong test).

- stale tokens: a token of an earlier generation, at that generation or at the current
  one; a forged token; the next generation with the current token -> StaleFenceError;
- a token of an earlier generation reused for a new one -> InvalidRequestError
  (``fencing_token``); a replay with another token -> the existing assignment;
- an advance before release -> InvalidTransitionError;
- a release without proof -> InvalidRequestError; a duplicate release -> False (same
  proof) or ReleaseProofError (another proof), capacity released once;
- deregistering a runner that holds one of its reservations -> ConflictError;
- a heartbeat older than the last one -> "stale", nothing recorded;
- a drain started while a placement on that runner is in flight (the placement either
  lands before the drain or is refused; ``audit verify`` checks which), then cancelled.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.errors import (
    ConflictError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    InvalidTransitionError,
    ReleaseProofError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import DurableAssignment
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.fault_injection.probes import Probe

PROOF = {"verified-by": "secondbox-verify"}
# What a call on a sandbox could write: what must not appear after a refused one.
SANDBOX_WRITES = (
    Sandbox.AssignmentFenced, Sandbox.AssignmentRunning, Sandbox.AssignmentReleased,
    Sandbox.GenerationAdvanced,
)  # fmt: skip
ADVERSARY_FAILURE = "transport"  # the class the adversary reports (reconcilers never do)


class Adversary:
    """Misbehaviours on one worker's sandboxes; each returns a :class:`Probe` (or None
    when it does not apply to the sandbox's current state)."""

    def __init__(
        self,
        app: SchedulerApplication,
        rng: random.Random,
        tokens: dict[tuple[str, int], str],
        schedule: Callable[[str, bytes], tuple[DurableAssignment, bool]],
    ) -> None:
        self.app = app
        self.rng = rng
        self.tokens = tokens  # (sandbox, generation) -> token hex, from the journal
        self.schedule = schedule  # (sandbox, token) -> schedule's answer

    # -- what "writes nothing" means -------------------------------------------------------

    def _version(self, stream: UUID) -> int:
        latest = list(self.app.events.get(stream, desc=True, limit=1))
        return latest[0].originator_version if latest else 0

    def _since(self, stream: UUID, version: int) -> list[Any]:
        return list(self.app.events.get(stream, gt=version))

    def _sandbox_wrote(self, sandbox_id: str, version: int) -> list[str]:
        return [
            type(event).__qualname__
            for event in self._since(sandbox_uuid(sandbox_id), version)
            if isinstance(event, SANDBOX_WRITES)
            or (
                isinstance(event, Sandbox.AssignmentFailed)
                and event.failure_class == ADVERSARY_FAILURE
            )
        ]

    def refused(
        self,
        name: str,
        sandbox_id: str,
        error: type[SchedulerError],
        call: Callable[[], object],
        field: str | None = None,
    ) -> Probe:
        """``call`` must raise ``error`` (naming ``field``) and write nothing on the sandbox."""
        version = self._version(sandbox_uuid(sandbox_id))
        try:
            call()
        except error as refusal:
            if field is not None and getattr(refusal, "field", None) != field:
                return Probe(name, False, f"refused naming {getattr(refusal, 'field', None)!r}")
            wrote = self._sandbox_wrote(sandbox_id, version)
            return Probe(name, not wrote, f"refused, but wrote {wrote}" if wrote else "")
        except SchedulerError as other:
            return Probe(name, False, f"{type(other).__name__} instead of {error.__name__}")
        return Probe(name, False, f"accepted on sandbox {sandbox_id!r}")

    # -- misbehaviours on a sandbox -------------------------------------------------------

    def misbehave(self, sandbox_id: str, runners: list[str]) -> Probe | None:
        current = self.app.get_assignment(sandbox_id)
        choices: list[Callable[[], Probe | None]] = [
            lambda: self.heartbeat_out_of_order(self.rng.choice(runners)),
        ]
        if current is None:
            choices += [lambda: self.reused_token(sandbox_id),
                        lambda: self.drain_during_placement(sandbox_id)]  # fmt: skip
        elif current.state == "released":
            choices += [lambda: self.duplicate_release(current), lambda: self.stale_token(current)]
        else:
            choices += [
                lambda: self.stale_token(current), lambda: self.forged_token(current),
                lambda: self.next_generation(current), lambda: self.early_advance(current),
                lambda: self.release_without_proof(current), lambda: self.replay(current),
                lambda: self.deregister_busy_runner(current),
            ]  # fmt: skip
        return self.rng.choice(choices)()

    def _fenced_call(self, sandbox_id: str, generation: int, token: bytes) -> Callable[[], object]:
        command = self.rng.choice(["running", "release", "fail"])
        if command == "running":
            return lambda: self.app.mark_running(sandbox_id, generation, token)
        if command == "release":
            return lambda: self.app.release(sandbox_id, generation, token, PROOF)
        return lambda: self.app.fail(sandbox_id, generation, token, ADVERSARY_FAILURE)

    def stale_token(self, current: DurableAssignment) -> Probe | None:
        earlier = [
            g for g in range(1, current.generation) if (current.sandbox_id, g) in self.tokens
        ]
        if not earlier:
            return None
        generation = self.rng.choice(earlier)
        token = bytes.fromhex(self.tokens[(current.sandbox_id, generation)])
        at = self.rng.choice([generation, current.generation])
        return self.refused(
            "stale token of an earlier generation", current.sandbox_id, StaleFenceError,
            self._fenced_call(current.sandbox_id, at, token),
        )  # fmt: skip

    def forged_token(self, current: DurableAssignment) -> Probe:
        forged = self.rng.randbytes(32)
        return self.refused(
            "forged token", current.sandbox_id, StaleFenceError,
            self._fenced_call(current.sandbox_id, current.generation, forged),
        )  # fmt: skip

    def next_generation(self, current: DurableAssignment) -> Probe:
        return self.refused(
            "a generation not yet reached", current.sandbox_id, StaleFenceError,
            self._fenced_call(current.sandbox_id, current.generation + 1, current.fencing_token),
        )  # fmt: skip

    def early_advance(self, current: DurableAssignment) -> Probe:
        return self.refused(
            f"advance while {current.state}", current.sandbox_id, InvalidTransitionError,
            lambda: self.app.advance_generation(current.sandbox_id, current.generation),
        )  # fmt: skip

    def release_without_proof(self, current: DurableAssignment) -> Probe:
        return self.refused(
            "release without proof", current.sandbox_id, InvalidRequestError,
            lambda: self.app.release(current.sandbox_id, current.generation,
                                     current.fencing_token, {}),
            field="release_proof",
        )  # fmt: skip

    def duplicate_release(self, current: DurableAssignment) -> Probe:
        sandbox_id, generation = current.sandbox_id, current.generation
        runner = runner_uuid(current.runner_id)
        runner_version = self._version(runner)
        if self.rng.random() < 0.5:
            probe = self.refused(
                "release again with another proof", sandbox_id, ReleaseProofError,
                lambda: self.app.release(sandbox_id, generation, current.fencing_token,
                                         {"other": "proof"}),
            )  # fmt: skip
        else:
            version = self._version(sandbox_uuid(sandbox_id))
            again = self.app.release(sandbox_id, generation, current.fencing_token, PROOF)
            wrote = self._sandbox_wrote(sandbox_id, version)
            ok = again is False and not wrote
            probe = Probe("release again with the same proof", ok,
                          "" if ok else f"answered {again}, wrote {wrote}")  # fmt: skip
        freed = [
            event for event in self._since(runner, runner_version)
            if isinstance(event, Runner.CapacityReleased)
            and event.reservation == f"{sandbox_id}#{generation}"
        ]  # fmt: skip
        if freed:
            return Probe(probe.name, False, "capacity released a second time")
        return probe

    def replay(self, current: DurableAssignment) -> Probe:
        version = self._version(sandbox_uuid(current.sandbox_id))
        answer, created = self.schedule(current.sandbox_id, self.rng.randbytes(32))
        wrote = self._sandbox_wrote(current.sandbox_id, version)
        ok = not created and answer.id == current.id and not wrote
        return Probe("schedule again with another token", ok,
                     "" if ok else f"created={created}, wrote {wrote}")  # fmt: skip

    def reused_token(self, sandbox_id: str) -> Probe | None:
        earlier = [token for (sandbox, _), token in self.tokens.items() if sandbox == sandbox_id]
        if not earlier:
            return None
        token = bytes.fromhex(self.rng.choice(earlier))
        return self.refused(
            "token of an earlier generation reused", sandbox_id, InvalidRequestError,
            lambda: self.schedule(sandbox_id, token), field="fencing_token",
        )  # fmt: skip

    def deregister_busy_runner(self, current: DurableAssignment) -> Probe:
        """The runner holds this (unreleased, never released by anyone else) assignment."""
        name = "deregister a runner holding a reservation"
        stream = runner_uuid(current.runner_id)
        version = self._version(stream)
        try:
            self.app.deregister_runner(current.runner_id)
        except ConflictError:
            gone = [e for e in self._since(stream, version) if isinstance(e, Runner.Deregistered)]
            return Probe(name, not gone, "refused, but deregistered" if gone else "")
        except SchedulerError as other:
            return Probe(name, False, f"{type(other).__name__} instead of ConflictError")
        return Probe(name, False, f"runner {current.runner_id!r} deregistered while reserved")

    def heartbeat_out_of_order(self, runner_id: str) -> Probe:
        name = "heartbeat older than the last"
        stream = lease_uuid(runner_id)
        version = self._version(stream)
        at = self.app.now() - timedelta(hours=1)
        outcome = self.app.record_heartbeat(runner_id=runner_id, at=at)
        recorded = [
            e for e in self._since(stream, version)
            if isinstance(e, (RunnerLease.LivenessRenewed, RunnerLease.EvidenceRecorded))
            and e.at == at
        ]  # fmt: skip
        ok = outcome == "stale" and not recorded
        return Probe(name, ok, "" if ok else f"answered {outcome!r}, recorded {len(recorded)}")

    def drain_during_placement(self, sandbox_id: str) -> Probe:
        """Not a refusal to check: the race itself, which ``audit verify`` then judges
        (no reservation may land on a draining runner, the evidence must say active)."""
        home = self.app.sandbox_home(sandbox_id)
        drained = threading.Thread(target=lambda: self.app.start_drain(home))
        drained.start()
        try:
            self.schedule(sandbox_id, self.rng.randbytes(32))
            outcome = "placed"
        except HomeRunnerUnavailableError:
            outcome = "refused"
        finally:
            drained.join()
            self.app.cancel_drain(home)
        return Probe(f"drain during placement ({outcome})", True)
