"""Limits of the HTTP service (docs/operations.md, "The HTTP service"; docs/spec.md):
a body past the maximum size is 413 before the handler runs; the request metrics'
labels are bounded whatever methods and paths clients invent; every time field is
bounded on both sides, so no stored time can break a later read."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock, Store
from tests.factories import register
from tests.http_helpers import (
    api_client,
    error_of,
    heartbeat_body,
    runner_body,
    sandbox_body,
    schedule_body,
)

MIB = 2**20
# The methods the request metrics name (RFC 9110's); any other method counts as "other".
METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
OTHER_METHOD = "other"


@pytest.fixture
def sqlite_app(tmp_path: Path, clock: Clock) -> Iterator[SchedulerApplication]:
    env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "s.db")}
    app = SchedulerApplication(env=env, now=clock)
    try:
        yield app
    finally:
        app.close()


def reached(app: SchedulerApplication, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Calls of ``register_runner`` (the handler of POST /v1/runners) from now on."""
    calls: list[Any] = []
    monkeypatch.setattr(app, "register_runner", lambda **fields: calls.append(fields))
    return calls


def test_a_body_past_the_maximum_is_413_and_never_reaches_the_handler(
    sqlite_app: SchedulerApplication, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = reached(sqlite_app, monkeypatch)
    huge = runner_body("r1", pool_name="p" * (2 * MIB))  # about 2 MB of JSON
    with api_client(sqlite_app) as client:
        response = client.post("/v1/runners", json=huge)
        detail = error_of(response, 413, "body_too_large")
        assert "1048576" in detail["message"]
        # Streamed without a Content-Length (chunked): counted as it arrives.
        chunks = (b"x" * 65536 for _ in range(64))  # 4 MiB
        streamed = client.post(
            "/v1/runners", content=chunks, headers={"content-type": "application/json"}
        )
        error_of(streamed, 413, "body_too_large")
        assert calls == []
        # Under the limit, the same route works.
        assert client.post("/v1/runners", json=runner_body("r1")).status_code != 413
    assert len(calls) == 1
    assert sqlite_app.event_count() == 0


def test_the_maximum_body_size_is_a_setting(sqlite_app: SchedulerApplication) -> None:
    with api_client(sqlite_app, max_body_bytes=1024) as client:
        big = client.post("/v1/runners", json=runner_body("r1", pool_name="p" * 2000))
        error_of(big, 413, "body_too_large")
        small = client.post("/v1/runners", json=runner_body("r1"))
        assert small.status_code == 201, small.text


def label_values(text: str, name: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(name) and label in sample.labels
    }


def test_invented_methods_and_paths_do_not_grow_the_metrics(
    sqlite_app: SchedulerApplication,
) -> None:
    name = "secondbox_scheduler_http_request_duration_seconds"
    with api_client(sqlite_app) as client:
        client.get("/healthz")
        baseline = len(client.get("/metrics").text)
        # methods registered for HTTP but not the service's: each reaches the service
        # (under h11 and httptools alike) and is counted as "other"
        for method in ("PROPFIND", "MKCOL", "PURGE", "LINK", "SEARCH", "REPORT"):
            client.request(method, "/v1/runners")
        for number in range(300):  # invented: httptools refuses them (400) before the app
            client.request(f"X{number}Y", "/v1/runners")
            client.request(f"M{number}", f"/no/such/path/{number}")
            client.get(f"/v1/runners/{number}")
            client.get(f"/unknown-{number}")
        text = client.get("/metrics").text
    methods = label_values(text, name, "method")
    assert methods <= {*METHODS, OTHER_METHOD}, methods
    assert OTHER_METHOD in methods
    routes = label_values(text, name, "route")
    assert all(not route.startswith("/no/such") for route in routes), routes
    assert "/v1/runners/{runner_id}" in routes
    assert len(routes) < 20, routes
    assert len(label_values(text, name, "status")) < 10
    assert len(text) < baseline + 40_000, (baseline, len(text))


def test_a_far_past_first_heartbeat_is_refused_and_the_runner_still_reads(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    with api_client(app) as client:
        assert client.post("/v1/runners", json=runner_body("r1")).status_code == 201
        before = app.event_count()
        two_days_ago = (clock() - timedelta(days=2)).isoformat()
        for at in ("0001-01-01T00:00:00Z", two_days_ago):  # the model's range; the clock's
            body = {**heartbeat_body(clock()), "at": at}
            refused = client.post("/v1/runners/r1/heartbeat", json=body)
            detail = error_of(refused, 422, "invalid_request")
            assert detail["field"] == "at", detail
            assert "earlier" in detail["rule"] or "from 1970" in detail["rule"], detail
        assert app.event_count() == before
        assert client.get("/v1/runners/r1").status_code == 200
        assert client.get("/v1/runners").status_code == 200
        assert client.get("/v1/runners/r1/timeline").status_code == 200


def test_a_heartbeat_older_than_the_largest_timeout_is_refused_by_the_application(
    store: Store, clock: Clock
) -> None:
    from secondbox_scheduler.domain import InvalidRequestError

    app = store.open()
    register(app, "r1", at=clock())
    before = app.event_count()
    for at in (clock() - timedelta(days=1, seconds=1), clock().replace(year=1)):
        with pytest.raises(InvalidRequestError) as refused:
            app.record_heartbeat(runner_id="r1", at=at)
        assert refused.value.field == "at"
        assert "earlier" in refused.value.rule
    assert app.event_count() == before
    # Within the largest heartbeat timeout, an old heartbeat is stale, not refused.
    assert app.record_heartbeat(runner_id="r1", at=clock() - timedelta(hours=23)) == "stale"


@pytest.mark.parametrize(
    "field", ["claim_expires_at", "operation_deadline", "effect_started_at", "plan_ready_at"]
)
def test_every_time_field_of_a_request_is_within_a_sane_range(
    sqlite_app: SchedulerApplication, clock: Clock, field: str
) -> None:
    with api_client(sqlite_app) as client:
        assert client.post("/v1/runners", json=runner_body("r1")).status_code == 201
        client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(clock()))
        assert client.post("/v1/sandboxes", json=sandbox_body("s1")).status_code == 201
        before = sqlite_app.event_count()
        body = {**schedule_body("s1", clock()), field: "0001-01-01T00:00:00Z"}
        refused = client.post("/v1/sandboxes/s1/schedule", json=body)
        detail = error_of(refused, 422, "invalid_request")
        assert detail["field"] == field, detail
        assert sqlite_app.event_count() == before
        assert client.get("/v1/sandboxes/s1/assignments").status_code == 200


def test_stored_times_of_any_year_read_back_and_sort_as_times() -> None:
    from datetime import UTC, datetime

    from secondbox_scheduler.projections.sql_view import text_time, time_text

    times = [
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ]
    texts = [time_text(t) for t in times]
    assert [text_time(t) for t in texts] == times
    assert sorted(texts) == texts  # type: ignore[type-var]


def test_a_far_past_claim_expiry_is_refused_and_the_earliest_accepted_reads_back(
    store: Store, clock: Clock
) -> None:
    """docs/spec.md (sections 6a and 9): a claim expiry earlier than the clock - the
    largest heartbeat timeout is refused; one as early as that (before ``now``) is
    stored, and the read models read it back like any other time."""
    from secondbox_scheduler.domain.errors import InvalidRequestError
    from secondbox_scheduler.domain.limits import MAX_HEARTBEAT_TIMEOUT
    from tests.factories import create_sandbox, schedule_request

    app = store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    with pytest.raises(InvalidRequestError):
        app.schedule(schedule_request("s1", clock(), claim_expires_at=clock().replace(year=1)))
    earliest = clock() - MAX_HEARTBEAT_TIMEOUT
    app.schedule(schedule_request("s1", clock(), claim_expires_at=earliest))
    assert [a.claim_expires_at for a in app.assignments("s1")] == [earliest]
    assert [a.sandbox_id for a in app.runner_assignments("r1")] == ["s1"]
