"""The sandbox side of the audit fold: sandboxes, their refusals and fencing tokens.

:class:`SandboxChecks` folds every event of a ``Sandbox``, a ``RefusalLog`` and a
``FencingTokenUse`` into plain state (:mod:`~secondbox_scheduler.domain.audit.state`)
and checks, after each, what it could break: one assignment per (sandbox, generation)
and a fencing token never reused (invariant 3); each assignment on the sandbox's home
runner, compatible by every rule on the evidence recorded with the decision, and that
evidence equal to the runner and lease as the log had them (invariant 4); a release
once, with proof, before the generation advances (invariant 6); a placement decided
within the clock tolerance (``clock``).
:class:`~secondbox_scheduler.domain.audit.fold.AuditFold` routes the events here.
"""

from __future__ import annotations

import marshal
from datetime import timedelta
from sys import intern
from typing import Any

from secondbox_scheduler.domain.assignment import STATE_RELEASED, STATE_RUNNING, STATE_UNCERTAIN
from secondbox_scheduler.domain.audit.evidence import passes_on_state, plain_snapshot, plain_view
from secondbox_scheduler.domain.audit.state import (
    LEASE_WINDOW,
    REQUIREMENTS_KEPT,
    FoldState,
    Pending,
    RunnerState,
    SandboxState,
    TokenDigests,
)
from secondbox_scheduler.domain.fencing_tokens import token_sha256
from secondbox_scheduler.domain.placement.evidence import rank_key_from_record
from secondbox_scheduler.domain.placement.rules import evaluate_runner, passes_every_rule
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot


