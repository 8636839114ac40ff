"""The Runner aggregate's own guards, with nothing in front of it (no placement rule, no
application): every refusal of docs/spec.md (section 4) and the invariants it keeps (section 7:
1 reserved <= allocatable, 2 reserved = sum of reservations, 5 nothing on a draining or
deregistered runner, 6 one release, only with proof). A refused command raises its
typed error and records nothing: same version, no pending event."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from secondbox_scheduler.domain import Capacity, InvalidRequestError
from secondbox_scheduler.domain.errors import (
    CapacityExceededError,
    ConflictError,
    RunnerUnavailableError,
)
from secondbox_scheduler.domain.runner import Runner
from tests.aggregates import (
    CAPABILITIES,
    PHYSICAL_STORAGE,
    PROOF,
    REQUEST,
    T0,
    free,
    new_lease,
    new_runner,
    one,
    slots,
    unchanged,
)

DIMENSIONS = Capacity.DIMENSIONS
CHECKED_WITH_PHYSICAL_STORAGE = tuple(dim for dim in DIMENSIONS if dim != "disk_bytes")
LATER = T0 + timedelta(seconds=1)


def reserve(
    runner: Runner, sandbox_id: str, capacity: Capacity = REQUEST, generation: int = 1
) -> None:
    runner.reserve(
        assignment_id=f"a-{sandbox_id}-{generation}",
        sandbox_id=sandbox_id,
        generation=generation,
        capacity=capacity,
        at=LATER,
    )


def reserved(runner: Runner) -> dict[str, int]:
    return runner.snapshot(new_lease(runner.runner_id)).reserved.as_dict()


def test_register_refuses_an_inverted_guest_protocol_range() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        Runner.register(
            runner_id="r1", pool_name="p", backend_kind="firecracker", architecture="x86_64",
            capabilities=CAPABILITIES, allocatable=slots(1), guest_protocol_minimum=3,
            guest_protocol_maximum=2, supported_egress_contexts=(), at=T0,
        )  # fmt: skip
    assert raised.value.field == "guest_protocol_minimum"


def test_register_records_the_runner_as_given() -> None:
    runner = new_runner("r1", capabilities=["storage", "compute", "storage"], allocatable=slots(3))
    snapshot = runner.snapshot(new_lease("r1"))
    assert snapshot.id == "r1"
    assert snapshot.capabilities == frozenset({"storage", "compute"})
    assert snapshot.allocatable == slots(3)
    assert snapshot.reserved == Capacity()
    assert snapshot.drain_phase == "active"
    assert (snapshot.guest_protocol_minimum, snapshot.guest_protocol_maximum) == (1, 3)
    assert snapshot.supported_egress_contexts == ("default",)
    assert snapshot.last_heartbeat_at == T0
    (registered,) = runner.collect_events()
    assert isinstance(registered, Runner.Registered)
    assert registered.capabilities == ["compute", "storage"]


# -- reserve: invariant 1, on every dimension -----------------------------------------


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_reserve_refuses_one_unit_past_free_on_each_dimension(dim: str) -> None:
    runner = new_runner(allocatable=slots(2))
    reserve(runner, "s1")
    runner.collect_events()
    # what is left is exactly one REQUEST; ask for one more unit of ``dim`` only
    left = free(runner, new_lease())
    assert left == REQUEST.as_dict()
    before = unchanged(runner)
    with pytest.raises(CapacityExceededError) as raised:
        reserve(runner, "s2", one(dim, left[dim] + 1))
    assert dim in str(raised.value)
    assert unchanged(runner) == before
    assert reserved(runner) == REQUEST.as_dict()


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_reserve_accepts_exactly_what_is_free_on_each_dimension(dim: str) -> None:
    runner = new_runner(allocatable=slots(2))
    reserve(runner, "s1")
    left = free(runner, new_lease())
    reserve(runner, "s2", one(dim, left[dim]))
    assert reserved(runner)[dim] == REQUEST.as_dict()[dim] + left[dim]
    assert free(runner, new_lease())[dim] == 0


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_a_second_request_that_fits_allocatable_but_not_free_is_refused(dim: str) -> None:
    """free = allocatable - reserved: the check counts what is already reserved."""
    allocatable = slots(1, **{other: 10**6 for other in DIMENSIONS if other != dim})
    runner = new_runner(allocatable=allocatable)
    reserve(runner, "s1")
    before = unchanged(runner)
    with pytest.raises(CapacityExceededError):
        reserve(runner, "s2")
    assert unchanged(runner) == before


def test_disk_is_not_checked_with_physical_storage_admission() -> None:
    runner = new_runner(capabilities=(*CAPABILITIES, PHYSICAL_STORAGE), allocatable=slots(1))
    reserve(runner, "s1", one("disk_bytes", 10**9))
    assert reserved(runner)["disk_bytes"] == 10**9
    assert free(runner, new_lease())["disk_bytes"] < 0


@pytest.mark.parametrize("dim", CHECKED_WITH_PHYSICAL_STORAGE)
def test_physical_storage_admission_still_checks_every_other_dimension(dim: str) -> None:
    runner = new_runner(capabilities=(*CAPABILITIES, PHYSICAL_STORAGE), allocatable=slots(1))
    before = unchanged(runner)
    with pytest.raises(CapacityExceededError):
        reserve(runner, "s1", one(dim, slots(1).as_dict()[dim] + 1))
    assert unchanged(runner) == before


def test_disk_is_checked_without_physical_storage_admission() -> None:
    runner = new_runner(allocatable=slots(1))
    with pytest.raises(CapacityExceededError):
        reserve(runner, "s1", one("disk_bytes", slots(1).disk_bytes + 1))


def test_the_refusal_names_every_short_dimension_and_its_shortfall() -> None:
    runner = new_runner(allocatable=slots(1))
    with pytest.raises(CapacityExceededError) as raised:
        reserve(runner, "s1", Capacity(vcpu_count=3, operations=9, instances=1))
    message = str(raised.value)
    assert "'vcpu_count': 1" in message
    assert "'operations': 2" in message
    assert "instances" not in message.split("short by")[1]


# -- reserve: invariant 5 and one reservation per sandbox generation -----------------


def test_reserve_refuses_a_draining_runner() -> None:
    runner = new_runner()
    assert runner.start_drain(LATER) is True
    before = unchanged(runner)
    with pytest.raises(RunnerUnavailableError, match="draining"):
        reserve(runner, "s1")
    assert unchanged(runner) == before


def test_reserve_after_a_cancelled_drain_is_accepted() -> None:
    runner = new_runner()
    runner.start_drain(LATER)
    assert runner.cancel_drain(LATER) is True
    reserve(runner, "s1")
    assert reserved(runner) == REQUEST.as_dict()


def test_reserve_refuses_a_deregistered_runner() -> None:
    runner = new_runner()
    runner.deregister(LATER)
    before = unchanged(runner)
    with pytest.raises(RunnerUnavailableError, match="deregistered"):
        reserve(runner, "s1")
    assert unchanged(runner) == before


def test_reserve_refuses_a_second_reservation_for_one_sandbox_generation() -> None:
    runner = new_runner(allocatable=slots(3))
    reserve(runner, "s1")
    before = unchanged(runner)
    with pytest.raises(ConflictError, match="already holds"):
        reserve(runner, "s1")
    assert unchanged(runner) == before
    reserve(runner, "s1", generation=2)  # another generation is another reservation
    assert reserved(runner) == slots(2).as_dict()


def test_reservations_add_up_on_every_dimension() -> None:
    runner = new_runner(allocatable=slots(3))
    reserve(runner, "s1")
    reserve(runner, "s2")
    assert reserved(runner) == slots(2).as_dict()
    events = runner.collect_events()
    reservations = [e for e in events if isinstance(e, Runner.CapacityReserved)]
    assert [(e.reservation, e.sandbox_id, e.generation) for e in reservations] == [
        ("s1#1", "s1", 1), ("s2#1", "s2", 1),
    ]  # fmt: skip
    assert all(e.capacity == REQUEST.as_dict() for e in reservations)
    assert reservations[0].assignment_id == "a-s1-1"


# -- release: invariant 6 ------------------------------------------------------------


def test_release_returns_the_reserved_capacity_once() -> None:
    runner = new_runner(allocatable=slots(2))
    reserve(runner, "s1")
    reserve(runner, "s2")
    runner.collect_events()
    runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=LATER)
    assert reserved(runner) == REQUEST.as_dict()
    (released,) = runner.collect_events()
    assert isinstance(released, Runner.CapacityReleased)
    assert (released.reservation, released.assignment_id) == ("s1#1", "a-s1-1")
    assert released.capacity == REQUEST.as_dict()
    assert released.release_proof == PROOF
    before = unchanged(runner)
    with pytest.raises(ConflictError, match="at most once"):
        runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=LATER)
    assert unchanged(runner) == before
    assert reserved(runner) == REQUEST.as_dict()


@pytest.mark.parametrize("proof", [{}, None])
def test_release_without_proof_is_refused(proof: dict[str, str] | None) -> None:
    runner = new_runner()
    reserve(runner, "s1")
    before = unchanged(runner)
    with pytest.raises(InvalidRequestError) as raised:
        runner.release(sandbox_id="s1", generation=1, release_proof=proof or {}, at=LATER)
    assert raised.value.field == "release_proof"
    assert unchanged(runner) == before
    assert reserved(runner) == REQUEST.as_dict()


def test_release_of_a_reservation_never_made_is_refused() -> None:
    runner = new_runner()
    reserve(runner, "s1")
    for sandbox_id, generation in (("s2", 1), ("s1", 2)):
        before = unchanged(runner)
        with pytest.raises(ConflictError):
            runner.release(sandbox_id=sandbox_id, generation=generation, release_proof=PROOF,
                           at=LATER)  # fmt: skip
        assert unchanged(runner) == before


def test_a_draining_runner_still_releases() -> None:
    runner = new_runner()
    reserve(runner, "s1")
    runner.start_drain(LATER)
    runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=LATER)
    assert reserved(runner) == Capacity().as_dict()


# -- drain, allocatable, deregistration ------------------------------------------------


def test_drain_and_cancel_record_only_changes() -> None:
    runner = new_runner()
    runner.collect_events()
    assert runner.cancel_drain(LATER) is False
    assert runner.start_drain(LATER) is True
    assert runner.start_drain(LATER) is False
    assert runner.snapshot(new_lease()).drain_phase == "draining"
    assert runner.cancel_drain(LATER) is True
    assert runner.snapshot(new_lease()).drain_phase == "active"
    assert [type(e).__name__ for e in runner.collect_events()] == [
        "DrainStarted", "DrainCancelled",
    ]  # fmt: skip


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_allocatable_below_reserved_is_refused_on_each_dimension(dim: str) -> None:
    runner = new_runner(allocatable=slots(2))
    reserve(runner, "s1")
    wanted = slots(2).as_dict()
    wanted[dim] = REQUEST.as_dict()[dim] - 1
    before = unchanged(runner)
    with pytest.raises(CapacityExceededError) as raised:
        runner.change_allocatable(Capacity(**wanted), LATER)
    assert f"'{dim}': 1" in str(raised.value)
    assert unchanged(runner) == before
    assert runner.snapshot(new_lease()).allocatable == slots(2)


@pytest.mark.parametrize("dim", DIMENSIONS)
def test_allocatable_down_to_exactly_reserved_is_accepted(dim: str) -> None:
    runner = new_runner(allocatable=slots(2))
    reserve(runner, "s1")
    wanted = slots(2).as_dict()
    wanted[dim] = REQUEST.as_dict()[dim]
    assert runner.change_allocatable(Capacity(**wanted), LATER) is True
    assert runner.snapshot(new_lease()).allocatable.as_dict() == wanted
    assert free(runner, new_lease())[dim] == 0


def test_allocatable_disk_below_reserved_is_accepted_with_physical_storage_admission() -> None:
    runner = new_runner(capabilities=(*CAPABILITIES, PHYSICAL_STORAGE), allocatable=slots(2))
    reserve(runner, "s1")
    assert runner.change_allocatable(slots(2, disk_bytes=-slots(2).disk_bytes), LATER) is True
    assert runner.snapshot(new_lease()).allocatable.disk_bytes == 0


def test_an_unchanged_allocatable_records_nothing() -> None:
    runner = new_runner(allocatable=slots(2))
    before = unchanged(runner)
    assert runner.change_allocatable(slots(2), LATER) is False
    assert unchanged(runner) == before
    assert runner.change_allocatable(slots(3), LATER) is True
    assert runner.snapshot(new_lease()).allocatable == slots(3)


def test_deregistration_is_refused_while_anything_is_reserved() -> None:
    runner = new_runner()
    reserve(runner, "s1")
    before = unchanged(runner)
    with pytest.raises(ConflictError, match="1 reservation"):
        runner.deregister(LATER)
    assert unchanged(runner) == before
    runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=LATER)
    runner.deregister(LATER)
    assert isinstance(runner.collect_events()[-1], Runner.Deregistered)


@pytest.mark.parametrize(
    "command",
    ["start_drain", "cancel_drain", "change_allocatable", "deregister"],
)
def test_a_deregistered_runner_refuses_every_command(command: str) -> None:
    runner = new_runner()
    if command == "cancel_drain":
        runner.start_drain(LATER)
    runner.deregister(LATER)
    before = unchanged(runner)
    calls: dict[str, Callable[[], object]] = {
        "start_drain": lambda: runner.start_drain(LATER),
        "cancel_drain": lambda: runner.cancel_drain(LATER),
        "change_allocatable": lambda: runner.change_allocatable(slots(5), LATER),
        "deregister": lambda: runner.deregister(LATER),
    }
    with pytest.raises(RunnerUnavailableError, match="deregistered"):
        calls[command]()
    assert unchanged(runner) == before


def test_every_event_carries_the_time_of_its_command() -> None:
    runner = new_runner()
    registered = runner.collect_events()
    assert [e.timestamp for e in registered] == [T0]
    times = iter(T0 + timedelta(seconds=n) for n in range(1, 10))
    reserve(runner, "s1")
    runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=next(times))
    runner.start_drain(next(times))
    runner.cancel_drain(next(times))
    runner.change_allocatable(slots(5), next(times))
    runner.deregister(next(times))
    events = runner.collect_events()
    assert [type(e).__name__ for e in events] == [
        "CapacityReserved", "CapacityReleased", "DrainStarted", "DrainCancelled",
        "AllocatableChanged", "Deregistered",
    ]  # fmt: skip
    assert [e.timestamp for e in events] == [LATER] + [
        T0 + timedelta(seconds=n) for n in range(1, 6)
    ]
