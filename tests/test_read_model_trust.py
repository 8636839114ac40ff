"""Read models are caches, never the authority (docs/spec.md, section 8.1; invariant 7).

Findings of a red team, each a test: a row of ``runner_snapshots`` rewritten behind the
application's back never becomes a home runner, and the recorded evidence is the
aggregates'; a tracking position moved past the log's head is reported (status,
``/readyz``) rather than silently stopping the read models; ``projections verify``
compares the read models with a fold of the log and names every difference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from typer.testing import CliRunner

from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.placement.rules import decide, home_decision_record
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.projections.read_models import ReadModelAheadError, ReadModels
from secondbox_scheduler.projections.sql_view import SqlView, time_text
from tests.conftest import Clock, Store
from tests.factories import HEARTBEAT_TIMEOUT, create_sandbox, register, requirements
from tests.http_helpers import api_client

TAMPERED_POSITION = 10**9


def read_models_of(app: SchedulerApplication) -> ReadModels:
    assert app.read_models is not None
    return app.read_models


def tamper(view: SqlView, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Run ``sql`` (``{table}`` is the view's table, ``{tracking}`` its tracking table)
    on the view's database, behind the application's back."""
    statement = sql.replace("{tracking}", view._tracking_name())
    with view.datastore.transaction(commit=True) as cursor:  # type: ignore[attr-defined]
        cursor.execute(view._sql(view._format(statement)), params)


def drained_and_silent_r1(app: SchedulerApplication, clock: Clock) -> None:
    """r1 (which would rank first) drained and silent past the heartbeat timeout; r2
    active and fresh. Then r1's row is made to look active and fresh."""
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    app.start_drain("r1")
    clock.advance(seconds=HEARTBEAT_TIMEOUT.total_seconds() * 2)
    register_heartbeat(app, "r2", clock)
    read_models_of(app).catch_up()
    tamper(
        read_models_of(app).runners,
        "UPDATE {table} SET drain_phase = %s, last_heartbeat_at = %s WHERE runner_id = %s",
        ("active", time_text(clock()), "r1"),
    )


def register_heartbeat(app: SchedulerApplication, runner_id: str, clock: Clock) -> None:
    from tests.factories import RUNTIME, materialization

    app.record_heartbeat(
        runner_id=runner_id,
        at=clock(),
        artifact_digests=[RUNTIME],
        materializations=[materialization()],
    )


def home_decision(app: SchedulerApplication, sandbox_id: str) -> dict[str, Any]:
    created = app.events.get(sandbox_uuid(sandbox_id))
    first = next(iter(created))
    assert isinstance(first, Sandbox.Created)
    return dict(first.home_decision)


def test_a_tampered_runner_row_never_becomes_a_home(store: Store, clock: Clock) -> None:
    app = store.open()
    drained_and_silent_r1(app, clock)
    lied = read_models_of(app).runners.snapshot("r1")
    assert lied is not None
    assert lied.drain_phase == "active", "the row lies"
    assert create_sandbox(app, "s1") == "r2", "the aggregates refuse r1: drained and silent"
    expected = home_decision_record(
        decide(requirements(), app.fold_runner_snapshots("pool-a"), clock(), HEARTBEAT_TIMEOUT),
        clock(),
        HEARTBEAT_TIMEOUT,
    )
    recorded = home_decision(app, "s1")
    assert recorded == expected, "the recorded evidence is the aggregates'"
    r1 = next(c for c in recorded["candidates"] if c["runner_id"] == "r1")
    assert {failure["code"] for failure in r1["failures"]} == {"draining", "heartbeat_stale"}


