"""Prometheus metrics of the scheduler, for the HTTP service and for Python embedders.

:class:`~secondbox_scheduler.infrastructure.application.SchedulerMetrics` is where an
application counts things (placements, replays, refusals by reason code, contention
retries and errors, heartbeats by outcome, reconcile actions, command durations). It
keeps its own plain counters; an exporter attached to it sees every count as it
happens. :class:`~.prometheus_export.PrometheusMetrics` is that exporter: it registers
the metrics below on a ``prometheus_client`` :class:`~prometheus_client.CollectorRegistry`
(opt-in: a new registry unless you pass one; the process-wide default registry only if
you hand it over) and mirrors each count into them. Attach it with
``SchedulerApplication(metrics_registry=registry)`` or ``app.attach_metrics(registry)``;
``secondbox-scheduler serve`` does so and serves the registry at ``/metrics``. The
exporter is in :mod:`.prometheus_export`, which alone needs ``prometheus-client`` (the
``[server]`` extra); this module and the counting need nothing beyond the library.

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

:func:`measured` is the decorator that times a command of the application (and
:func:`timed_command` the same around a block: an awaited command);
:func:`refusal_reasons` counts a refused placement's reasons.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from secondbox_scheduler.domain.errors import PlacementError, SchedulerError
from secondbox_scheduler.domain.lease import (
    OBSERVED_COALESCED,
    OBSERVED_EVIDENCE,
    OBSERVED_RENEWED,
    OBSERVED_STALE,
)
from secondbox_scheduler.domain.placement.evidence import reason_keys

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


@contextmanager
def timed_command(metrics: CommandRecorder, command: str) -> Iterator[None]:
    """:func:`measured` around a block (a coroutine's command, awaited within it)."""
    started = time.perf_counter()
    outcome = OUTCOME_ERROR
    try:
        yield
        outcome = OUTCOME_OK
    except SchedulerError:
        outcome = OUTCOME_REFUSED
        raise
    finally:
        metrics.command(command, outcome, time.perf_counter() - started)


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
    """What :class:`SchedulerMetrics` tells an exporter
    (:class:`~.prometheus_export.PrometheusMetrics`)."""

    def count(self, name: str, amount: int) -> None: ...

    def heartbeat(self, outcome: str) -> None: ...

    def refusal(self, operation: str, error: str, reasons: Mapping[str, int]) -> None: ...

    def reconcile(self, action: str) -> None: ...

    def command(self, command: str, outcome: str, seconds: float) -> None: ...

    def batch(self, size: int) -> None: ...
