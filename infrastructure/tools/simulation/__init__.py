"""A deterministic fleet simulation on a real store: the engine of ``simulate``.

:func:`run_simulation` registers a seeded fleet, creates sandboxes from a few profile
revisions per pool and drives them through start/stop cycles with seeded random
arrivals, all on a simulated clock, through the public commands of
:class:`~infrastructure.application.SchedulerApplication`. Part-way through, one
runner is drained (and the drain later cancelled) and another stops heartbeating,
so that restarts of the sandboxes homed there are refused with the ``draining`` and
``heartbeat_stale`` reason codes. It returns a :class:`SimulationResult`; the same
seed and sizes give the same result, except the wall time.

Timeline (one tick is 5 simulated seconds): every live runner heartbeats every tick
(the application records a plain renewal at most every 10 s, so about half are
coalesced); sandboxes arrive during the first six minutes; each sandbox is started
``cycles`` times. A started sandbox runs 1-6 minutes, is released with proof,
advances its generation and idles 30 s - 3 min before its next start; after its last
start it stays running, so the final utilisation shows a loaded fleet. A refused
start is retried a minute later, at most three attempts per cycle. The run ends when
every sandbox has made its last start attempt.

Assignment lifecycle and reconciliation: a start must be reported running within its
operation deadline (a minute). During the first 35 % of the start attempts a few placed
starts are never reported running, and no start on a runner that stopped heartbeating
is. A :class:`SimulationReconciler` ("simulator-reconciler") makes a pass every
simulated minute: it fails unreported starts with ``deadline_exceeded``, which
redelivers them while retries remain (some are then reported running) and fails them
terminally past the retry limit; the stale runner's assignments become ``uncertain``
and keep their reservations (a running sandbox there cannot report its stop). An
operator (the simulation) releases failed and uncertain assignments by hand with proof
one pass after noticing them, and the sandbox moves on to its next generation. Half-way
through, a scripted peer reconciler ("simulator-peer") wins the claim race for a few
due assignments (held by others, for the simulator's reconciler) and once pauses past
its claim's expiry, so that its late commit is refused (a lost claim). Whatever is
still unreported, failed or uncertain at the end keeps its reservation; the ledger
check covers it.

Modules: :mod:`.config` (what to simulate, the clock, the timeline's constants),
:mod:`.plans` (the fleet and the profile revisions), :mod:`.lifecycle` (one sandbox's
steps, refusals, manual release), :mod:`.fleet` (the driver: registration, heartbeats,
incidents, reconcile rounds, the run loop), :mod:`.reconciler` (the simulation's
reconciler and the scripted peer), :mod:`.ledger` (the simulation's own reservation
ledger), :mod:`.result` (the result and how a run is summarised) and :mod:`.run`
(:func:`run_simulation` and the SQLite file it writes).
"""

from secondbox_scheduler.infrastructure.tools.simulation.config import (
    ATTEMPTS_PER_CYCLE,
    HEARTBEAT_TIMEOUT,
    OPERATOR,
    SimulatedClock,
    SimulationConfig,
)
from secondbox_scheduler.infrastructure.tools.simulation.fleet import FleetSimulation
from secondbox_scheduler.infrastructure.tools.simulation.plans import (
    FULL_CAPABILITIES,
    POOLS,
    RunnerPlan,
    plan_fleet,
    plan_profiles,
)
from secondbox_scheduler.infrastructure.tools.simulation.reconciler import (
    ScriptedPeer,
    SimulationReconciler,
)
from secondbox_scheduler.infrastructure.tools.simulation.result import (
    DimensionUse,
    PoolUse,
    ReconcileUse,
    RunnerUse,
    SimulationResult,
    summarise,
)
from secondbox_scheduler.infrastructure.tools.simulation.run import (
    delete_sqlite_database,
    run_simulation,
)

__all__ = [
    "ATTEMPTS_PER_CYCLE",
    "FULL_CAPABILITIES",
    "HEARTBEAT_TIMEOUT",
    "OPERATOR",
    "POOLS",
    "DimensionUse",
    "FleetSimulation",
    "PoolUse",
    "ReconcileUse",
    "RunnerPlan",
    "RunnerUse",
    "ScriptedPeer",
    "SimulatedClock",
    "SimulationConfig",
    "SimulationReconciler",
    "SimulationResult",
    "delete_sqlite_database",
    "plan_fleet",
    "plan_profiles",
    "run_simulation",
    "summarise",
]
