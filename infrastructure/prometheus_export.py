"""The Prometheus exporter of the scheduler's metrics (:mod:`.metrics` lists them).

Only this module (with the HTTP service) needs ``prometheus-client``, which the
``[server]`` extra brings; an embedder who passes ``metrics_registry=`` has it already.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from secondbox_scheduler.domain.reconcile import ACTIONS
from secondbox_scheduler.infrastructure.metrics import (
    DURATION_BUCKETS,
    HEARTBEAT_OUTCOMES,
    NAMESPACE,
)
from secondbox_scheduler.projections.read_models import ProjectionStatus

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COUNTED = {  # SchedulerMetrics.add names -> (metric name, help)
    "placements": ("placements", "Assignments fenced by schedule (created=True)."),
    "replays": ("replays", "schedule calls answered with the existing assignment (replays)."),
    "refusals_recorded": (
        "refusals_recorded",
        "Refused placements recorded as evidence in a sandbox's refusal log.",
    ),
    "contention_retries": (
        "contention_retries",
        "Lost optimistic-concurrency races, retried after a full-jitter backoff.",
    ),
    "contention_errors": (
        "contention_errors",
        "Commands that lost every race of their retry budget (SerializationContentionError).",
    ),
    "placements_deferred": (
        "placements_deferred",
        "Placements moved to the next batch: another replica's batch held the home runner.",
    ),
}


log = logging.getLogger(__name__)


StatusReader = Callable[[], Sequence[ProjectionStatus] | None]  # None: no read models kept


class ReadModelCollector(Collector):
    """Read-model lag, positions and the log head, read from the store at each scrape.
    A store that cannot be read gives ``store_up 0`` and no lag (a scrape never fails)."""

    def __init__(
        self, status: StatusReader, head: Callable[[], int], probe: Callable[[], None]
    ) -> None:
        self.status = status
        self.head = head
        self.probe = probe

    def describe(self) -> Iterable[Metric]:  # no store access at registration
        return self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                f"{NAMESPACE}_read_model_lag_events",
                "Events after a read model's position (the next query or catch-up applies them).",
                labels=["projection"],
            ),
            GaugeMetricFamily(
                f"{NAMESPACE}_read_model_position",
                "Notification log position a read model has applied.",
                labels=["projection"],
            ),
            GaugeMetricFamily(
                f"{NAMESPACE}_event_log_head_position",
                "The notification log's head position (ahead of the event count on "
                "PostgreSQL: a lost race consumes an id).",
            ),
            GaugeMetricFamily(
                f"{NAMESPACE}_store_up", "1 when this scrape could read the store, else 0."
            ),
        ]

    def collect(self) -> Iterable[Metric]:
        lag, position, head, up = self._families()
        try:
            self.probe()  # one connection, no retries: fast while the store is down
            statuses = self.status()
            head_position = self.head()
        except Exception as error:  # the store is down: say so, never fail the scrape
            log.warning("metrics: cannot read the store: %s: %s", type(error).__name__, error)
            up.add_metric([], 0.0)
            return [up]
        for status in statuses or ():
            lag.add_metric([status.name], float(status.lag_events))
            position.add_metric([status.name], float(status.position))
        head.add_metric([], float(head_position))
        up.add_metric([], 1.0)
        return [lag, position, head, up] if statuses is not None else [head, up]


class PrometheusMetrics:
    """The scheduler's metrics on one registry, fed by an application's SchedulerMetrics.

    One application per registry: registering the same names twice on one registry is
    refused by prometheus_client (``Duplicated timeseries``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.counters = {
            name: Counter(metric, text, namespace=NAMESPACE, registry=self.registry)
            for name, (metric, text) in COUNTED.items()
        }
        self.refusals = Counter(
            "refusals",
            "Placements refused because no runner (or not the home runner) passed every "
            "rule, by operation (create_sandbox, schedule) and error.",
            ["operation", "error"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.refusal_reasons = Counter(
            "refusal_reasons",
            "Runners refusing a refused placement, per reason code (capacity per dimension, "
            "capacity:<dimension>); for schedule, the one home runner.",
            ["operation", "reason"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "heartbeats",
            "Heartbeats by outcome: renewed and evidence were recorded, coalesced wrote "
            "nothing (within the renewal interval), stale were older than the last one.",
            ["outcome"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.reconcile_actions = Counter(
            "reconcile_actions",
            "Reconcile results committed, by action.",
            ["action"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.commands = Histogram(
            "command_duration_seconds",
            "Duration of the application's commands, by command and outcome (ok; refused: "
            "a typed SchedulerError; error: anything else).",
            ["command", "outcome"],
            namespace=NAMESPACE,
            registry=self.registry,
            buckets=DURATION_BUCKETS,
        )
        self.batches = Histogram(
            "placement_batch_size",
            "Placements committed per batch (observed by the placement batcher).",
            namespace=NAMESPACE,
            registry=self.registry,
            buckets=BATCH_BUCKETS,
        )
        for outcome in HEARTBEAT_OUTCOMES:  # known label values show from the start
            self.heartbeats.labels(outcome)
        for action in ACTIONS:
            self.reconcile_actions.labels(action)
        self._collector: ReadModelCollector | None = None

    def watch(
        self,
        status: StatusReader,
        head: Callable[[], int],
        probe: Callable[[], None] = lambda: None,
    ) -> None:
        """Export read-model lag and positions (``status``) and the log head (``head``),
        read at every scrape once ``probe`` found the store reachable."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = ReadModelCollector(status, head, probe)
        self.registry.register(self._collector)

    # -- MetricsSink ----------------------------------------------------------

    def count(self, name: str, amount: int) -> None:
        counter = self.counters.get(name)
        if counter is not None:
            counter.inc(amount)

    def heartbeat(self, outcome: str) -> None:
        self.heartbeats.labels(outcome).inc()

    def refusal(self, operation: str, error: str, reasons: Mapping[str, int]) -> None:
        self.refusals.labels(operation, error).inc()
        for reason, runners in reasons.items():
            self.refusal_reasons.labels(operation, reason).inc(runners)

    def reconcile(self, action: str) -> None:
        self.reconcile_actions.labels(action).inc()

    def command(self, command: str, outcome: str, seconds: float) -> None:
        self.commands.labels(command, outcome).observe(seconds)

    def batch(self, size: int) -> None:
        self.batches.observe(size)
