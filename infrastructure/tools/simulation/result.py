"""What a simulation reports: :class:`SimulationResult`, and :func:`summarise`, which
reads it off a finished :class:`~.fleet.FleetSimulation` and its store."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from secondbox_scheduler.domain.assignment import (
    STATE_FAILED,
    STATE_RELEASED,
    STATE_UNCERTAIN,
    STATES,
)
from secondbox_scheduler.domain.placement.evidence import REASON_CODES
from secondbox_scheduler.domain.reconcile import ACTIONS
from secondbox_scheduler.domain.values import RunnerSnapshot
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.reconciler import ReconcileReport
from secondbox_scheduler.infrastructure.settings import redact_url
from secondbox_scheduler.infrastructure.tools.simulation.config import (
    HEARTBEAT_TIMEOUT,
    OPERATION_DEADLINE,
    RECONCILE_TICKS,
    SIM_START,
    TICK,
)
from secondbox_scheduler.infrastructure.tools.simulation.fleet import FleetSimulation
from secondbox_scheduler.infrastructure.tools.simulation.reconciler import SimulationReconciler

UTILISATION_DIMENSIONS = ("vcpu_count", "memory_bytes", "instances")


@dataclass(frozen=True)
class DimensionUse:
    """One capacity dimension: reserved and allocatable at the end, peak reserved."""

    reserved: int
    allocatable: int
    peak: int

    @property
    def percent(self) -> float:
        return 100.0 * self.reserved / self.allocatable if self.allocatable else 0.0

    @property
    def peak_percent(self) -> float:
        return 100.0 * self.peak / self.allocatable if self.allocatable else 0.0


@dataclass(frozen=True)
class RunnerUse:
    runner_id: str
    pool_name: str
    architecture: str
    drain_phase: str
    heartbeat: str  # "live" or "stale" at the end
    vcpu_count: DimensionUse
    memory_bytes: DimensionUse
    instances: DimensionUse


@dataclass(frozen=True)
class PoolUse:
    pool_name: str
    runners: int
    vcpu_count: DimensionUse
    memory_bytes: DimensionUse
    instances: DimensionUse


@dataclass(frozen=True)
class ReconcileUse:
    """What the reconcilers did, both of them together unless named."""

    interval_seconds: float  # simulated time between rounds (and between two looks)
    operation_deadline_seconds: float
    rounds: int  # reconcile rounds, each of passes until nothing is due
    passes: int  # the reconciler's passes (due reads)
    due: int  # due assignments found, pass after pass (one may be found again)
    reconciled: int  # results committed
    reconciled_by: dict[str, int]  # owner -> results committed
    actions: dict[str, int]  # none, deadline_exceeded, uncertain
    redeliveries: int  # deadline_exceeded with retries left: assigned again, fresh window
    terminal_failures: int  # deadline_exceeded past the retry limit: failed
    held_by_others: int  # claims refused because another owner held one
    claims_lost: int  # results refused because the claim was no longer current
    no_longer_due: int
    stale: int


@dataclass(frozen=True)
class SimulationResult:
    """What one simulation did; every field but ``wall_seconds`` depends only on the inputs."""

    seed: int
    runners: int
    sandboxes: int
    cycles: int
    database_url: str
    simulated_seconds: float
    sandboxes_created: int
    start_attempts: int
    placements: int
    replays: int
    releases: int
    generations_advanced: int
    transient_failures: int
    late_fences_rejected: int
    cycles_abandoned: int
    running_at_end: int
    starts_unreported: int  # placed starts the runner never reported running
    redelivered_starts_running: int  # of those, reported running after a redelivery
    manual_releases: int  # released by hand by the operator, with proof
    manual_releases_by_state: dict[str, int]  # the state they were released from
    assignment_states: dict[str, int]  # every assignment of the run by its final state
    reconcile: ReconcileUse
    refusals: dict[str, dict[str, int]]  # operation -> error type -> count
    refusal_reasons: dict[str, dict[str, int]]  # operation -> reason code -> count
    drained_runner: str
    drain_cancelled: bool
    stale_runner: str
    contention_retries: int
    contention_errors: int
    heartbeats: dict[str, int]  # sent, recorded, coalesced and every outcome
    events_written: int
    events_in_store: int
    ledger_matches_store: bool  # reserved = what the run placed minus what it released
    # = the capacity of every unreleased assignment, on every runner
    pools: list[PoolUse]
    runner_use: list[RunnerUse]
    wall_seconds: float

    @property
    def refusals_total(self) -> int:
        return sum(sum(by_type.values()) for by_type in self.refusals.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def counts(self) -> dict[str, Any]:
        """Everything but the wall time: equal for equal inputs."""
        data = self.to_dict()
        del data["wall_seconds"]
        return data


def summarise(simulation: FleetSimulation, events_before: int, elapsed: float) -> SimulationResult:
    app = simulation.app
    names = {plan.runner_id for plan in simulation.fleet}
    snapshots = [s for s in app.runner_snapshots() if s.id in names]
    stale_before = simulation.now() - HEARTBEAT_TIMEOUT
    ledger = simulation.ledger
    runner_use = []
    pool_totals: dict[str, Counter[str]] = {}
    pool_counts: Counter[str] = Counter()
    for snapshot in snapshots:
        peak = ledger.peak.get(snapshot.id, Counter())
        seen = snapshot.last_heartbeat_at
        runner_use.append(
            RunnerUse(
                runner_id=snapshot.id,
                pool_name=snapshot.pool_name,
                architecture=snapshot.architecture,
                drain_phase=snapshot.drain_phase,
                heartbeat="live" if seen is not None and seen >= stale_before else "stale",
                vcpu_count=_use(snapshot, "vcpu_count", peak),
                memory_bytes=_use(snapshot, "memory_bytes", peak),
                instances=_use(snapshot, "instances", peak),
            )
        )
        totals = pool_totals.setdefault(snapshot.pool_name, Counter())
        totals.update({dim: snapshot.allocatable.as_dict()[dim] for dim in UTILISATION_DIMENSIONS})
        pool_counts[snapshot.pool_name] += 1
    pools = []
    for pool_name in sorted(pool_totals):
        used = ledger.pool_reserved.get(pool_name, Counter())
        top = ledger.pool_peak.get(pool_name, Counter())
        pools.append(
            PoolUse(
                pool_name=pool_name,
                runners=pool_counts[pool_name],
                vcpu_count=_pool_use(used, pool_totals[pool_name], top, "vcpu_count"),
                memory_bytes=_pool_use(used, pool_totals[pool_name], top, "memory_bytes"),
                instances=_pool_use(used, pool_totals[pool_name], top, "instances"),
            )
        )
    outcomes = dict(sorted(app.metrics.heartbeats.items()))
    heartbeats = {
        "sent": simulation.counts["heartbeats_sent"],
        "recorded": outcomes.get("renewed", 0) + outcomes.get("evidence", 0),
        "coalesced": outcomes.get("coalesced", 0),
        **outcomes,
    }
    states, unreleased_match = _assignment_states(app, snapshots)
    events = app.event_count()
    counts = simulation.counts
    return SimulationResult(
        seed=simulation.config.seed,
        runners=simulation.config.runners,
        sandboxes=simulation.config.sandboxes,
        cycles=simulation.config.cycles,
        database_url=redact_url(simulation.config.database_url),
        simulated_seconds=(simulation.now() - SIM_START).total_seconds(),
        sandboxes_created=counts["sandboxes_created"],
        start_attempts=counts["start_attempts"],
        placements=app.metrics.placements,
        replays=app.metrics.replays,
        releases=counts["releases"],
        generations_advanced=counts["generations_advanced"],
        transient_failures=counts["transient_failures"],
        late_fences_rejected=counts["late_fences_rejected"],
        cycles_abandoned=counts["cycles_abandoned"],
        running_at_end=sum(1 for s in simulation.sandboxes.values() if s.phase == "running"),
        starts_unreported=counts["starts_unreported"],
        redelivered_starts_running=counts["redelivered_starts_running"],
        manual_releases=sum(simulation.manual_releases.values()),
        manual_releases_by_state={
            state: simulation.manual_releases[state] for state in (STATE_FAILED, STATE_UNCERTAIN)
        },
        assignment_states=states,
        reconcile=_reconcile_use(
            counts["reconcile_rounds"], simulation.reconciler, simulation.peer
        ),
        refusals={op: _sorted_counts(c) for op, c in simulation.refusals.items()},
        refusal_reasons={op: _reason_counts(c) for op, c in simulation.reasons.items()},
        drained_runner=simulation.drained_runner,
        drain_cancelled=simulation.drain_cancelled,
        stale_runner=simulation.stale_runner,
        contention_retries=app.metrics.contention_retries,
        contention_errors=app.metrics.contention_errors,
        heartbeats=heartbeats,
        events_written=events - events_before,
        events_in_store=events,
        ledger_matches_store=ledger.matches(snapshots) and unreleased_match,
        pools=pools,
        runner_use=runner_use,
        wall_seconds=round(elapsed, 3),
    )


def _assignment_states(
    app: SchedulerApplication, snapshots: list[RunnerSnapshot]
) -> tuple[dict[str, int], bool]:
    """Every assignment on the run's runners by state, and whether each runner's reserved
    capacity equals the sum over its unreleased assignments (failed and uncertain too)."""
    read_models = app.current_read_models()
    assert read_models is not None
    states: Counter[str] = Counter()
    matches = True
    for snapshot in snapshots:
        held: Counter[str] = Counter()
        for assignment in read_models.assignments.by_runner(snapshot.id, holding=False):
            states[assignment.state] += 1
            if assignment.state != STATE_RELEASED:
                held.update(assignment.capacity.as_dict())
        if any(held[dim] != amount for dim, amount in snapshot.reserved.as_dict().items()):
            matches = False
    ordered = {state: states[state] for state in STATES}
    ordered.update({state: n for state, n in sorted(states.items()) if state not in ordered})
    return ordered, matches


def _reconcile_use(rounds: int, *reconcilers: SimulationReconciler) -> ReconcileUse:
    total = ReconcileReport()
    for reconciler in reconcilers:
        report = reconciler.report
        total.passes += report.passes
        total.due += report.due
        total.held_by_others += report.held_by_others
        total.claims_lost += report.claims_lost
        total.no_longer_due += report.no_longer_due
        total.stale += report.stale
        total.actions.update(report.actions)
    return ReconcileUse(
        interval_seconds=(RECONCILE_TICKS * TICK).total_seconds(),
        operation_deadline_seconds=OPERATION_DEADLINE.total_seconds(),
        rounds=rounds,
        passes=total.passes,
        due=total.due,
        reconciled=sum(total.actions.values()),
        reconciled_by={r.owner: sum(r.report.actions.values()) for r in reconcilers},
        actions={action: total.actions[action] for action in ACTIONS},
        redeliveries=sum(r.redeliveries for r in reconcilers),
        terminal_failures=sum(r.terminal_failures for r in reconcilers),
        held_by_others=total.held_by_others,
        claims_lost=total.claims_lost,
        no_longer_due=total.no_longer_due,
        stale=total.stale,
    )


def _use(snapshot: RunnerSnapshot, dim: str, peak: Counter[str]) -> DimensionUse:
    return DimensionUse(
        snapshot.reserved.as_dict()[dim], snapshot.allocatable.as_dict()[dim], peak[dim]
    )


def _pool_use(
    used: Counter[str], allocatable: Counter[str], peak: Counter[str], dim: str
) -> DimensionUse:
    return DimensionUse(used[dim], allocatable[dim], peak[dim])


def _sorted_counts(counts: Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _reason_counts(counts: Counter[str]) -> dict[str, int]:
    """Reason codes in the order the placement checks run; unknown codes last."""
    ordered = {code: counts[code] for code in REASON_CODES if counts[code]}
    ordered.update({code: n for code, n in sorted(counts.items()) if code not in ordered})
    return ordered
