"""The fleet simulation's driver: :class:`FleetSimulation` registers the fleet, plans the
sandboxes, and runs the timeline tick by tick (heartbeats, the scripted incidents, the
reconcile rounds with the operator's, and every sandbox step due)."""

from __future__ import annotations

from collections.abc import Callable

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.simulation.config import (
    ARRIVAL_TICKS,
    CANCEL_DRAIN_AT,
    DRAIN_AT,
    HEARTBEAT_TIMEOUT,
    PEER_AT,
    RECONCILE_TICKS,
    RECONCILER_OWNER,
    ROLLOUT_AT,
    STALE_AT,
    TICK,
    SimulatedClock,
    SimulationConfig,
)
from secondbox_scheduler.infrastructure.tools.simulation.ledger import Ledger
from secondbox_scheduler.infrastructure.tools.simulation.lifecycle import Sandbox, SandboxLifecycle
from secondbox_scheduler.infrastructure.tools.simulation.plans import (
    POOLS,
    RunnerPlan,
    plan_fleet,
    plan_profiles,
)
from secondbox_scheduler.infrastructure.tools.simulation.reconciler import (
    ScriptedPeer,
    SimulationReconciler,
)


def _no_sleep(_: float) -> None:
    """Reconcile passes take no simulated time."""


class FleetSimulation(SandboxLifecycle):
    """One run of the simulation against one application (see :func:`~.run.run_simulation`)."""

    def __init__(
        self,
        app: SchedulerApplication,
        clock: SimulatedClock,
        config: SimulationConfig,
        *,
        prefix: str = "",
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.fleet = plan_fleet(config.runners, prefix)
        ledger = Ledger({plan.runner_id: plan.pool_name for plan in self.fleet})
        super().__init__(app, clock, config, ledger, progress=progress)
        self.prefix = prefix
        self.profiles = plan_profiles(prefix)
        self.rolled_out = False
        self.drained_runner = ""
        self.drain_cancelled = False
        self.stale_runner = ""
        self.reconciler = SimulationReconciler(app, RECONCILER_OWNER, prefix)
        self.peer = ScriptedPeer(app, prefix, self.will_not_move)
        self.reconciler.before_claim = self.peer.claim_first

    # -- set-up and heartbeats -------------------------------------------------

    def register_fleet(self) -> None:
        for plan in self.fleet:
            self.app.register_runner(
                runner_id=plan.runner_id,
                pool_name=plan.pool_name,
                backend_kind=plan.backend_kind,
                architecture=plan.architecture,
                capabilities=plan.capabilities,
                allocatable=plan.allocatable,
                guest_protocol_minimum=1,
                guest_protocol_maximum=plan.guest_protocol_maximum,
                supported_egress_contexts=plan.egress_contexts,
            )
        self.heartbeat_all()

    def plan_sandboxes(self) -> None:
        pools = list(POOLS)
        weights = [pool.share for pool in pools]
        by_pool: dict[str, list[RunnerPlan]] = {}
        for plan in self.fleet:
            by_pool.setdefault(plan.pool_name, []).append(plan)
        for number in range(1, self.config.sandboxes + 1):
            pool = self.rng.choices(pools, weights)[0]
            pool_name = f"{self.prefix}{pool.name}"
            architecture = self.rng.choice(by_pool[pool_name]).architecture
            revisions = self.profiles[(pool_name, architecture)]
            profile = self.rng.choices(revisions, [r.template.weight for r in revisions])[0]
            workspace = self.rng.randrange(1, 2 + number // 4)
            sandbox = Sandbox(
                sandbox_id=f"{self.prefix}sbx-{number:04d}",
                workspace_id=f"{self.prefix}ws-{workspace:04d}",
                profile=profile,
                starts_left=self.config.cycles,
            )
            self.sandboxes[sandbox.sandbox_id] = sandbox
            self.at(self.rng.randrange(1, ARRIVAL_TICKS + 1), sandbox)

    def heartbeat_all(self) -> None:
        now = self.now()
        for plan in self.fleet:
            if plan.runner_id in self.silent:
                continue
            materializations = plan.materializations
            if self.rolled_out:
                materializations += plan.rollout
            self.app.record_heartbeat(
                runner_id=plan.runner_id,
                at=now,
                artifact_digests=plan.artifact_digests,
                materializations=materializations,
            )
            self.counts["heartbeats_sent"] += 1

    # -- incidents -------------------------------------------------------------

    def future_starts(self, runner_id: str, not_before: int) -> int:
        """Start attempts still to come on ``runner_id`` at or after tick ``not_before``."""
        total = 0
        for sandbox in self.sandboxes.values():
            if sandbox.home != runner_id:
                continue
            if sandbox.phase in ("running", "unreported", "lost"):
                total += sandbox.starts_left  # the next start follows a full run and idle
            elif sandbox.phase in ("idle", "starting"):
                soon = sandbox.next_tick < not_before
                total += sandbox.starts_left - (1 if soon else 0)
        return total

    def pick_victim(self, not_before: int, exclude: str) -> str:
        """The runner whose refusal will be seen most often: most future starts homed there."""
        candidates = [plan.runner_id for plan in self.fleet if plan.runner_id != exclude]
        return max(candidates, key=lambda rid: (self.future_starts(rid, not_before), rid))

    def incidents(self) -> None:
        share = self.share_done
        if not self.drained_runner and share >= DRAIN_AT:
            self.drained_runner = self.pick_victim(self.tick, exclude=self.stale_runner)
            self.app.start_drain(self.drained_runner)
        if not self.stale_runner and share >= STALE_AT:
            # Placements see it stale once HEARTBEAT_TIMEOUT has passed since its last beat.
            not_before = self.tick + HEARTBEAT_TIMEOUT // TICK + 1
            self.stale_runner = self.pick_victim(not_before, exclude=self.drained_runner)
            self.silent.add(self.stale_runner)
        if not self.rolled_out and share >= ROLLOUT_AT:
            self.rolled_out = True  # the next heartbeats carry new evidence
        if (
            self.drained_runner
            and not self.drain_cancelled
            and share >= CANCEL_DRAIN_AT
            and self.reasons["schedule"]["draining"] > 0
        ):
            self.app.cancel_drain(self.drained_runner)
            self.drain_cancelled = True
        if not self.peer.joined and share >= PEER_AT:
            self.peer.join()

    # -- reconciliation and the operator ---------------------------------------

    def reconcile(self) -> None:
        """One reconcile round (passes until nothing is due), the peer's part, the operator's."""
        self.counts["reconcile_rounds"] += 1
        self.reconciler.drain(sleep=_no_sleep)
        self.peer.finish_won()
        self.peer.wake()
        self.operate()

    def will_not_move(self, sandbox_id: str) -> bool:
        """Whether a sandbox stays as it is for the rest of the run: running its last start
        on a runner that still heartbeats (where the scripted peer may pause on a claim)."""
        sandbox = self.sandboxes.get(sandbox_id)
        return (
            sandbox is not None
            and sandbox.phase == "running"
            and sandbox.starts_left == 0
            and sandbox.home not in self.silent
        )

    def operate(self) -> None:
        """The operator's round: look at every assignment that waits on the reconciler."""
        for sandbox in self.sandboxes.values():
            lost = sandbox.phase == "running" and sandbox.home in self.silent
            if lost or sandbox.phase in ("unreported", "lost"):
                self.look_at(sandbox)

    # -- the run ---------------------------------------------------------------

    def pending(self) -> bool:
        return self.starts_done < self.total_starts

    def run_all(self) -> None:
        self.register_fleet()
        self.plan_sandboxes()
        order = {"running": 0, "idle": 1, "starting": 1, "arriving": 2}
        while self.pending():
            self.tick += 1
            self.clock.advance(TICK)
            self.incidents()
            self.heartbeat_all()
            if self.tick % RECONCILE_TICKS == 0:
                self.reconcile()
            # an entry is stale once the operator released a lost sandbox before its stop
            entries = self.calendar.pop(self.tick, [])
            due = {s for s in entries if self.sandboxes[s].next_tick == self.tick}
            for sandbox_id in sorted(due, key=lambda s: (order.get(self.sandboxes[s].phase, 3), s)):
                self.step(self.sandboxes[sandbox_id])
