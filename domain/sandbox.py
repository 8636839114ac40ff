"""The Sandbox aggregate: durable intent, its home runner and fenced assignments.

One assignment per generation (invariant 3), fenced only on the home runner and only
when the runner is compatible by the evidence recorded with the decision (4); a
fencing token never repeats for one sandbox (3: with the fence comes a
:class:`~.fencing_tokens.FencingTokenUse`, saved in the same transaction); capacity is
released once, with proof (6). Every runner-facing command checks generation and
fencing token first and raises :class:`StaleFenceError` before changing anything.

The state is bounded: the current generation's assignment, not every past one (past
generations stay in the events and the assignments read model; :mod:`.assignment_history`
folds them). Class version 2; version 1 (release 0.1) kept every assignment and token,
and its snapshots are upcast.
"""

from __future__ import annotations

import copy
import hmac
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Unpack, cast

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.actors import ActedEvent, actor_unknown
from secondbox_scheduler.domain.assignment import (
    CAN_FAIL,
    STATE_ASSIGNED,
    STATE_FAILED,
    STATE_RELEASED,
    STATE_RUNNING,
    STATE_UNCERTAIN,
    TRANSIENT_FAILURES,
    AssignmentRecord,
    AssignmentUpdate,
    new_assignment_record,
    require_failure_class,
)
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    AssignmentNotFoundError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    InvalidTransitionError,
    ProfileRevisionMismatchError,
    ReconcileClaimError,
    ReleaseProofError,
    StaleFenceError,
)
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.placement.evidence import (
    HomeDecisionRecord,
    PlacementRecord,
    Unlisted,
    decision_record,
)
from secondbox_scheduler.domain.placement.home_choice import HomeChoice
from secondbox_scheduler.domain.placement.rules import (
    RULES_VERSION,
    passes_every_rule,
    refusal,
    select_home_runner,
)
from secondbox_scheduler.domain.reconcile import (
    ACTION_DEADLINE_EXCEEDED,
    ACTION_NONE,
    ACTION_UNCERTAIN,
    ACTIONS,
)
from secondbox_scheduler.domain.records import RequirementsRecord, RunnerSnapshotRecord
from secondbox_scheduler.domain.values import (
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
    requirements_record,
)

TOKEN_REUSED = "must differ from every earlier token of this sandbox"