class SandboxChecks(FoldState):
    """The handlers of sandbox, refusal and token events (named in
    ``AuditFold.HANDLERS``)."""

    # -- sandboxes ------------------------------------------------------------

    def _sandbox_created(self, event: Any) -> None:
        sandbox = SandboxState(
            event.sandbox_id, event.workspace_id, event.profile_revision_id,
            dict(event.requirements), event.home_runner_id,
        )  # fmt: skip
        self._enter(event.originator_id).sandbox = sandbox
        self.sandbox_streams[event.sandbox_id] = event.originator_id
        self._check_home_decision(event.home_runner_id, event.home_decision)

    def _check_home_decision(self, home: str, decision: dict[str, Any]) -> None:
        """The home decision's own evidence is consistent: the chosen runner is the
        home runner, listed as compatible, and ranks first among the compatible runners
        listed (unlisted runners are only counted: docs/events.md 7.3)."""
        chosen = decision.get("chosen_runner_id")
        if chosen != home:
            self._violate("invariant-4", f"home decision chose {chosen!r}")
        candidates = decision.get("candidates", ())
        if type(candidates) is list and len(candidates) == 1:  # most list the home alone
            only = candidates[0]
            if not only["failures"] and only["runner_id"] == home:
                rank_key_from_record(home, only.get("rank"))  # read as min would read it
                return
        ranks = {}  # of the compatible runners listed (a loop: most list one)
        for c in candidates:
            if not c["failures"]:
                ranks[c["runner_id"]] = c.get("rank")
        if home not in ranks:
            self._violate("invariant-4", f"home runner {home!r} is not listed as compatible")
            return
        if len(ranks) == 1:  # the home runner alone: its rank read as min would read it
            rank_key_from_record(home, ranks[home])
            return
        best = min(ranks, key=lambda runner_id: rank_key_from_record(runner_id, ranks[runner_id]))
        if ranks[home] is not None and best != home:
            self._violate("invariant-4", f"listed runner {best!r} ranks above home {home!r}")

    def _sandbox(self, event: Any) -> SandboxState | None:
        sandbox = self._stream.sandbox if self._stream else None
        if sandbox is None:
            self._violate("history", "event of a sandbox that was never created")
        return sandbox

    def _fenced(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        if sandbox is None:
            return
        record = dict(event.assignment)
        generation = record["generation"]
        if self._record(sandbox, generation) is not None:
            self._violate("invariant-3", f"second assignment for generation {generation}")
        if generation != sandbox.generation:
            self._violate(
                "invariant-3",
                f"assignment for generation {generation} while current is {sandbox.generation}",
            )
        token = TokenDigests.digest(record["fencing_token"])
        if sandbox.tokens.holds(token):
            self._violate("invariant-3", f"fencing token reused in generation {generation}")
        placement = event.placement  # read, never kept: copied only as dict() reads it
        self._check_placement(
            sandbox, record, placement if type(placement) is dict else dict(placement)
        )
        sandbox.assignments[generation] = record
        sandbox.tokens.add_digest(token)
        self._owe(record["runner_id"], record["capacity"], +1)
        indexed = getattr(event, "token_indexed", False)
        self.pending = Pending(
            "reserve", self.position, sandbox.sandbox_id, generation, record["runner_id"],
            dict(record["capacity"]),
            token_sha256(record["fencing_token"]) if indexed else None,
        )  # fmt: skip

    def _token_used(self, event: Any) -> None:
        """A fencing token's index stream: saved with the fence that used the token."""
        pending, self.pending = self.pending, None
        if (
            pending is None
            or pending.kind != "token"
            or (pending.sandbox_id, pending.generation, pending.token_sha256)
            != (event.sandbox_id, event.generation, event.token_sha256)
        ):
            self._violate(
                "invariant-3",
                f"token index of {event.sandbox_id}#{event.generation} matches no fence "
                "in the same transaction",
            )

    def _check_placement(
        self, sandbox: SandboxState, record: dict[str, Any], placement: dict[str, Any]
    ) -> None:
        runner_id = record["runner_id"]
        if runner_id != sandbox.home_runner_id:
            self._violate(
                "invariant-4",
                f"assignment on {runner_id!r} but the home runner is {sandbox.home_runner_id!r}",
            )
        requirements = sandbox.pinned
        if requirements is None:
            requirements = sandbox.pinned = self._pinned(sandbox.requirements)
        runner = self._of(self.runner_streams.get(runner_id)).runner
        lease = self._of(self.lease_of.get(runner_id)).lease
        version = placement.get("lease_version", 0)
        # the evidence is the fold's runner and lease, field for field (a sound history):
        # read from them, no validation, nothing to compare (domain/audit/evidence.py)
        own = None  # the fold's runner, lease and the lease's entry at version: the evidence
        if runner is not None and lease is not None and type(version) is int:
            view = plain_view(placement["runner"], runner, lease, version)
            if view is not None:
                own = (runner, lease, view)
                lease.materializations_at(version)  # made (and cached) here, as it was
        evidence = RunnerSnapshot.from_record(placement["runner"]) if own is None else None
        decided_at = placement["decided_at"]
        clock = placement.get("clock")  # recorded since release 0.2
        if clock is not None and abs(decided_at - clock) > self.MAX_CLOCK_SKEW:
            self._violate(
                "clock",
                f"decided at {decided_at.isoformat()} by the request, the clock said "
                f"{clock.isoformat()}",
            )
        timeout = timedelta(seconds=placement["heartbeat_timeout_seconds"])
        rules_version = placement.get("rules_version", 1)
        # every rule passed (what a sound placement shows) settles it in one go, on the
        # fold's own state when the evidence is that state; else every rule is
        # evaluated, each failure named
        if own is None or not passes_on_state(
            requirements, *own, version, decided_at, timeout, rules_version
        ):
            checked = evidence if own is None else plain_snapshot(own[0], own[1], version, own[2])
            assert checked is not None
            if not passes_every_rule(
                requirements, checked, decided_at, timeout, rules_version=rules_version
            ):
                evaluation = evaluate_runner(
                    requirements, checked, decided_at, timeout, rules_version=rules_version
                )
                if not evaluation.compatible:
                    reasons = ", ".join(f.detail for f in evaluation.failures)
                    self._violate(
                        "invariant-4", f"runner {runner_id!r} was not compatible: {reasons}"
                    )
        if record["capacity"] != requirements.capacity.as_dict():
            self._violate("invariant-4", "reserved capacity differs from the pinned requirements")
        if runner is None:
            self._violate("invariant-4", f"runner {runner_id!r} is not registered")
            return
        if evidence is not None:
            self._compare_evidence(runner, evidence)
        if runner.deregistered:
            self._violate("invariant-4", f"runner {runner_id!r} was deregistered")
        if placement.get("runner_version") != runner.version:
            self._violate(
                "invariant-4",
                f"evidence of runner version {placement.get('runner_version')} but the runner "
                f"was at {runner.version}",
            )
        if lease is None:
            self._violate("invariant-4", f"runner {runner_id!r} has no lease")
            return
        if version > lease.version:
            self._violate("invariant-4", f"evidence of lease version {version} not yet recorded")
            return
        if version <= lease.forgotten and version not in lease.history:
            self._violate(
                "invariant-4",
                f"evidence of lease version {version}, which the lease left more than "
                f"{LEASE_WINDOW.total_seconds():g}s before its latest event (the audit keeps "
                "a lease's versions that long: a decision on a view of it that old is stale)",
            )
            return
        if evidence is None:
            return
        heartbeat, digests, _ = lease.at_version(version)
        if (
            heartbeat != evidence.last_heartbeat_at
            or tuple(digests) != evidence.artifact_digests
            or lease.materializations_at(version) != evidence.materializations
        ):
            self._violate(
                "invariant-4",
                f"heartbeat evidence differs from the lease at version {version}",
            )

    def _pinned(self, record: dict[str, Any]) -> Requirements:
        """``Requirements.from_record(record)``, validated once for records of the very
        same values: ``marshal`` writes only the builtin types, each in its own exact
        form (an int, a float and a bool apart, a list and a tuple apart, no subclass),
        so records that write the same bytes are the same values and validate to the
        same requirements (frozen: shared between sandboxes). A record marshal cannot
        write (a datetime, a UUID: validation refuses them) is validated alone."""
        try:
            key = marshal.dumps(record, 2)
        except ValueError:
            return Requirements.from_record(record)
        seen = self._requirements_seen
        requirements = seen.get(key)
        if requirements is None:
            requirements = Requirements.from_record(record)
            if len(seen) >= REQUIREMENTS_KEPT:
                seen.clear()
            seen[key] = requirements
        return requirements

    def _compare_evidence(self, runner: RunnerState, evidence: RunnerSnapshot) -> None:
        """The recorded runner evidence against the runner as the log had it."""
        actual = {
            "allocatable": runner.allocatable,
            "reserved": runner.reserved,
            "drain_phase": runner.drain_phase,
            "capabilities": sorted(runner.capabilities),
            "pool_name": runner.pool_name,
            "architecture": runner.architecture,
            "backend_kind": runner.backend_kind,
        }
        recorded = {
            "allocatable": evidence.allocatable.as_dict(),
            "reserved": evidence.reserved.as_dict(),
            "drain_phase": evidence.drain_phase,
            "capabilities": sorted(evidence.capabilities),
            "pool_name": evidence.pool_name,
            "architecture": evidence.architecture,
            "backend_kind": evidence.backend_kind,
        }
        for key, value in recorded.items():
            if actual[key] != value:
                self._violate(
                    "invariant-4",
                    f"evidence {key} {value!r} differs from the runner's {actual[key]!r}",
                )

    def _released(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        if sandbox is None:
            return
        record = self._record(sandbox, event.generation)
        if record is None:
            self._violate("invariant-6", f"release of generation {event.generation} never fenced")
            return
        if record["state"] == STATE_RELEASED:
            self._violate("invariant-6", f"generation {event.generation} released twice")
        if not event.release_proof:
            self._violate("invariant-6", "released without proof")
        if record["state"] != STATE_RELEASED:
            self._owe(record["runner_id"], record["capacity"], -1)
        self._touch(record, event, state=STATE_RELEASED, release_proof=dict(event.release_proof))
        self.pending = Pending(
            "release", self.position, sandbox.sandbox_id, event.generation, record["runner_id"],
            dict(record["capacity"]),
        )  # fmt: skip

    def _advanced(self, event: Any) -> None:
        sandbox = self._sandbox(event)
        if sandbox is None:
            return
        current = sandbox.assignments.get(sandbox.generation)
        if current is None or current["state"] != STATE_RELEASED:
            self._violate("invariant-6", "generation advanced before its assignment was released")
        if self.compact and current is not None:
            if self._as_past(sandbox, current):
                del sandbox.assignments[sandbox.generation]  # _past gives it back
                sandbox.drop(sandbox.generation)
            else:
                sandbox.assignments[sandbox.generation] = self._compacted(current)
        sandbox.generation = event.generation

    def _record(self, sandbox: SandboxState, generation: int) -> dict[str, Any] | None:
        """The assignment record of ``generation`` (None: never fenced). A compact fold
        holds no record of a past generation released as it should be: a later event
        of it gets the record :meth:`_past` makes, then kept."""
        record = sandbox.assignments.get(generation)
        if record is None and sandbox.dropped and sandbox.was_dropped(generation):
            record = sandbox.assignments[generation] = self._past(sandbox)
        return record

    def _as_past(self, sandbox: SandboxState, record: dict[str, Any]) -> bool:
        """Whether :meth:`_past` gives back this record of a generation being left."""
        return (
            record["state"] == STATE_RELEASED
            and record["runner_id"] == sandbox.home_runner_id
            and sandbox.pinned is not None
            and record["capacity"] == self._shared(sandbox.pinned.capacity.as_dict())
        )

    def _past(self, sandbox: SandboxState) -> dict[str, Any]:
        """A past generation's record as :meth:`_compacted` keeps it, for one released on
        its home runner with its pinned capacity (what :meth:`_as_past` dropped)."""
        assert sandbox.pinned is not None
        capacity = self._shared(sandbox.pinned.capacity.as_dict())
        return {
            "state": STATE_RELEASED,
            "runner_id": sandbox.home_runner_id,
            "capacity": capacity,
            "revision": 0,
        }

    def _shared(self, capacity: dict[str, int]) -> dict[str, int]:
        key = tuple(capacity.items())
        shared = self._capacities.get(key)
        if shared is None:
            shared = self._capacities[key] = dict(capacity)
        return shared

    def _compacted(self, record: dict[str, Any]) -> dict[str, Any]:
        """What a later event of a past generation is checked against: its state, runner
        and capacity (a repeated release, an update of it); the revision, which updates
        count. The runner id and the capacity are shared between records."""
        return {
            "state": record["state"],
            "runner_id": intern(record["runner_id"]),
            "capacity": self._shared(record["capacity"]),
            "revision": record["revision"],
        }

    # -- updates of an assignment (one handler per event class) ---------------

    def _assignment(self, event: Any) -> dict[str, Any] | None:
        """The assignment record an update names by its generation; None, reported,
        when the sandbox was never created or the generation never fenced."""
        sandbox = self._sandbox(event)
        generation = getattr(event, "generation", None)
        if sandbox is None or generation is None:
            return None
        record = self._record(sandbox, generation)
        if record is None:
            self._violate("history", f"{type(event).__name__} of unfenced generation {generation}")
        return record

    def _running(self, event: Any) -> None:
        record = self._assignment(event)
        if record is not None:
            self._touch(record, event, state=STATE_RUNNING)

    def _failed(self, event: Any) -> None:
        record = self._assignment(event)
        if record is not None:
            self._touch(
                record,
                event,
                state=event.state,
                failure_class=event.failure_class,
                retry_count=event.retry_count,
            )

    def _uncertain(self, event: Any) -> None:
        record = self._assignment(event)
        if record is not None:
            self._touch(record, event, state=STATE_UNCERTAIN)

    def _reconcile_claimed(self, event: Any) -> None:
        record = self._assignment(event)
        if record is not None:
            self._touch(
                record,
                event,
                reconcile_owner=event.owner,
                reconcile_claim_expires_at=event.until,
            )

    def _reconcile_claim_released(self, event: Any) -> None:
        record = self._assignment(event)
        if record is not None:
            self._touch(record, event, reconcile_owner="", reconcile_claim_expires_at=None)

    def _reconcile_scheduled(self, event: Any) -> None:
        record = self._assignment(event)
        if record is not None:
            self._touch(
                record,
                event,
                next_reconcile_at=event.next_reconcile_at,
                operation_deadline=event.operation_deadline,
            )

    def _touch(self, record: dict[str, Any], event: Any, **changes: Any) -> None:
        record.update(changes)
        record["revision"] += 1
        record["updated_at"] = event.timestamp

    def _refused(self, event: Any) -> None:
        if self.compact:  # audit verify: no check reads the refusals kept
            return
        self.refusals.setdefault(str(event.originator_id), []).append(
            {"position": self.position, **{k: getattr(event, k) for k in (
                "operation", "generation", "error", "summary", "decided_at",
                "heartbeat_timeout_seconds", "candidates")}}
        )  # fmt: skip
