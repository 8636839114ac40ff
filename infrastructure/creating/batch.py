"""Creating a batch of sandboxes: one catch-up, one home search per requirements, one
commit.

``create_sandbox`` (through :class:`~.batcher.CreateBatcher`) comes here. A batch is
decided as its creations would be one by one, in their order, at one instant: the
sandboxes already recorded are answered from their records (the recorded home, or
``AlreadyExistsError``), then, if any is new, the application's clock is read once, the
runner snapshots read model is caught up once (the other views wait for their own next
query), and each new sandbox's home is chosen on the candidates
of its requirements (docs/spec.md, section 8.1: the read model's candidates, the
chosen runner checked against its aggregates, :mod:`..home_check`). A creation changes
no runner row (``Sandbox.Created`` is ignored by the runner snapshots projection), so
the creations before it in a serial execution would leave every candidate as it is:
creations of the same requirements and heartbeat timeout share one search and one
decision of the placement rules over its candidates (``HomeChoice``), and each records
exactly the home and the evidence its own call would at that instant. The
batcher never puts two creations of one sandbox id in one batch (the second waits for
the next, where it finds the first recorded).

The new sandboxes are then saved in one transaction, in request order; when another
replica created one of them first (the save fails on a stream version), each is saved
alone and the one that lost is answered from the rival's record, as a single creation
is. Refusals are recorded together, best effort, as the placement batch records its own
(:mod:`..refusal_recording`). Each sandbox's events and each refusal record their own
caller's actor (:mod:`..acting`), not the leader's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Protocol
from uuid import UUID

from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.actors import ActorRecord
from secondbox_scheduler.domain.command_inputs import as_requirements, require_timeout
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    PlacementError,
    SchedulerError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.placement.evidence import Unlisted
from secondbox_scheduler.domain.placement.home_choice import HomeChoice
from secondbox_scheduler.domain.placement.rules import PlacementDecision
from secondbox_scheduler.domain.refusals import OPERATION_CREATE, Refusal
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot, require_text
from secondbox_scheduler.infrastructure.acting import stamp


class RecordedHome(str):
    """The home of a sandbox found recorded with the call's fields: the answer of a
    creation that created nothing (a repeat, or a rival's creation first), equal to the
    home runner's id; a new sandbox's answer is a plain ``str``."""

    __slots__ = ()


# A creation's answer: the home runner's id (a RecordedHome for a sandbox found
# recorded), or the typed error its call raises.
Created = str | SchedulerError


@dataclass(frozen=True)
class CreateRequest:
    """One ``create_sandbox`` call, its arguments checked; ``actor``: who asked."""

    sandbox_id: str
    workspace_id: str
    profile_revision_id: str
    requirements: Requirements
    heartbeat_timeout: timedelta
    actor: ActorRecord | None = None

    @classmethod
    def checked(
        cls,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: Requirements | Mapping[str, Any],
        heartbeat_timeout: timedelta,
        actor: ActorRecord | None,
    ) -> CreateRequest:
        """The call's arguments checked (``InvalidRequestError`` naming the field)."""
        require_text("sandbox_id", sandbox_id)
        require_text("workspace_id", workspace_id)
        require_text("profile_revision_id", profile_revision_id)
        wanted = as_requirements(requirements)
        require_timeout(heartbeat_timeout)
        return cls(sandbox_id, workspace_id, profile_revision_id, wanted, heartbeat_timeout, actor)


class HomeSearch(Protocol):
    def runner_snapshots_now(self) -> Any: ...

    def home_decision(
        self,
        requirements: Requirements,
        now: datetime,
        heartbeat_timeout: timedelta,
        *,
        catch_up: bool = True,
    ) -> tuple[list[RunnerSnapshot], Unlisted, PlacementDecision | None]: ...


class CreationStore(Protocol):
    """What a creation batch needs of the application."""

    @property
    def queries(self) -> HomeSearch: ...

    def now(self) -> datetime: ...

    def load(self, aggregate_id: UUID, kind: type[Sandbox], *, copy: bool = True) -> Any: ...

    def load_many(
        self, aggregate_ids: Sequence[UUID], *, cache_new: bool = True
    ) -> dict[UUID, Any]: ...

    def save(self, *objs: Any) -> Any: ...

    def save_in_order(self, events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None: ...

    def record_refusals(self, refusals: Sequence[Refusal]) -> None: ...


def answer_existing(existing: Sandbox, request: CreateRequest) -> Created:
    """A sandbox already recorded: its home, or ``AlreadyExistsError`` when the call
    names another workspace, profile revision or requirements."""
    if (
        existing.workspace_id != request.workspace_id
        or existing.profile_revision_id != request.profile_revision_id
        or existing.requirements != request.requirements.to_record()
    ):
        return AlreadyExistsError(
            f"sandbox {request.sandbox_id!r} already exists with another workspace or "
            "profile revision"
        )
    return RecordedHome(existing.home_runner_id)


class CreateBatch:
    """Decides and commits one batch of checked creations (distinct sandbox ids)."""

    def __init__(self, store: CreationStore) -> None:
        self.store = store

    def run(self, requests: Sequence[CreateRequest]) -> list[Created]:
        """Every creation's answer, in order."""
        ids = [sandbox_uuid(request.sandbox_id) for request in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("a creation batch names one sandbox twice")
        if len(ids) == 1:  # a lone creation: the cached copy, as before batching
            existing = self.store.load(ids[0], Sandbox)
            found = {} if existing is None else {ids[0]: existing}
        else:
            found = self.store.load_many(ids, cache_new=False)
        outcomes: list[Created | None] = [None] * len(requests)
        new: list[int] = []
        for index, request in enumerate(requests):
            existing = found.get(ids[index])
            if isinstance(existing, Sandbox):
                outcomes[index] = answer_existing(existing, request)
            else:
                new.append(index)
        if new:
            self._create(requests, new, outcomes)
        assert all(outcome is not None for outcome in outcomes)
        return [outcome for outcome in outcomes if outcome is not None]

    def _create(
        self, requests: Sequence[CreateRequest], new: list[int], outcomes: list[Created | None]
    ) -> None:
        now = self.store.now()
        queries = self.store.queries
        queries.runner_snapshots_now()  # caught up once for the whole batch
        searched: list[tuple[Requirements, timedelta, HomeChoice]] = []
        sandboxes: dict[int, Sandbox] = {}
        refusals: list[Refusal] = []
        for index in new:
            request = requests[index]
            wanted, timeout = request.requirements, request.heartbeat_timeout
            try:
                choice = next((c for r, t, c in searched if t == timeout and r == wanted), None)
                if choice is None:  # one search and one decision per requirements
                    runners, unlisted, decision = queries.home_decision(
                        wanted, now, timeout, catch_up=False
                    )  # the home check's decision over the runners, when it made one
                    choice = (
                        HomeChoice.decided(wanted, runners, now, timeout, unlisted)
                        if decision is None
                        else HomeChoice(wanted, decision, now, timeout)
                    )
                    searched.append((wanted, timeout, choice))
                sandbox = Sandbox.create_at_home(
                    sandbox_id=request.sandbox_id,
                    workspace_id=request.workspace_id,
                    profile_revision_id=request.profile_revision_id,
                    requirements=wanted,
                    choice=choice,
                )
            except PlacementError as error:
                refusals.append(
                    Refusal(
                        request.sandbox_id, OPERATION_CREATE, 0, error, now, timeout, wanted,
                        request.actor,
                    )
                )  # fmt: skip
                outcomes[index] = error
                continue
            sandboxes[index] = sandbox
        if refusals:
            self.store.record_refusals(refusals)  # best effort: never changes a refusal
        self._save(requests, sandboxes, outcomes)

    def _save(
        self,
        requests: Sequence[CreateRequest],
        sandboxes: dict[int, Sandbox],
        outcomes: list[Created | None],
    ) -> None:
        """One transaction for every new sandbox; a lost race: each alone."""
        if len(sandboxes) == 1:  # a lone creation: saved as before batching
            ((index, sandbox),) = sandboxes.items()
            stamp(sandbox.pending_events, requests[index].actor)
            outcomes[index] = self._saved(
                requests[index], sandbox, partial(self.store.save, sandbox)
            )
            return
        events: dict[int, list[Any]] = {}
        for index, sandbox in sandboxes.items():
            events[index] = list(sandbox.collect_events())
            stamp(events[index], requests[index].actor)  # its own caller's, in a batch
        try:
            self.store.save_in_order(
                [event for index in sandboxes for event in events[index]],
                list(sandboxes.values()),
            )
        except IntegrityError:
            pass  # another replica created one of them first: each alone
        else:
            for index, sandbox in sandboxes.items():
                outcomes[index] = sandbox.home_runner_id
            return
        for index, sandbox in sandboxes.items():
            saving = partial(self.store.save_in_order, events[index], [sandbox])
            outcomes[index] = self._saved(requests[index], sandbox, saving)

    def _saved(self, request: CreateRequest, sandbox: Sandbox, save: Callable[[], Any]) -> Created:
        """The answer once ``save`` stored the sandbox, or lost its stream to a rival's."""
        try:
            save()
        except IntegrityError:
            existing = self.store.load(sandbox_uuid(request.sandbox_id), Sandbox)
            if existing is None:  # a write timeout, not a rival's creation
                return SerializationContentionError(1, f"sandbox {request.sandbox_id!r}")
            return answer_existing(existing, request)
        return sandbox.home_runner_id