class Sandbox(Aggregate):
    """A sandbox's pinned profile revision, home runner and current assignment."""

    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class_version = 2

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        """Release 0.1 kept every generation's assignment, token and operation window:
        keep the current generation's, the tokens as legacy ones (0.1 had no index)."""
        assignments = state.pop("assignments", {})
        windows = state.pop("operation_windows", {})
        generation = str(state["generation"])
        state["current"] = assignments.get(generation)
        state["operation_window_seconds"] = windows.get(generation, 0.0)
        state["legacy_tokens"] = list(state.pop("fencing_tokens", []))

    class Created(Aggregate.Created):
        sandbox_id: str
        workspace_id: str
        profile_revision_id: str
        requirements: RequirementsRecord
        home_runner_id: str
        home_decision: HomeDecisionRecord

    def __init__(
        self,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: RequirementsRecord,
        home_runner_id: str,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.workspace_id = workspace_id
        self.profile_revision_id = profile_revision_id
        self.requirements = requirements
        self.home_runner_id = home_runner_id
        self.generation = 1
        self.current: AssignmentRecord | None = None  # the current generation's assignment
        self.operation_window_seconds = 0.0  # its first deadline - created
        self.legacy_tokens: list[str] = []  # tokens fenced before the token index (0.1)

    @classmethod
    def create(
        cls,
        *,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: Requirements,
        runners: Sequence[RunnerSnapshot],
        now: datetime,
        heartbeat_timeout: timedelta,
        unlisted: Unlisted | None = None,
    ) -> Sandbox:
        """Choose the home runner as ``select_runner`` would, and record why.

        ``runners``: the candidates a store's prefilter let through (or the whole pool);
        ``unlisted`` counts the pool's others (:class:`domain.placement.Unlisted`). The
        evidence is bounded: the chosen runner, a few per combination of reasons, counts.
        """
        choice = HomeChoice.decided(requirements, runners, now, heartbeat_timeout, unlisted)
        return cls.create_at_home(
            sandbox_id=sandbox_id,
            workspace_id=workspace_id,
            profile_revision_id=profile_revision_id,
            requirements=requirements,
            choice=choice,
        )

    @classmethod
    def create_at_home(
        cls,
        *,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: Requirements,
        choice: HomeChoice,
    ) -> Sandbox:
        """:meth:`create` with its home decision already made and shared
        (:mod:`.placement.home_choice`), recording what :meth:`create` would. ``choice``
        must be for these ``requirements``; a refused one raises its refusal."""
        if choice.requirements != requirements:
            raise ValueError("a home choice decided for other requirements")
        decision = choice.decision
        if decision.chosen is None:
            raise refusal(decision)
        return cls._create(
            cls.Created,
            id=sandbox_uuid(sandbox_id),
            timestamp=choice.now,
            sandbox_id=sandbox_id,
            workspace_id=workspace_id,
            profile_revision_id=profile_revision_id,
            requirements=requirements.to_record(),
            home_runner_id=decision.chosen.id,
            home_decision=choice.record(),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Sandbox:
        """The copy a command works on (the repository copies cached aggregates).
        Events replace the records' values, so the copy shares them and copies only
        what events change in place: the current record (``_touch``), the legacy tokens.
        """
        clone = copy.copy(self)
        clone.current = None if self.current is None else self.current.copy()
        clone.legacy_tokens = list(self.legacy_tokens)
        clone._pending_events = list(self._pending_events)
        memo[id(self)] = clone
        return clone

    # -- events ---------------------------------------------------------------

    class AssignmentFenced(Aggregate.Event):
        assignment: AssignmentRecord
        placement: PlacementRecord
        token_indexed: bool = False  # a FencingTokenUse was saved with it (version 2)

        class_version = 3  # 2: token_indexed; 3: the actor (domain/actors.py)

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            """Release 0.1 saved no token index with a fence, and placed by the rules of
            version 1 (``placement.evaluate_runner``)."""
            state["token_indexed"] = False
            state["placement"] = {**state["placement"], "rules_version": 1}

        upcast_v2_v3 = staticmethod(actor_unknown)  # written before 0.3: actor unknown

        def apply(self, sandbox: Sandbox) -> None:
            record = self.assignment.copy()
            sandbox.current = record
            sandbox.operation_window_seconds = 0.0
            if record["operation_deadline"] is not None:
                window = record["operation_deadline"] - record["created_at"]
                sandbox.operation_window_seconds = window.total_seconds()
            if not self.token_indexed:
                sandbox.legacy_tokens.append(record["fencing_token"])

    class AssignmentRunning(Aggregate.Event):
        generation: int

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(self.generation, self.timestamp, state=STATE_RUNNING)

    class AssignmentReleased(Aggregate.Event):
        generation: int
        release_proof: dict[str, str]

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(
                self.generation,
                self.timestamp,
                state=STATE_RELEASED,
                release_proof=dict(self.release_proof),
            )

    class AssignmentFailed(Aggregate.Event):
        generation: int
        failure_class: str
        retry_count: int
        state: str

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(
                self.generation,
                self.timestamp,
                state=self.state,
                failure_class=self.failure_class,
                retry_count=self.retry_count,
            )

    class ReconcileClaimed(Aggregate.Event):
        generation: int
        owner: str
        until: datetime

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(
                self.generation,
                self.timestamp,
                reconcile_owner=self.owner,
                reconcile_claim_expires_at=self.until,
            )

    class ReconcileClaimReleased(Aggregate.Event):
        generation: int
        owner: str

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(
                self.generation,
                self.timestamp,
                reconcile_owner="",
                reconcile_claim_expires_at=None,
            )

    class AssignmentUncertain(Aggregate.Event):
        generation: int
        owner: str
        reason: str

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(self.generation, self.timestamp, state=STATE_UNCERTAIN)

    class ReconcileScheduled(Aggregate.Event):
        generation: int
        owner: str
        next_reconcile_at: datetime | None
        operation_deadline: datetime | None

        def apply(self, sandbox: Sandbox) -> None:
            sandbox._touch(
                self.generation,
                self.timestamp,
                next_reconcile_at=self.next_reconcile_at,
                operation_deadline=self.operation_deadline,
            )

    class GenerationAdvanced(Aggregate.Event):
        generation: int

        def apply(self, sandbox: Sandbox) -> None:
            sandbox.generation = self.generation
            sandbox.current = None
            sandbox.operation_window_seconds = 0.0

    def _touch(self, generation: int, at: datetime, /, **changes: Unpack[AssignmentUpdate]) -> None:
        record = self.current
        assert record is not None
        assert record["generation"] == generation
        record.update(changes)
        record["revision"] += 1
        record["updated_at"] = at

    # -- queries --------------------------------------------------------------

    def operation_window(self) -> timedelta:
        """The current assignment's operation window (its first deadline - created)."""
        return timedelta(seconds=self.operation_window_seconds)

    def assignment(self, generation: int | None = None) -> AssignmentRecord | None:
        """The current generation's assignment (None for another generation: past ones
        are in the events, see :mod:`.assignment_history`)."""
        if generation is not None and generation != self.generation:
            return None
        return self.current

    # -- commands -------------------------------------------------------------

    def check_pinned(self, request: ScheduleRequest) -> None:
        """docs/spec.md (section 6) step 2: same workspace, same immutable ProfileRevision."""
        if request.workspace_id != self.workspace_id:
            raise ProfileRevisionMismatchError(
                f"sandbox {self.sandbox_id!r} belongs to workspace {self.workspace_id!r}, "
                f"not {request.workspace_id!r}"
            )
        if request.profile_revision_id != self.profile_revision_id:
            raise ProfileRevisionMismatchError(
                f"sandbox {self.sandbox_id!r} pins {self.profile_revision_id!r}, "
                f"not {request.profile_revision_id!r}"
            )
        if requirements_record(request.requirements) != self.requirements:
            raise ProfileRevisionMismatchError(
                f"requirements differ from those pinned by {self.profile_revision_id!r}"
            )
        if not self.home_runner_id:
            raise HomeRunnerUnavailableError((), "sandbox has no home runner")

    def fence(
        self,
        request: ScheduleRequest,
        runner: RunnerSnapshot,
        *,
        runner_version: int,
        lease_version: int,
        attempt: int,
        clock: datetime,
    ) -> tuple[AssignmentRecord, FencingTokenUse]:
        """Fence this generation's assignment on the home runner, or refuse: the record
        and the token's use, saved with this sandbox (an earlier generation's token
        collides with its stream). ``clock``: the application's, recorded beside."""
        self.check_pinned(request)
        if self.current is not None:
            raise AlreadyExistsError(
                f"sandbox {self.sandbox_id!r} generation {self.generation} is already assigned"
            )
        token = request.fencing_token.hex()
        if token in self.legacy_tokens:
            raise InvalidRequestError("fencing_token", TOKEN_REUSED)
        assert request.now is not None
        # check_pinned found the request's requirements equal to the pinned record: the
        # request's value is the pinned one (a record parses back to its value)
        requirements = request.requirements
        # the home runner passing every rule in one go is what the rules' evaluation of
        # it would find (``passes_every_rule``); anything else, they name its failures
        if not (
            runner.id == self.home_runner_id
            and passes_every_rule(requirements, runner, request.now, request.heartbeat_timeout)
        ):
            select_home_runner(
                self.home_runner_id, requirements, [runner], request.now, request.heartbeat_timeout
            )
        record = new_assignment_record(request, runner, self.generation, request.now)
        placement: PlacementRecord = {
            **decision_record(
                request.now,
                request.heartbeat_timeout,
                runner.id,
                [{"runner_id": runner.id, "failures": []}],
            ),
            "home_runner_id": self.home_runner_id,
            "runner": cast(RunnerSnapshotRecord, runner.to_record()),
            "runner_version": runner_version,
            "lease_version": lease_version,
            "requested": requirements.capacity.as_dict(),
            "attempt": attempt,
            "clock": clock,
            "rules_version": RULES_VERSION,
        }
        self.trigger_event(
            self.AssignmentFenced,
            timestamp=request.now,
            assignment=record,
            placement=placement,
            token_indexed=True,
        )
        use = FencingTokenUse.use(
            sandbox_id=self.sandbox_id, generation=self.generation, token_hex=token, at=request.now
        )
        return record, use

    def _current(self, generation: int) -> AssignmentRecord:
        if generation != self.generation:
            raise StaleFenceError(
                f"sandbox {self.sandbox_id!r} generation {generation} is not the current "
                f"generation {self.generation}"
            )
        record = self.assignment(generation)
        if record is None:
            raise AssignmentNotFoundError(
                f"{self.sandbox_id}#{generation}", "this generation has not been scheduled"
            )
        return record

    def _fenced(self, generation: int, fencing_token: bytes) -> AssignmentRecord:
        record = self._current(generation)
        if not hmac.compare_digest(record["fencing_token"], fencing_token.hex()):
            raise StaleFenceError(
                f"sandbox {self.sandbox_id!r} generation {generation}: fencing token does not match"
            )
        return record

    def mark_running(self, generation: int, fencing_token: bytes, at: datetime) -> bool:
        """The runner reports the compute running (also ends ``uncertain``)."""
        record = self._fenced(generation, fencing_token)
        if record["state"] == STATE_RUNNING:
            return False
        if record["state"] not in (STATE_ASSIGNED, STATE_UNCERTAIN):
            raise InvalidTransitionError(
                f"assignment {record['id']!r} is {record['state']}, not {STATE_ASSIGNED}"
            )
        self.trigger_event(self.AssignmentRunning, timestamp=at, generation=generation)
        return True

    def release(
        self,
        generation: int,
        fencing_token: bytes,
        release_proof: Mapping[str, str],
        at: datetime,
    ) -> AssignmentRecord | None:
        """Record the release; the record to free on the runner, or None for a repeat."""
        record = self._fenced(generation, fencing_token)
        if not release_proof:
            raise InvalidRequestError("release_proof", "must not be empty")
        if record["state"] == STATE_RELEASED:
            if record["release_proof"] == dict(release_proof):
                return None
            raise ReleaseProofError(
                f"assignment {record['id']!r} was already released with another proof"
            )
        self.trigger_event(
            self.AssignmentReleased,
            timestamp=at,
            generation=generation,
            release_proof=dict(release_proof),
        )
        return record

    def fail(
        self, generation: int, fencing_token: bytes, failure_class: str, at: datetime
    ) -> AssignmentRecord:
        """Count a failure: transient ones retry within retry_limit, others are terminal."""
        record = self._fenced(generation, fencing_token)
        require_failure_class(failure_class)
        if record["state"] not in CAN_FAIL:
            raise InvalidTransitionError(
                f"assignment {record['id']!r} is {record['state']} and cannot fail"
            )
        retry = (
            failure_class in TRANSIENT_FAILURES and record["retry_count"] < record["retry_limit"]
        )
        self.trigger_event(
            self.AssignmentFailed,
            timestamp=at,
            generation=generation,
            failure_class=failure_class,
            retry_count=record["retry_count"] + 1 if retry else record["retry_count"],
            state=STATE_ASSIGNED if retry else STATE_FAILED,
        )
        return record

    def claim_reconcile(self, generation: int, owner: str, until: datetime, now: datetime) -> bool:
        """Claim reconciliation; False if another owner holds an unexpired claim."""
        record = self._current(generation)
        holder = record["reconcile_owner"]
        expires = record["reconcile_claim_expires_at"]
        if holder and holder != owner and expires is not None and expires > now:
            return False
        if holder == owner and expires == until and until > now:
            return True
        if until <= now:
            raise InvalidRequestError("until", "must be later than now")
        self.trigger_event(
            self.ReconcileClaimed, timestamp=now, generation=generation, owner=owner, until=until
        )
        return True

    def _claimed(self, generation: int, owner: str, at: datetime) -> AssignmentRecord:
        record = self._current(generation)
        expires = record["reconcile_claim_expires_at"]
        if record["reconcile_owner"] != owner or expires is None or expires <= at:
            raise ReconcileClaimError(
                f"{owner!r} holds no current reconcile claim on sandbox {self.sandbox_id!r} "
                f"generation {generation} (held by {record['reconcile_owner'] or 'nobody'!r} "
                f"until {expires.isoformat() if expires else '-'})"
            )
        return record

    def reconcile(
        self,
        generation: int,
        owner: str,
        action: str,
        reason: str,
        next_reconcile_at: datetime | None,
        at: datetime,
    ) -> None:
        """Commit one reconcile result; only while ``owner``'s claim is current."""
        record = self._claimed(generation, owner, at)
        deadline = record["operation_deadline"]
        if action == ACTION_DEADLINE_EXCEEDED:
            if record["state"] != STATE_ASSIGNED:
                raise InvalidTransitionError(
                    f"assignment {record['id']!r} is {record['state']}, not {STATE_ASSIGNED}"
                )
            retry = record["retry_count"] < record["retry_limit"]
            self.trigger_event(
                self.AssignmentFailed,
                timestamp=at,
                generation=generation,
                failure_class=ACTION_DEADLINE_EXCEEDED,
                retry_count=record["retry_count"] + 1 if retry else record["retry_count"],
                state=STATE_ASSIGNED if retry else STATE_FAILED,
            )
            if retry and deadline is not None:  # redelivery gets a fresh operation window
                deadline = at + self.operation_window()
        elif action == ACTION_UNCERTAIN:
            if record["state"] not in (STATE_ASSIGNED, STATE_RUNNING):
                raise InvalidTransitionError(
                    f"assignment {record['id']!r} is {record['state']} and cannot become uncertain"
                )
            self.trigger_event(
                self.AssignmentUncertain,
                timestamp=at,
                generation=generation,
                owner=owner,
                reason=reason,
            )
        elif action != ACTION_NONE:
            raise InvalidRequestError("action", f"must be one of {list(ACTIONS)}", action)
        if (
            next_reconcile_at != record["next_reconcile_at"]
            or deadline != record["operation_deadline"]
        ):
            self.trigger_event(
                self.ReconcileScheduled,
                timestamp=at,
                generation=generation,
                owner=owner,
                next_reconcile_at=next_reconcile_at,
                operation_deadline=deadline,
            )

    def release_reconcile_claim(self, generation: int, owner: str, at: datetime) -> bool:
        record = self._current(generation)
        if record["reconcile_owner"] != owner:
            return False
        self.trigger_event(
            self.ReconcileClaimReleased, timestamp=at, generation=generation, owner=owner
        )
        return True

    def advance_generation(self, generation: int, at: datetime) -> int:
        """Move to generation + 1; only once this generation's assignment is released."""
        record = self._current(generation)
        if record["state"] != STATE_RELEASED:
            raise InvalidTransitionError(
                f"assignment {record['id']!r} is {record['state']}; advance the generation "
                "only after release"
            )
        self.trigger_event(self.GenerationAdvanced, timestamp=at, generation=generation + 1)
        return generation + 1
