"""The lists (docs/api.md, "Lists"): sandboxes, assignments by state, runners by pool
and drain phase, a page at a time, over HTTP and in the library.

Paging from the first page to the last while replicas write returns every item once:
none twice, none of those that existed when the paging began missing; the filters
return exactly their items; a read model that lags loses no item; a cursor that is
not this list's own, or a limit below 1, is refused naming the field; a huge limit is
served bounded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from secondbox_scheduler.domain.reconcile import ACTION_UNCERTAIN, ReconcileDecision
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.feed import lists, reading
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, requirements, schedule_request
from tests.feed_helpers import Writers
from tests.http_helpers import api_client, error_of

# list path -> (the items' key in a page, the key of one item)
LISTS: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "/v1/sandboxes": ("sandboxes", lambda item: item["sandbox_id"]),
    "/v1/assignments": ("assignments", lambda item: (item["sandbox_id"], item["generation"])),
    "/v1/runners": ("runners", lambda item: item["id"]),
}


def _every(client: httpx.Client, path: str, **params: Any) -> list[Any]:
    """Every item of the list, paging with next until it is null."""
    name, key = LISTS[path]
    found: list[Any] = []
    cursor = None
    for _ in range(10_000):
        query = {**params, **({} if cursor is None else {"cursor": cursor})}
        response = client.get(path, params=query)
        assert response.status_code == 200, response.text
        page = response.json()
        found += [key(item) for item in page[name]]
        cursor = page["next"]
        if cursor is None:
            return found
    raise AssertionError("the pages never ended")


@pytest.mark.parametrize("path", sorted(LISTS))
def test_paging_while_writes_go_on_returns_every_item_exactly_once(
    store: Store, clock: Clock, path: str
) -> None:
    first = Writers(store.open, clock, rounds=3)
    first.start()
    first.join()
    app = store.open()
    with api_client(app) as client:
        before = set(_every(client, path))
        assert len(before) >= 6
        go_on = threading.Event()
        writers = Writers(store.open, clock, rounds=4, midway=go_on, prefix="b")
        writers.start()
        go_on.set()
        during = _every(client, path, limit=2)  # paging while they write
        writers.join()
        after = _every(client, path, limit=3)
    assert len(during) == len(set(during))  # no item twice
    assert before <= set(during) <= set(after)  # none that existed missing
    assert len(after) == len(set(after))
    assert len(set(after) - before) >= 8  # the writers did write meanwhile


def _uncertain(app: SchedulerApplication, clock: Clock, sandbox_id: str, token: bytes) -> None:
    app.claim_reconcile(sandbox_id, 1, "rec", clock() + timedelta(minutes=1))
    app.record_reconcile(sandbox_id, 1, "rec", ReconcileDecision(ACTION_UNCERTAIN, "silent", None))


def test_the_filters_return_exactly_their_items(app: SchedulerApplication, clock: Clock) -> None:
    for runner, pool in (("r1", "pool-a"), ("r2", "pool-a"), ("r3", "pool-b")):
        register(app, runner, at=clock(), pool_name=pool)
    app.start_drain("r2")
    fences = {}
    for sandbox, pool in (("s1", "pool-a"), ("s2", "pool-a"), ("s3", "pool-b"), ("s4", "pool-b")):
        create_sandbox(app, sandbox, pool_name=pool)
        assignment, _ = app.schedule(
            schedule_request(sandbox, clock(), requirements=requirements(pool_name=pool))
        )
        fences[sandbox] = assignment.fencing_token
    _uncertain(app, clock, "s1", fences["s1"])
    _uncertain(app, clock, "s3", fences["s3"])
    app.mark_running("s2", 1, fences["s2"])
    register(app, "r4", at=clock(), pool_name="pool-b")
    app.deregister_runner("r4")
    with api_client(app) as client:
        uncertain = _every(client, "/v1/assignments", state="uncertain")
        assert uncertain == [("s1", 1), ("s3", 1)]
        assert _every(client, "/v1/assignments", state="running") == [("s2", 1)]
        assert _every(client, "/v1/assignments", runner_id="r3") == [("s3", 1), ("s4", 1)]
        assert _every(client, "/v1/runners") == ["r1", "r2", "r3"]  # r4 is deregistered
        assert _every(client, "/v1/runners", pool_name="pool-a") == ["r1", "r2"]
        assert _every(client, "/v1/runners", drain_phase="draining") == ["r2"]
        assert _every(client, "/v1/runners", pool_name="pool-a", drain_phase="active") == ["r1"]
        assert _every(client, "/v1/sandboxes", pool_name="pool-b") == ["s3", "s4"]
        assert _every(client, "/v1/sandboxes", home_runner_id="r1") == ["s1", "s2"]
        sandboxes = client.get("/v1/sandboxes").json()["sandboxes"]
    states = {item["sandbox_id"]: item["state"] for item in sandboxes}
    assert states == {"s1": "uncertain", "s2": "running", "s3": "uncertain", "s4": "assigned"}


def test_a_narrow_filter_pages_past_its_scan_budget(
    app: SchedulerApplication, clock: Clock
) -> None:
    for index in range(5):
        register(app, f"r{index}", at=clock(), heartbeat=False)
    app.start_drain("r4")
    page = lists.list_runners(app, drain_phase="draining", scan_budget=2)
    assert page.items == []
    assert page.next is not None  # not the end: the next page goes on from there
    found = []
    cursor: str | None = None
    while True:
        page = lists.list_runners(app, drain_phase="draining", scan_budget=2, cursor=cursor)
        found += [runner.id for runner in page.items]
        cursor = page.next
        if cursor is None:
            break
    assert found == ["r4"]


def test_a_lagging_read_model_loses_no_item(store: Store, clock: Clock) -> None:
    writer = SchedulerApplication(env={**store.env, "SECONDBOX_READ_MODELS": "off"}, now=clock)
    store.opened.append(writer)
    for index in range(3):
        register(writer, f"r{index}", at=clock())
        create_sandbox(writer, f"s{index}")
        writer.schedule(schedule_request(f"s{index}", clock()))
    reader = SchedulerApplication(
        env={**store.env, "SECONDBOX_READ_MODELS": "external"}, now=clock
    )  # trusts another process to keep the read models: nobody does here
    try:
        assert reader.read_models is not None
        assert reader.read_models.position("runner_snapshots") == 0
        assert [r.id for r in lists.list_runners(reader).items] == ["r0", "r1", "r2"]
        assignments = lists.list_assignments(reader, state="assigned").items
        assert [a.sandbox_id for a in assignments] == ["s0", "s1", "s2"]
    finally:
        reader.close()


def test_bad_cursors_and_limits_are_refused_naming_the_field(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    with api_client(app) as client:
        runners_next = client.get("/v1/runners", params={"limit": 1}).json()["next"]
        assert runners_next is not None
        sandboxes_cursor = lists.cursor_text(lists.SANDBOXES, 1)
        for path, params, field in [
            ("/v1/runners", {"cursor": "not a cursor"}, "cursor"),
            ("/v1/runners", {"cursor": sandboxes_cursor}, "cursor"),  # another list's
            ("/v1/sandboxes", {"cursor": runners_next}, "cursor"),
            ("/v1/runners", {"cursor": runners_next + "A"}, "cursor"),
            ("/v1/runners", {"cursor": lists.cursor_text(lists.RUNNERS, 2**63)}, "cursor"),
            ("/v1/runners", {"cursor": "x" * 65}, "cursor"),
            ("/v1/runners", {"limit": 0}, "limit"),
            ("/v1/assignments", {"limit": -5}, "limit"),
            ("/v1/assignments", {"state": "lost"}, "state"),
            ("/v1/runners", {"drain_phase": "resting"}, "drain_phase"),
            ("/v1/sandboxes", {"pool_name": "a\u0000b"}, "pool_name"),
        ]:
            response = client.get(path, params=params)
            assert error_of(response, 422, "invalid_request")["field"] == field, (path, params)
        second = client.get("/v1/runners", params={"cursor": runners_next}).json()
    assert [runner["id"] for runner in second["runners"]] == ["r2"]
    assert second["next"] is None


def test_a_huge_limit_is_served_bounded(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reading, "MAX_LIMIT", 2)
    for index in range(5):
        register(app, f"r{index}", at=clock(), heartbeat=False)
    with api_client(app) as client:
        page = client.get("/v1/runners", params={"limit": 10**40}).json()
        assert [runner["id"] for runner in page["runners"]] == ["r0", "r1"]
        assert _every(client, "/v1/runners", limit=10**40) == [f"r{i}" for i in range(5)]


def _cli(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def test_the_command_line_pages_the_lists_and_prints_the_feed(tmp_path: Path, clock: Clock) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    try:
        for index in range(3):
            register(app, f"r{index}", at=clock(), pool_name="pool-b" if index else "pool-a")
        create_sandbox(app, "s1")
        assignment, _ = app.schedule(schedule_request("s1", clock()))
        _uncertain(app, clock, "s1", assignment.fencing_token)
        app.start_drain("r2")
    finally:
        app.close()
    db = ("--database-url", url)
    found, cursor = [], None
    while True:
        more = ("--cursor", cursor) if cursor else ()
        result = _cli("list", "runners", *db, "--pool", "pool-b", "--limit", "1", "--json", *more)
        assert result.exit_code == 0, result.output
        page = json.loads(result.stdout)
        found += [item["id"] for item in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert found == ["r1", "r2"]
    draining = json.loads(
        _cli("list", "runners", *db, "--drain-phase", "draining", "--json").stdout
    )
    assert [item["id"] for item in draining["items"]] == ["r2"]
    uncertain = json.loads(
        _cli("list", "assignments", *db, "--state", "uncertain", "--json").stdout
    )
    assert [(a["sandbox_id"], a["state"]) for a in uncertain["items"]] == [("s1", "uncertain")]
    sandboxes = json.loads(_cli("list", "sandboxes", *db, "--json").stdout)
    assert [(s["sandbox_id"], s["state"]) for s in sandboxes["items"]] == [("s1", "uncertain")]
    table = _cli("list", "runners", *db, "--limit", "2")
    assert table.exit_code == 0
    assert "next page: --cursor " in table.stdout
    bad = _cli("list", "runners", *db, "--cursor", "nonsense")
    assert bad.exit_code == 2
    assert "cursor" in bad.output
    feed = _cli("events", *db, "--type", "Sandbox.AssignmentFenced", "--json")
    assert feed.exit_code == 0, feed.output
    [fenced] = [json.loads(line) for line in feed.stdout.splitlines()]
    assert fenced["sandbox_id"] == "s1"
    assert fenced["actor"]["kind"] == "library"
    every = _cli("events", *db, "--json")
    positions = [json.loads(line)["position"] for line in every.stdout.splitlines()]
    assert positions == sorted(positions)
    assert len(positions) == len(set(positions))
    assert _cli("events", *db, "--type", "Nope.Never").exit_code == 2


def test_a_page_covers_a_bounded_window_of_the_log(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lists, "POSITION_WINDOW", 5)
    for index in range(3):
        register(app, f"r{index}", at=clock())  # Registered at 1, 4, 7 of 9 positions
    page = lists.list_runners(app, limit=10)
    assert [runner.id for runner in page.items] == ["r0", "r1"]  # positions 1 to 5
    assert page.next == lists.cursor_text(lists.RUNNERS, 5)
    rest = lists.list_runners(app, limit=10, cursor=page.next)
    assert ([runner.id for runner in rest.items], rest.next) == (["r2"], None)