def test_a_runner_the_read_model_overrates_is_judged_on_its_aggregates(
    store: Store, clock: Clock
) -> None:
    """The row of r2 claims more free capacity than r2 has: r2 is still compatible, but
    it is recorded with the aggregate's numbers, and ranked by them (below r1). The
    candidates are listed in the read model's order (r2 first), a list the evidence
    does not rank by."""
    app = store.open()
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    read_models_of(app).catch_up()
    tamper(
        read_models_of(app).runners,
        "UPDATE {table} SET allocatable_instances = 400 WHERE runner_id = %s",
        ("r2",),
    )
    home = create_sandbox(app, "s1")
    expected = home_decision_record(
        decide(requirements(), app.fold_runner_snapshots("pool-a"), clock(), HEARTBEAT_TIMEOUT),
        clock(),
        HEARTBEAT_TIMEOUT,
    )
    assert home == expected["chosen_runner_id"] == "r1"
    assert by_runner(home_decision(app, "s1")) == by_runner(expected)


def by_runner(decision: Mapping[str, Any]) -> dict[str, Any]:
    """A home decision with its candidates in runner id order."""
    return {**decision, "candidates": sorted(decision["candidates"], key=lambda c: c["runner_id"])}


def move_positions(app: SchedulerApplication, position: int) -> None:
    for view in read_models_of(app).views.values():
        tamper(view, "UPDATE {tracking} SET notification_id = %s", (position,))


