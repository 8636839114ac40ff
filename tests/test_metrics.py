"""Prometheus metrics: on an embedder's own registry (opt-in, never the process-wide
one unless handed over), fed by the application's SchedulerMetrics, and served by the
HTTP service at ``/metrics`` with request durations by route template."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from secondbox_scheduler.domain import HomeRunnerUnavailableError, NoCompatibleRunnerError
from secondbox_scheduler.domain.errors import SerializationContentionError
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.reconciler import Reconciler
from tests.conftest import Clock, Store
from tests.factories import (
    RUNTIME,
    create_sandbox,
    materialization,
    register,
    schedule_request,
)
from tests.http_helpers import api_client, heartbeat_body, runner_body, sandbox_body, schedule_body
from tests.test_concurrency import Interfering

P = "secondbox_scheduler_"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(P + name, labels)


def test_an_embedder_counts_on_its_own_registry(store: Store, clock: Clock) -> None:
    registry = CollectorRegistry()
    app = store.open(metrics_registry=registry)
    register(app, "r1", at=clock())  # its heartbeat records evidence
    evidence: dict[str, Any] = {
        "artifact_digests": [RUNTIME],
        "materializations": [materialization()],
    }
    app.record_heartbeat(runner_id="r1", at=clock(), **evidence)  # coalesced
    app.record_heartbeat(runner_id="r1", at=clock() - timedelta(seconds=1), **evidence)  # stale
    create_sandbox(app, "s1")
    create_sandbox(app, "s2")
    request = schedule_request("s1", clock())
    app.schedule(request)
    app.schedule(request)  # a replay
    with pytest.raises(NoCompatibleRunnerError):
        create_sandbox(app, "s3", architecture="aarch64")
    app.start_drain("r1")
    with pytest.raises(HomeRunnerUnavailableError):
        app.schedule(schedule_request("s2", clock()))

    assert sample(registry, "placements_total") == 1
    assert sample(registry, "replays_total") == 1
    assert sample(registry, "refusals_recorded_total") == 2
    for outcome in ("evidence", "coalesced", "stale"):
        assert sample(registry, "heartbeats_total", outcome=outcome) == 1, outcome
    assert sample(registry, "heartbeats_total", outcome="renewed") == 0
    refused = {"operation": "schedule", "error": "HomeRunnerUnavailableError"}
    assert sample(registry, "refusals_total", **refused) == 1
    assert sample(registry, "refusal_reasons_total", operation="schedule", reason="draining") == 1
    created = {"operation": "create_sandbox", "error": "NoCompatibleRunnerError"}
    assert sample(registry, "refusals_total", **created) == 1
    assert (
        sample(registry, "refusal_reasons_total", operation="create_sandbox", reason="architecture")
        == 1
    )
    durations = "command_duration_seconds_count"
    assert sample(registry, durations, command="schedule", outcome="ok") == 2
    assert sample(registry, durations, command="schedule", outcome="refused") == 1
    assert sample(registry, durations, command="create_sandbox", outcome="refused") == 1
    assert sample(registry, durations, command="start_drain", outcome="ok") == 1
    assert sample(registry, "store_up") == 1
    assert sample(registry, "event_log_head_position") == app.head_position()
    for projection in ("runner_snapshots", "assignments"):
        assert sample(registry, "read_model_lag_events", projection=projection) is not None

    # The application's own counters say the same, and the process-wide registry is untouched.
    assert app.metrics.refusals[("schedule", "HomeRunnerUnavailableError")] == 1
    assert app.metrics.refusal_reasons[("create_sandbox", "architecture")] == 1
    assert app.metrics.commands[("schedule", "ok")] == 2
    assert REGISTRY.get_sample_value(P + "placements_total") is None


def test_contention_retries_and_errors_are_counted(store: Store, clock: Clock) -> None:
    app, rival = store.open(sleep=lambda _: None), store.open()
    exporter = app.attach_metrics()  # attached to a running application: a new registry
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.save_in_order = Interfering(app, rival, times=2)  # type: ignore[method-assign]
    with pytest.raises(SerializationContentionError):
        app.schedule(schedule_request("s1", clock(), serialization_retry_limit=1))
    assert sample(exporter.registry, "contention_retries_total") == 1
    assert sample(exporter.registry, "contention_errors_total") == 1
    assert (
        sample(exporter.registry, "command_duration_seconds_count", command="schedule",
               outcome="refused") == 1
    )  # fmt: skip


def test_reconcile_actions_and_the_batch_hook_are_counted(store: Store, clock: Clock) -> None:
    registry = CollectorRegistry()
    app = store.open(metrics_registry=registry)
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s1", clock(), operation_deadline=clock() + timedelta(minutes=1)))
    clock.advance(minutes=2)
    app.record_heartbeat(
        runner_id="r1", at=clock(), artifact_digests=[RUNTIME], materializations=[materialization()]
    )
    assert Reconciler(app, "rec").run_once() == (1, 1)
    assert sample(registry, "reconcile_actions_total", action="deadline_exceeded") == 1
    assert sample(registry, "reconcile_actions_total", action="uncertain") == 0
    assert sample(registry, "placement_batch_size_count") == 1  # the schedule: one request
    assert sample(registry, "placement_batch_size_sum") == 1
    app.metrics.batch(5)  # what a placement batcher reports per batch
    assert sample(registry, "placement_batch_size_count") == 2
    assert sample(registry, "placement_batch_size_sum") == 6


def test_the_in_memory_store_exports_no_read_model_lag(clock: Clock) -> None:
    registry = CollectorRegistry()
    app = SchedulerApplication(now=clock, metrics_registry=registry)
    register(app, "r1", at=clock())
    assert sample(registry, "store_up") == 1
    assert sample(registry, "read_model_lag_events", projection="assignments") is None
    assert sample(registry, "event_log_head_position") == app.head_position()


def test_the_service_serves_its_registry_with_request_durations_by_route(
    store: Store, clock: Clock
) -> None:
    with api_client(store.open()) as client:
        client.post("/v1/runners", json=runner_body("r1"))
        client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(clock()))
        client.post("/v1/sandboxes", json=sandbox_body("s1"))
        placed = client.post("/v1/sandboxes/s1/schedule", json=schedule_body("s1", clock()))
        assert placed.status_code == 201
        client.get("/v1/runners/nobody")
        scrape = client.get("/metrics")
    assert scrape.headers["content-type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(scrape.text)}
    assert [s.value for s in families[P + "placements"].samples if s.name.endswith("_total")] == [
        1.0
    ]
    requests = [
        s for s in families[P + "http_request_duration_seconds"].samples
        if s.name.endswith("_count")
    ]  # fmt: skip
    routes = {
        (s.labels["method"], s.labels["route"], s.labels["status"]): s.value for s in requests
    }
    assert routes[("POST", "/v1/sandboxes/{sandbox_id}/schedule", "201")] == 1
    assert routes[("GET", "/v1/runners/{runner_id}", "404")] == 1
    assert all(route.startswith("/") or route == "unmatched" for _, route, _ in routes)
    assert not any("nobody" in route or "s1" in route for _, route, _ in routes)


def test_two_services_over_one_scheduler_share_its_registry(store: Store, clock: Clock) -> None:
    scheduler = store.open()
    first, second = create_app(scheduler), create_app(scheduler)
    assert first.state.registry is second.state.registry
    with api_client(scheduler) as client:  # a third, served
        assert client.post("/v1/runners", json=runner_body("r1")).status_code == 201
        assert (
            "secondbox_scheduler_http_request_duration_seconds_count" in client.get("/metrics").text
        )
