"""The Runner aggregate: a host's registration, drain phase and capacity ledger.

The aggregate refuses, by itself, every change that would break docs/spec.md (section 7):
a reservation past allocatable on a checked dimension (invariant 1), one that would make
any dimension's reserved total pass ``MAX_RESERVED_TOTAL`` (domain/limits.py), a reservation
on a draining or deregistered runner (5), a second release of one reservation or a
release without proof (6), allocatable below what is reserved, deregistration while
anything is reserved. ``reserved`` is always the sum of ``reservations`` (2).

Liveness and artifact evidence live in the runner's lease stream
(:mod:`domain.lease`), so heartbeats never contend with placements.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypedDict

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.actors import ActedEvent
from secondbox_scheduler.domain.errors import (
    CapacityExceededError,
    ConflictError,
    InvalidRequestError,
    ReservedTotalExceededError,
    RunnerUnavailableError,
)
from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.lease import RunnerLease, materialization_snapshots
from secondbox_scheduler.domain.limits import MAX_RESERVED_TOTAL
from secondbox_scheduler.domain.placement.rules import (
    capacity_shortfall,
    checked_dimensions,
    reserved_total_overflow,
)
from secondbox_scheduler.domain.records import MaterializationRecord
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    RunnerSnapshot,
    trusted,
)


def reservation_key(sandbox_id: str, generation: int) -> str:
    """One reservation per (sandbox, generation): invariant 3 makes this unique."""
    return f"{sandbox_id}#{generation}"


class ReservationRecord(TypedDict):
    """One active reservation as the Runner keeps it (``Runner.reservations``, by
    :func:`reservation_key`), from its ``CapacityReserved`` event."""

    assignment_id: str
    sandbox_id: str
    generation: int
    capacity: dict[str, int]  # Capacity.as_dict()


class Runner(Aggregate):
    """A host that runs sandbox compute, as the scheduler's capacity authority sees it."""

    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class Registered(Aggregate.Created):
        runner_id: str
        pool_name: str
        backend_kind: str
        architecture: str
        capabilities: list[str]
        allocatable: dict[str, int]
        guest_protocol_minimum: int
        guest_protocol_maximum: int
        supported_egress_contexts: list[str]

    def __init__(
        self,
        runner_id: str,
        pool_name: str,
        backend_kind: str,
        architecture: str,
        capabilities: list[str],
        allocatable: dict[str, int],
        guest_protocol_minimum: int,
        guest_protocol_maximum: int,
        supported_egress_contexts: list[str],
    ) -> None:
        self.runner_id = runner_id
        self.pool_name = pool_name
        self.backend_kind = backend_kind
        self.architecture = architecture
        self.capabilities = list(capabilities)
        self.allocatable = dict(allocatable)
        self.reserved = dict.fromkeys(Capacity.DIMENSIONS, 0)
        self.reservations: dict[str, ReservationRecord] = {}
        self.drain_phase = DRAIN_PHASE_ACTIVE
        self.deregistered = False
        self.guest_protocol_minimum = guest_protocol_minimum
        self.guest_protocol_maximum = guest_protocol_maximum
        self.supported_egress_contexts = list(supported_egress_contexts)

    @classmethod
    def register(
        cls,
        *,
        runner_id: str,
        pool_name: str,
        backend_kind: str,
        architecture: str,
        capabilities: Iterable[str],
        allocatable: Capacity,
        guest_protocol_minimum: int,
        guest_protocol_maximum: int,
        supported_egress_contexts: Iterable[str],
        at: datetime,
    ) -> Runner:
        if guest_protocol_minimum > guest_protocol_maximum:
            raise InvalidRequestError(
                "guest_protocol_minimum", "must not exceed guest_protocol_maximum"
            )
        return cls._create(
            cls.Registered,
            id=runner_uuid(runner_id),
            timestamp=at,
            runner_id=runner_id,
            pool_name=pool_name,
            backend_kind=backend_kind,
            architecture=architecture,
            capabilities=sorted(set(capabilities)),
            allocatable=allocatable.as_dict(),
            guest_protocol_minimum=guest_protocol_minimum,
            guest_protocol_maximum=guest_protocol_maximum,
            supported_egress_contexts=sorted(set(supported_egress_contexts)),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Runner:
        """The copy a command works on (the repository copies cached aggregates).

        Reservation records are never changed in place (CapacityReserved adds a new
        record, CapacityReleased deletes one), so the copy shares them and copies only
        the containers: a dict copy in C instead of a deep copy of every record, which
        made each placement on a runner cost O(active reservations) in Python.
        """
        clone = copy.copy(self)
        clone.reservations = dict(self.reservations)
        clone.reserved = dict(self.reserved)
        clone.allocatable = dict(self.allocatable)
        clone.capabilities = list(self.capabilities)
        clone.supported_egress_contexts = list(self.supported_egress_contexts)
        clone._pending_events = list(self._pending_events)
        memo[id(self)] = clone
        return clone

    # -- events ---------------------------------------------------------------

    class CapacityReserved(Aggregate.Event):
        reservation: str
        assignment_id: str
        sandbox_id: str
        generation: int
        capacity: dict[str, int]

        def apply(self, runner: Runner) -> None:
            runner.reservations[self.reservation] = {
                "assignment_id": self.assignment_id,
                "sandbox_id": self.sandbox_id,
                "generation": self.generation,
                "capacity": dict(self.capacity),
            }
            for dim, amount in self.capacity.items():
                runner.reserved[dim] += amount

    class CapacityReleased(Aggregate.Event):
        reservation: str
        assignment_id: str
        capacity: dict[str, int]
        release_proof: dict[str, str]

        def apply(self, runner: Runner) -> None:
            del runner.reservations[self.reservation]
            for dim, amount in self.capacity.items():
                runner.reserved[dim] -= amount

    class DrainStarted(Aggregate.Event):
        def apply(self, runner: Runner) -> None:
            runner.drain_phase = DRAIN_PHASE_DRAINING

    class DrainCancelled(Aggregate.Event):
        def apply(self, runner: Runner) -> None:
            runner.drain_phase = DRAIN_PHASE_ACTIVE

    class AllocatableChanged(Aggregate.Event):
        allocatable: dict[str, int]

        def apply(self, runner: Runner) -> None:
            runner.allocatable = dict(self.allocatable)

    class Deregistered(Aggregate.Event):
        def apply(self, runner: Runner) -> None:
            runner.deregistered = True

    # -- commands -------------------------------------------------------------

    def holds(self, sandbox_id: str, generation: int) -> bool:
        """Whether a reservation for this sandbox generation is active here."""
        return reservation_key(sandbox_id, generation) in self.reservations

    def _require_registered(self) -> None:
        if self.deregistered:
            raise RunnerUnavailableError(f"runner {self.runner_id!r} is deregistered")

    def reserve(
        self,
        *,
        assignment_id: str,
        sandbox_id: str,
        generation: int,
        capacity: Capacity,
        at: datetime,
    ) -> None:
        """Reserve ``capacity`` for one sandbox generation, or refuse."""
        self._require_registered()
        if self.drain_phase != DRAIN_PHASE_ACTIVE:
            raise RunnerUnavailableError(
                f"runner {self.runner_id!r} is {self.drain_phase} and takes no reservation"
            )
        key = reservation_key(sandbox_id, generation)
        if key in self.reservations:
            raise ConflictError(
                f"runner {self.runner_id!r} already holds a reservation for {key!r}"
            )
        requested = capacity.as_dict()
        for dim in reserved_total_overflow(self.reserved, requested):
            total = self.reserved[dim] + requested[dim]
            raise ReservedTotalExceededError(self.runner_id, dim, total, MAX_RESERVED_TOTAL)
        shortfall = capacity_shortfall(
            self.allocatable, self.reserved, requested, checked_dimensions(self.capabilities)
        )
        if shortfall:
            raise CapacityExceededError(
                f"runner {self.runner_id!r} cannot reserve {requested}: short by {shortfall}"
            )
        self.trigger_event(
            self.CapacityReserved,
            timestamp=at,
            reservation=key,
            assignment_id=assignment_id,
            sandbox_id=sandbox_id,
            generation=generation,
            capacity=requested,
        )

    def release(
        self,
        *,
        sandbox_id: str,
        generation: int,
        release_proof: Mapping[str, str],
        at: datetime,
    ) -> None:
        """Return one reservation's capacity, exactly once, and only with proof."""
        if not release_proof:
            raise InvalidRequestError("release_proof", "must not be empty")
        key = reservation_key(sandbox_id, generation)
        held = self.reservations.get(key)
        if held is None:
            raise ConflictError(
                f"runner {self.runner_id!r} holds no reservation for {key!r}: "
                "capacity is released at most once"
            )
        self.trigger_event(
            self.CapacityReleased,
            timestamp=at,
            reservation=key,
            assignment_id=held["assignment_id"],
            capacity=dict(held["capacity"]),
            release_proof=dict(release_proof),
        )

    def start_drain(self, at: datetime) -> bool:
        self._require_registered()
        if self.drain_phase == DRAIN_PHASE_DRAINING:
            return False
        self.trigger_event(self.DrainStarted, timestamp=at)
        return True

    def cancel_drain(self, at: datetime) -> bool:
        self._require_registered()
        if self.drain_phase == DRAIN_PHASE_ACTIVE:
            return False
        self.trigger_event(self.DrainCancelled, timestamp=at)
        return True

    def change_allocatable(self, allocatable: Capacity, at: datetime) -> bool:
        self._require_registered()
        wanted = allocatable.as_dict()
        if wanted == self.allocatable:
            return False
        below = {
            dim: self.reserved[dim] - wanted[dim]
            for dim in checked_dimensions(self.capabilities)
            if wanted[dim] < self.reserved[dim]
        }
        if below:
            raise CapacityExceededError(
                f"runner {self.runner_id!r}: allocatable {wanted} is below reserved "
                f"{self.reserved} by {below}"
            )
        self.trigger_event(self.AllocatableChanged, timestamp=at, allocatable=wanted)
        return True

    def deregister(self, at: datetime) -> None:
        self._require_registered()
        if self.reservations:
            raise ConflictError(
                f"runner {self.runner_id!r} still holds {len(self.reservations)} "
                "reservation(s); release them before deregistering"
            )
        self.trigger_event(self.Deregistered, timestamp=at)

    # -- views ----------------------------------------------------------------

    def snapshot(self, lease: RunnerLease) -> RunnerSnapshot:
        """The public view of this runner joined with its latest recorded liveness."""
        return runner_snapshot(self, lease)


class RunnerState(Protocol):
    """What a runner snapshot is built from: the Runner aggregate, or the audit fold's
    plain copy of it (``domain.audit.state.RunnerState``)."""

    runner_id: str
    pool_name: str
    backend_kind: str
    architecture: str
    capabilities: list[str]
    allocatable: dict[str, int]
    reserved: dict[str, int]
    drain_phase: str
    supported_egress_contexts: list[str]
    guest_protocol_minimum: int
    guest_protocol_maximum: int


class LeaseState(Protocol):
    """A runner's recorded liveness: the RunnerLease aggregate or the audit fold's copy
    (whose materializations are plain dicts of the same shape)."""

    last_heartbeat_at: datetime | None
    artifact_digests: list[str]

    @property
    def materializations(self) -> Sequence[MaterializationRecord | Mapping[str, str]]: ...


def runner_snapshot(runner: RunnerState, lease: LeaseState | None) -> RunnerSnapshot:
    """The one place a :class:`RunnerSnapshot` is built from runner state (trusted: no
    validation). The runner snapshots projection decodes its rows in
    ``projections.runner_snapshots.row_to_snapshot`` instead: a row is that projection's
    own column layout, not runner state."""
    return trusted(  # every field, in the model's order (``RunnerSnapshot.model_construct``)
        RunnerSnapshot,
        {
            "id": runner.runner_id,
            "pool_name": runner.pool_name,
            "backend_kind": runner.backend_kind,
            "architecture": runner.architecture,
            "capabilities": frozenset(runner.capabilities),
            "allocatable": Capacity.of(runner.allocatable),
            "reserved": Capacity.of(runner.reserved),
            "drain_phase": runner.drain_phase,
            "last_heartbeat_at": lease.last_heartbeat_at if lease else None,
            "artifact_digests": tuple(lease.artifact_digests) if lease else (),
            "materializations": (
                materialization_snapshots(lease.materializations) if lease else ()
            ),
            "supported_egress_contexts": tuple(runner.supported_egress_contexts),
            "guest_protocol_minimum": runner.guest_protocol_minimum,
            "guest_protocol_maximum": runner.guest_protocol_maximum,
        },
    )
