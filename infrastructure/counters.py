"""The counters of one application instance: placements, replays, refusals, races,
heartbeats, batches and command outcomes, told to an exporter as they happen
(:mod:`.metrics` exports them to Prometheus)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from secondbox_scheduler.domain.errors import PlacementError
from secondbox_scheduler.infrastructure.metrics import MetricsSink, refusal_reasons


@dataclass
class SchedulerMetrics:
    """Counters of one application instance (thread-safe). An exporter attached as
    ``sink`` (:meth:`SchedulerApplication.attach_metrics`: Prometheus, see
    :mod:`.metrics`) is told every count and command duration as it happens."""

    placements: int = 0
    replays: int = 0
    refusals_recorded: int = 0
    contention_retries: int = 0
    contention_errors: int = 0
    placements_deferred: int = 0  # to the next batch: another replica held the runner
    heartbeats: dict[str, int] = field(default_factory=dict)
    batch_sizes: dict[int, int] = field(default_factory=dict)  # placement batches by size
    refusals: dict[tuple[str, str], int] = field(default_factory=dict)  # (operation, error)
    refusal_reasons: dict[tuple[str, str], int] = field(default_factory=dict)  # runners refusing
    reconcile_actions: dict[str, int] = field(default_factory=dict)
    commands: dict[tuple[str, str], int] = field(default_factory=dict)  # (command, outcome)
    placement_batches: int = 0
    sink: MetricsSink | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)
        if self.sink is not None:
            self.sink.count(name, amount)

    def heartbeat(self, outcome: str) -> None:
        with self._lock:
            self.heartbeats[outcome] = self.heartbeats.get(outcome, 0) + 1
        if self.sink is not None:
            self.sink.heartbeat(outcome)

    def refusal(self, operation: str, error: PlacementError) -> None:
        """A refused placement: once per call, and per reason key the runners refusing
        (as ``simulate`` counts them: capacity per dimension, unlisted runners too)."""
        reasons = refusal_reasons(error)
        key = (operation, type(error).__name__)
        with self._lock:
            self.refusals[key] = self.refusals.get(key, 0) + 1
            for reason, runners in reasons.items():
                self.refusal_reasons[(operation, reason)] = (
                    self.refusal_reasons.get((operation, reason), 0) + runners
                )
        if self.sink is not None:
            self.sink.refusal(operation, key[1], reasons)

    def reconcile(self, action: str) -> None:
        with self._lock:
            self.reconcile_actions[action] = self.reconcile_actions.get(action, 0) + 1
        if self.sink is not None:
            self.sink.reconcile(action)

    def command(self, command: str, outcome: str, seconds: float) -> None:
        """One command's outcome (``ok``, ``refused``, ``error``) and duration."""
        with self._lock:
            self.commands[(command, outcome)] = self.commands.get((command, outcome), 0) + 1
        if self.sink is not None:
            self.sink.command(command, outcome, seconds)

    def batch(self, size: int) -> None:
        """One placement batch decided and committed, with its number of requests."""
        with self._lock:
            self.placement_batches += 1
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        if self.sink is not None:
            self.sink.batch(size)
