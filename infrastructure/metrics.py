"""Prometheus metrics of the scheduler, for the HTTP service and for Python embedders.

:class:`~secondbox_scheduler.infrastructure.application.SchedulerMetrics` is where an
application counts things (placements, replays, refusals by reason code, contention
retries and errors, heartbeats by outcome, reconcile actions, command durations). It
keeps its own plain counters; an exporter attached to it sees every count as it
happens. :class:`PrometheusMetrics` is that exporter: it registers the metrics below on
a ``prometheus_client`` :class:`~prometheus_client.CollectorRegistry` (opt-in: a new
registry unless you pass one; the process-wide default registry only if you hand it
over) and mirrors each count into them. Attach it with
``SchedulerApplication(metrics_registry=registry)`` or ``app.attach_metrics(registry)``;
``secondbox-scheduler serve`` does so and serves the registry at ``/metrics``.

Metrics (all prefixed ``secondbox_scheduler_``):

=================================================  ==========================================
``placements_total``                               assignments fenced by ``schedule``
``replays_total``                                  ``schedule`` answered with the existing one
``refusals_total{operation,error}``                placements refused (no runner)
``refusal_reasons_total{operation,reason}``        runners refusing them, per reason code
``refusals_recorded_total``                        refusals stored as evidence
``contention_retries_total``                       lost optimistic-concurrency races retried
``contention_errors_total``                        commands that gave up (503 over HTTP)
``placements_deferred_total``                      to the next batch: a rival held the runner
``heartbeats_total{outcome}``                      renewed, evidence (recorded), coalesced, stale
``reconcile_actions_total{action}``                reconcile results committed
``command_duration_seconds{command,outcome}``      every command: ok, refused, error
``placement_batch_size``                           placements per batch (the batcher's hook)
``read_model_lag_events{projection}``              events not yet applied (read at scrape)
``read_model_position{projection}``                a read model's log position (at scrape)
``event_log_head_position``                        the notification log's head (at scrape)
``store_up``                                       1 when the scrape could read the store
=================================================  ==========================================

:func:`measured` is the decorator that times a command of the application;
:func:`refusal_reasons` counts a refused placement's reasons.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from secondbox_scheduler.domain.errors import PlacementError, SchedulerError
from secondbox_scheduler.domain.lease import (
    OBSERVED_COALESCED,
    OBSERVED_EVIDENCE,
    OBSERVED_RENEWED,
    OBSERVED_STALE,
)
from secondbox_scheduler.domain.placement.evidence import reason_keys
from secondbox_scheduler.domain.reconcile import ACTIONS
from secondbox_scheduler.projections.read_models import ProjectionStatus

NAMESPACE = "secondbox_scheduler"
OUTCOME_OK = "ok"  # the command returned
OUTCOME_REFUSED = "refused"  # a typed refusal (SchedulerError: invalid, stale, no runner, ...)
OUTCOME_ERROR = "error"  # anything else (the store failed, a fault)
HEARTBEAT_OUTCOMES = (OBSERVED_RENEWED, OBSERVED_EVIDENCE, OBSERVED_COALESCED, OBSERVED_STALE)
# Commands take from well under a millisecond (a coalesced heartbeat) to a few hundred
# (a contended placement backing off); the buckets cover both ends.
DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
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

P = ParamSpec("P")
R = TypeVar("R")


class CommandRecorder(Protocol):
    def command(self, command: str, outcome: str, seconds: float) -> None: ...


class Measured(Protocol):
    @property
    def metrics(self) -> CommandRecorder: ...


S = TypeVar("S", bound=Measured)


def measured(
    command: str,
) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]]:
    """Time a command method of an object with ``metrics`` (the application): its
    duration and outcome (ok, refused, error) go to ``self.metrics.command``."""

    def decorate(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        @functools.wraps(method)
        def timed(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter()
            outcome = OUTCOME_ERROR
            try:
                result = method(self, *args, **kwargs)
                outcome = OUTCOME_OK
                return result
            except SchedulerError:
                outcome = OUTCOME_REFUSED
                raise
            finally:
                self.metrics.command(command, outcome, time.perf_counter() - started)

        return timed

    return decorate


def refusal_reasons(error: PlacementError) -> collections.Counter[str]:
    """Runners refusing a placement, per reason key (a code, or ``capacity:<dimension>``),
    counting the runners refused without a record of their own too: as ``simulate``
    counts them."""
    reasons: collections.Counter[str] = collections.Counter()
    for evaluation in error.evaluations:
        reasons.update(reason_keys(evaluation))
    reasons.update({key: n for key, n in error.unlisted.reasons.items() if n > 0})
    return reasons


class MetricsSink(Protocol):
    """What :class:`SchedulerMetrics` tells an exporter (:class:`PrometheusMetrics`)."""

    def count(self, name: str, amount: int) -> None: ...

    def heartbeat(self, outcome: str) -> None: ...

    def refusal(self, operation: str, error: str, reasons: Mapping[str, int]) -> None: ...

    def reconcile(self, action: str) -> None: ...

    def command(self, command: str, outcome: str, seconds: float) -> None: ...

    def batch(self, size: int) -> None: ...


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
