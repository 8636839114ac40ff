"""One world of a what-if replay: its runners, their leases, pools and reservations.

A :class:`Fleet` holds plain state (no aggregate) and keeps its pools' utilisation
(:class:`~.usage.PoolUsage`). The replay keeps two: the recorded fleet (the
reservations as the log has them) and the counterfactual one, whose reservations the
replay's own decisions make. Rules the aggregates enforce hold here too: a reservation
must fit (the replay reserves only after the placement rules passed, and any breach is
recorded as a violation); a smaller allocatable than what is held waits until the
holdings fit, as ``change_allocatable`` would refuse it; a deregistered or removed runner
takes no decision but holds what it holds until released.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from secondbox_scheduler.domain.placement.rules import checked_dimensions
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    MaterializationSnapshot,
    RunnerSnapshot,
    trusted,
)
from secondbox_scheduler.domain.whatif.usage import PoolUsage

DIMENSIONS = Capacity.DIMENSIONS
LeaseView = tuple[datetime | None, tuple[str, ...], tuple[MaterializationSnapshot, ...]]


def capacity_of(amounts: Mapping[str, int]) -> Capacity:
    """A :class:`Capacity` of trusted amounts (every dimension present)."""
    return trusted(Capacity, {dim: amounts[dim] for dim in DIMENSIONS})


class Lease:
    """A runner's recorded liveness and evidence, with every version kept (a placement
    records the lease version it read)."""

    __slots__ = ("digests", "heartbeat", "history", "materializations", "runners")

    def __init__(self) -> None:
        self.heartbeat: datetime | None = None
        self.digests: tuple[str, ...] = ()
        self.materializations: tuple[MaterializationSnapshot, ...] = ()
        self.history: dict[int, LeaseView] = {1: (None, (), ())}
        self.runners: list[FleetRunner] = []  # the runners that show it (clones too)

    def record(self, version: int) -> None:
        """The current values are the lease's at ``version`` (then tell the fleet:
        :meth:`Fleet.lease_changed`)."""
        self.history[version] = (self.heartbeat, self.digests, self.materializations)


class FleetRunner:
    """One runner in one world."""

    __slots__ = (
        "allocatable", "architecture", "backend_kind", "capabilities", "checked", "counted",
        "drain_phase", "drained", "egress", "fixed", "held", "lease", "maximum", "minimum",
        "pending", "pool_name", "removed", "reserved", "runner_id", "seq", "snapshot_cache",
        "visible",
    )  # fmt: skip

    def __init__(self, registered: Any) -> None:
        """From a ``Runner.Registered`` event (only the registration's attributes)."""
        self.runner_id: str = registered.runner_id
        self.pool_name: str = registered.pool_name
        self.backend_kind: str = registered.backend_kind
        self.architecture: str = registered.architecture
        self.capabilities = frozenset(registered.capabilities)
        self.checked = checked_dimensions(self.capabilities)
        self.allocatable: dict[str, int] = dict(registered.allocatable)
        self.reserved: dict[str, int] = dict.fromkeys(DIMENSIONS, 0)
        self.egress: tuple[str, ...] = tuple(registered.supported_egress_contexts)
        self.minimum: int = registered.guest_protocol_minimum
        self.maximum: int = registered.guest_protocol_maximum
        self.drain_phase = DRAIN_PHASE_ACTIVE
        self.lease: Lease | None = None
        self.visible = True  # takes part in decisions
        self.counted = True  # counts in its pool's utilisation
        self.removed = False  # removed by a change: recorded events no longer apply
        self.drained = False  # drained by a change: recorded cancellations do not apply
        self.fixed = False  # allocatable set by a change: recorded changes do not apply
        self.pending: dict[str, int] | None = None  # allocatable waiting for room
        self.held = 0  # reservations held
        self.seq = 0  # registration order in its fleet (pools list runners in this order)
        self.snapshot_cache: RunnerSnapshot | None = None

    def snapshot(self, lease_version: int | None = None) -> RunnerSnapshot:
        """The runner as placement sees it, with its lease now or at ``lease_version``.
        While a smaller allocatable waits for its holdings to fit, only what fits under
        both is offered."""
        if lease_version is None and self.snapshot_cache is not None:
            return self.snapshot_cache
        view: LeaseView = (None, (), ())
        lease = self.lease
        if lease is not None:
            view = lease.history.get(lease_version or -1) or (
                lease.heartbeat,
                lease.digests,
                lease.materializations,
            )
        offered = self.allocatable
        if self.pending is not None:
            offered = {dim: min(offered[dim], self.pending[dim]) for dim in DIMENSIONS}
        values = {
            "id": self.runner_id,
            "pool_name": self.pool_name,
            "backend_kind": self.backend_kind,
            "architecture": self.architecture,
            "capabilities": self.capabilities,
            "allocatable": capacity_of(offered),
            "reserved": capacity_of(self.reserved),
            "drain_phase": self.drain_phase,
            "last_heartbeat_at": view[0],
            "artifact_digests": view[1],
            "materializations": view[2],
            "supported_egress_contexts": self.egress,
            "guest_protocol_minimum": self.minimum,
            "guest_protocol_maximum": self.maximum,
        }
        snapshot = trusted(RunnerSnapshot, values)
        if lease_version is None:
            self.snapshot_cache = snapshot
        return snapshot

    def fits(self, allocatable: Mapping[str, int]) -> bool:
        return all(self.reserved[dim] <= allocatable[dim] for dim in self.checked)


class Fleet:
    """Runners by id, the visible ones by pool, and the pools' utilisation. Whoever
    keeps something derived from a pool's runners registers a set with :meth:`watch`;
    every runner of the pool that changes (or joins, or leaves) is added to it."""

    def __init__(self) -> None:
        self.runners: dict[str, FleetRunner] = {}
        self.pools: dict[str, list[FleetRunner]] = {}
        self.followers: dict[str, list[FleetRunner]] = {}  # who shows a runner's lease
        self.watchers: dict[str, list[set[FleetRunner]]] = {}
        self.usage = PoolUsage()
        self.waits = 0  # allocatable changes that had to wait for holdings to fit
        self.violations: list[str] = []

    def watch(self, pool_name: str, changed: set[FleetRunner]) -> None:
        self.watchers.setdefault(pool_name, []).append(changed)

    def touch(self, runner: FleetRunner) -> None:
        """The runner's snapshot changed (or it joined or left its pool)."""
        runner.snapshot_cache = None
        for changed in self.watchers.get(runner.pool_name, ()):
            changed.add(runner)

    def lease_changed(self, lease: Lease, version: int) -> None:
        lease.record(version)
        for runner in lease.runners:
            self.touch(runner)

    def register(self, runner: FleetRunner, lease_of: str | None = None) -> FleetRunner:
        """Add a runner; it shows the lease of ``lease_of`` (itself by default)."""
        runner.seq = len(self.runners)
        self.runners[runner.runner_id] = runner
        self.pools.setdefault(runner.pool_name, []).append(runner)
        self.touch(runner)
        followers = self.followers.setdefault(lease_of or runner.runner_id, [])
        followers.append(runner)
        if followers[0].lease is not None:
            self._show(runner, followers[0].lease)
        self.usage.change(runner.pool_name, allocatable=runner.allocatable)
        return runner

    def clone(self, source: FleetRunner, runner_id: str) -> FleetRunner:
        """A new runner with ``source``'s registration and current allocatable, active,
        holding nothing, showing ``source``'s lease (its heartbeats as recorded)."""
        clone = copy.copy(source)
        clone.runner_id = runner_id
        clone.allocatable = dict(source.allocatable)
        clone.reserved = dict.fromkeys(DIMENSIONS, 0)
        clone.drain_phase = DRAIN_PHASE_ACTIVE
        clone.visible, clone.counted = True, True
        clone.removed = clone.drained = clone.fixed = False
        clone.pending, clone.held, clone.snapshot_cache, clone.lease = None, 0, None, None
        return self.register(clone, lease_of=source.runner_id)

    def open_lease(self, runner_id: str) -> Lease:
        lease = Lease()
        for runner in self.followers.get(runner_id, ()):
            self._show(runner, lease)
        return lease

    def _show(self, runner: FleetRunner, lease: Lease) -> None:
        runner.lease = lease
        lease.runners.append(runner)
        self.touch(runner)

    def drain(self, runner: FleetRunner, draining: bool) -> None:
        runner.drain_phase = DRAIN_PHASE_DRAINING if draining else DRAIN_PHASE_ACTIVE
        self.touch(runner)

    def leave(self, runner: FleetRunner) -> None:
        """The runner takes no more decisions; it counts while it still holds capacity."""
        if runner.visible:
            runner.visible = False
            self.pools[runner.pool_name].remove(runner)
            self.touch(runner)
        if runner.counted and not runner.held:
            runner.counted = False
            self.usage.change(runner.pool_name, allocatable=runner.allocatable, sign=-1)

    def resize(self, runner: FleetRunner, allocatable: dict[str, int]) -> None:
        """Change what a runner offers; below what it holds, the change waits (as
        ``change_allocatable`` would refuse it) and applies once the holdings fit."""
        self.touch(runner)
        if not runner.fits(allocatable):
            runner.pending = allocatable
            self.waits += 1
            return
        runner.pending = None
        if runner.counted:
            self.usage.change(runner.pool_name, allocatable=runner.allocatable, sign=-1)
            self.usage.change(runner.pool_name, allocatable=allocatable)
        runner.allocatable = allocatable

    def reserve(self, runner: FleetRunner, capacity: Mapping[str, int], where: str) -> None:
        reserved = runner.reserved
        for dim in DIMENSIONS:
            reserved[dim] += capacity[dim]
        runner.held += 1
        self.touch(runner)
        self.usage.change(runner.pool_name, reserved=capacity)
        over = [dim for dim in runner.checked if reserved[dim] > runner.allocatable[dim]]
        if over:
            self.violations.append(
                f"{where}: runner {runner.runner_id!r} reserved "
                + ", ".join(f"{dim} {reserved[dim]} > {runner.allocatable[dim]}" for dim in over)
            )

    def release(self, runner: FleetRunner, capacity: Mapping[str, int]) -> None:
        for dim in DIMENSIONS:
            runner.reserved[dim] -= capacity[dim]
        runner.held -= 1
        self.touch(runner)
        self.usage.change(runner.pool_name, reserved=capacity, sign=-1)
        if runner.pending is not None and runner.fits(runner.pending):
            self.resize(runner, runner.pending)
        if not runner.visible and not runner.held:
            self.leave(runner)