def test_a_position_beyond_the_head_is_an_error_not_a_silent_stop(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    register(app, "r1", at=clock())
    read_models_of(app).catch_up()
    move_positions(app, TAMPERED_POSITION)
    register(app, "r2", at=clock())  # inline: its registration must not be skipped silently
    with pytest.raises(ReadModelAheadError, match="beyond the log's head"):
        read_models_of(app).catch_up()
    with pytest.raises(ReadModelAheadError):
        app.get_runner("r2")
    statuses = read_models_of(app).status()
    assert all(status.error for status in statuses)
    assert all("beyond the log's head" in (status.error or "") for status in statuses)
    assert all(status.to_dict()["error"] == status.error for status in statuses)


def test_readiness_refuses_a_position_beyond_the_head(store: Store, clock: Clock) -> None:
    for mode in ("on", "external"):
        app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": mode}, now=clock)
        store.opened.append(app)
        register(app, f"r-{mode}", at=clock())
        read_models_of(app).catch_up()
        with api_client(app) as client:
            assert client.get("/readyz").status_code == 200
            move_positions(app, TAMPERED_POSITION)
            answer = client.get("/readyz")
            assert answer.status_code == 503, mode
            body = answer.json()
            assert body["ready"] is False
            assert body["store"] == "ok"
            assert any("beyond the log's head" in reason for reason in body["reasons"])
            read_models_of(app).clear()  # a rebuild repairs it
            read_models_of(app).catch_up()
            assert client.get("/readyz").status_code == 200


def test_readiness_bound_is_a_setting(store: Store, clock: Clock) -> None:
    app = SchedulerApplication(
        env={**store.env, "SECONDBOX_READ_MODELS": "external", "SECONDBOX_READY_MAX_LAG": "2"},
        now=clock,
    )
    store.opened.append(app)
    register(app, "r1", at=clock())  # three events, none applied
    with api_client(app) as client:
        body = client.get("/readyz").json()
        assert body["max_lag_events"] == 2
        assert body["ready"] is False
        assert any("behind the log" in reason for reason in body["reasons"])
    with pytest.raises(Exception, match="SECONDBOX_READY_MAX_LAG"):
        create_app(
            SchedulerApplication(env={**store.env, "SECONDBOX_READY_MAX_LAG": "many"}, now=clock)
        )


def verify_cli(app: SchedulerApplication, url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["projections", "verify", "--database-url", url, *args])
    return result.exit_code, result.stdout


@pytest.fixture
def url(store: Store, request: pytest.FixtureRequest) -> str:
    if store.kind == "sqlite":
        return f"sqlite:///{store.env['SQLITE_DBNAME']}"
    schema = request.getfixturevalue("postgres_schema")
    return str(schema.url())


def small_history(app: SchedulerApplication, clock: Clock) -> None:
    from tests.factories import schedule_request

    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    for sandbox_id in ("s1", "s2", "s3"):
        create_sandbox(app, sandbox_id)
        app.schedule(schedule_request(sandbox_id, clock()))
    app.start_drain("r2")
    read_models_of(app).catch_up()


def test_verify_passes_on_a_clean_history(store: Store, clock: Clock, url: str) -> None:
    app = store.open()
    small_history(app, clock)
    code, out = verify_cli(app, url, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["equal"] is True
    assert report["differences"] == []
    assert report["runners"] == 2
    assert report["assignments"] == 3


def test_verify_names_a_tampered_runner_field(store: Store, clock: Clock, url: str) -> None:
    app = store.open()
    small_history(app, clock)
    tamper(
        read_models_of(app).runners,
        "UPDATE {table} SET drain_phase = %s WHERE runner_id = %s",
        ("active", "r2"),
    )
    code, out = verify_cli(app, url, "--json")
    assert code == 1, out
    differences = json.loads(out)["differences"]
    assert differences == [
        {
            "read_model": "runner_snapshots",
            "key": "r2",
            "field": "drain_phase",
            "read_model_value": "active",
            "folded_value": "draining",
        }
    ]
    code, text = verify_cli(app, url)
    assert code == 1
    assert "r2" in text
    assert "drain_phase" in text


def test_verify_names_tampered_missing_and_extra_assignment_rows(
    store: Store, clock: Clock, url: str
) -> None:
    app = store.open()
    small_history(app, clock)
    assignments = read_models_of(app).assignments
    tamper(assignments, "UPDATE {table} SET state = %s WHERE sandbox_id = %s", ("released", "s1"))
    tamper(assignments, "DELETE FROM {table} WHERE sandbox_id = %s", ("s2",))
    tamper(
        read_models_of(app).runners,
        "UPDATE {table} SET reserved_instances = 0 WHERE runner_id = %s",
        ("r1",),
    )
    code, out = verify_cli(app, url, "--json")
    assert code == 1, out
    found = {(d["read_model"], d["key"], d["field"]) for d in json.loads(out)["differences"]}
    assert ("assignments", "s1/1", "state") in found
    assert ("assignments", "s2/1", "row") in found
    assert ("runner_snapshots", "r1", "reserved.instances") in found


def test_verify_reports_a_position_beyond_the_head(store: Store, clock: Clock, url: str) -> None:
    app = store.open()
    small_history(app, clock)
    move_positions(app, TAMPERED_POSITION)
    code, out = verify_cli(app, url, "--json")
    assert code == 1, out
    found = {(d["read_model"], d["field"]) for d in json.loads(out)["differences"]}
    assert found == {("runner_snapshots", "position"), ("assignments", "position")}


def test_a_lagging_heartbeat_is_checked_without_folding_the_pool(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read model lags (external): the chosen runner's aggregates differ from its
    row only by a newer heartbeat, so the choice stands on the aggregates' snapshot and
    the pool is not folded."""
    app = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    store.opened.append(app)
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    read_models_of(app).catch_up()
    clock.advance(seconds=20)
    register_heartbeat(app, "r1", clock)  # not applied to the read model

    def no_pool_fold(pool_name: str | None = None) -> list[Any]:
        raise AssertionError("the pool was folded")

    monkeypatch.setattr(app.queries, "fold_runner_snapshots", no_pool_fold)
    assert create_sandbox(app, "s1") == "r1"
    recorded = home_decision(app, "s1")
    assert recorded["chosen_runner_id"] == "r1"


def test_a_query_on_a_read_model_ahead_of_the_log_answers_503(store: Store, clock: Clock) -> None:
    app = store.open()
    register(app, "r1", at=clock())
    read_models_of(app).catch_up()
    with api_client(app) as client:
        move_positions(app, TAMPERED_POSITION)
        answer = client.get("/v1/runners/r1")
        assert answer.status_code == 503
        assert answer.json()["code"] == "read_model_unavailable"
        assert "beyond the log's head" in answer.json()["detail"]
