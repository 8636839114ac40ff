"""What to simulate (:class:`SimulationConfig`), the simulated clock, and the timeline's constants.

The constants set the timeline the package docstring describes: the tick, how long a
start runs and a sandbox idles, how refused starts are retried, how often a start is
replayed, fails once, is fenced late or never reported running, the reconciler's round
and claims, and when, by the share of start attempts made, the scripted incidents happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL

SIM_START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
TICK = timedelta(seconds=5)
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
ARRIVAL_TICKS = 72  # sandboxes arrive during the first 6 minutes
RUN_TICKS = (12, 72)  # a start runs 1-6 minutes
IDLE_TICKS = (6, 36)  # and idles 30 s - 3 min before the next start
RETRY_TICKS = 12  # a refused start is retried a minute later
ATTEMPTS_PER_CYCLE = 3
SERIALIZATION_RETRY_LIMIT = 8
ASSIGNMENT_RETRY_LIMIT = 3
REPLAY_PROBABILITY = 0.08  # the start command is delivered twice
TRANSIENT_FAILURE_PROBABILITY = 0.05  # the runner reports a transport failure once
LATE_FENCE_PROBABILITY = 0.10  # a late message of the previous generation arrives
OPERATION_DEADLINE = timedelta(minutes=1)  # a start must be reported running by then
UNREPORTED_START_PROBABILITY = 0.08  # the runner never reports a start running
RECOVERY_PROBABILITY = 0.35  # a redelivered unreported start is then reported running

# Reconciliation: one pass a simulated minute, by one reconciler (and a scripted peer).
RECONCILE_TICKS = 12
RECONCILE_INTERVAL = timedelta(seconds=60)
RECONCILE_CLAIM_TTL = timedelta(seconds=60)
RECONCILER_OWNER = "simulator-reconciler"
PEER_OWNER = "simulator-peer"
PEER_RACES = 3  # due assignments the peer claims just before the reconciler does
OPERATOR = "simulator"  # who releases failed and uncertain assignments by hand

# When, by the share of start attempts made, the scripted incidents happen.
DRAIN_AT = 0.25
STALE_AT = 0.40
ROLLOUT_AT = 0.55
CANCEL_DRAIN_AT = 0.75
PEER_AT = 0.50
UNREPORTED_UNTIL = 0.35  # later starts are all reported, or they would outlast the run


@dataclass(frozen=True)
class SimulationConfig:
    """What to simulate and where to write it."""

    database_url: str = DEFAULT_SQLITE_URL
    seed: int = 7
    runners: int = 36
    sandboxes: int = 200
    cycles: int = 3
    fresh: bool = True

    def __post_init__(self) -> None:
        if self.runners < 3:
            raise ValueError("runners must be at least 3 (one per pool)")
        if self.sandboxes < 1:
            raise ValueError("sandboxes must be at least 1")
        if self.cycles < 1:
            raise ValueError("cycles must be at least 1")


class SimulatedClock:
    """The application's clock: a current time that only the simulation moves."""

    def __init__(self, start: datetime = SIM_START) -> None:
        self.current = start

    def __call__(self) -> datetime:
        return self.current

    def advance(self, delta: timedelta) -> datetime:
        self.current += delta
        return self.current
