"""The event feed (docs/api.md, "Event feed"): ``GET /v1/events``, its long poll, the
server-sent events of ``/v1/events/stream``, and ``follow`` for embedders.

A follower from position 0 must see every event of the log exactly once and in log
order, across a restart of the service and while replicas write, whether it pages
with ``after=next`` (long-polling) or streams and reconnects with ``Last-Event-ID``;
the filters let through exactly the events that concern what they name; bad input is
problem details naming the field, a huge limit is served bounded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from secondbox_scheduler import events
from secondbox_scheduler.domain.event_catalogue import event_classes, event_name, unaccounted
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.feed import reading
from secondbox_scheduler.infrastructure.feed.reading import MAX_LIMIT, FeedFilter, read_feed
from secondbox_scheduler.infrastructure.feed.subjects import RULES
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, schedule_request
from tests.feed_helpers import RestartableService, Writers, log_positions
from tests.http_helpers import api_client, error_of, schedule_body

DEADLINE = 90.0  # seconds a follower may take to catch up (a guard, not a measure)


def test_every_event_class_has_a_subject_rule_and_an_export() -> None:
    assert unaccounted(RULES, {}) == []
    assert set(events.EVENT_TYPES) == {event_name(cls) for cls in event_classes()}
    for name, cls in events.EVENT_TYPES.items():
        assert getattr(events, name.replace(".", "")) is cls, name
        assert {"timestamp", "actor"} <= set(events.schema(name))


def _poll_follower(
    url: Callable[[], str], seen: list[int], done: threading.Event, head: list[int]
) -> None:
    """Pages with after=next, long-polling; retries while the service is away."""
    after = 0
    with httpx.Client(timeout=10) as client:
        while not (done.is_set() and head and after >= head[0]):
            try:
                response = client.get(
                    f"{url()}/v1/events", params={"after": after, "limit": 5, "wait": 0.5}
                )
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if response.status_code == 503:
                continue
            assert response.status_code == 200, response.text
            page = response.json()
            seen += [event["position"] for event in page["events"]]
            assert page["next"] >= after
            after = page["next"]


def _stream_follower(
    url: Callable[[], str], seen: list[int], done: threading.Event, head: list[int]
) -> None:
    """Reads the stream, reconnecting with Last-Event-ID as EventSource does."""
    last: int | None = None
    with httpx.Client(timeout=10) as client:
        while not (done.is_set() and head and last is not None and last >= head[0]):
            headers = {} if last is None else {"Last-Event-ID": str(last)}
            try:
                with client.stream(
                    "GET", f"{url()}/v1/events/stream", params={"timeout": 1}, headers=headers
                ) as response:
                    if response.status_code == 503:
                        continue
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    pending: dict[str, str] = {}
                    for line in response.iter_lines():
                        if line:
                            name, _, value = line.partition(": ")
                            pending[name] = value
                            continue
                        if "id" in pending:  # an event, or an id alone (positions skipped)
                            last = int(pending["id"])
                        if "data" in pending:
                            event = json.loads(pending["data"])
                            assert event["position"] == last
                            assert pending["event"] == event["type"]
                            seen.append(event["position"])
                        pending = {}
            except (httpx.TransportError, httpx.RemoteProtocolError):
                time.sleep(0.05)


@pytest.mark.parametrize("follower", [_poll_follower, _stream_follower], ids=["poll", "stream"])
def test_a_follower_from_0_sees_every_event_once_in_order_across_a_restart_while_writes_go_on(
    store: Store, clock: Clock, follower: Callable[..., None]
) -> None:
    service = RestartableService(store.open)
    service.start()
    seen: list[int] = []
    done, head = threading.Event(), list[int]()
    reader = threading.Thread(
        target=follower, args=(lambda: service.url, seen, done, head), daemon=True
    )
    reader.start()
    midway = threading.Event()
    writers = Writers(store.open, clock, midway=midway)
    writers.start()
    started = time.monotonic()
    while len(seen) < 10 and time.monotonic() - started < DEADLINE:
        time.sleep(0.02)
    assert len(seen) >= 10, "the follower saw nothing"
    midway.set()  # the second half of the writes goes on while the service restarts
    service.restart()
    writers.join()
    final = store.open()
    positions = log_positions(final)
    head.append(positions[-1])
    done.set()
    reader.join(timeout=DEADLINE)
    assert not reader.is_alive(), "the follower never caught up"
    service.stop()
    assert seen == positions  # every event, once, in log order
    assert len(positions) > 60


def test_follow_gives_every_event_once_in_order_while_writes_go_on(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    stop = threading.Event()
    seen: list[int] = []

    def follower() -> None:
        for item in events.follow(app, after=0, stop=stop, poll_seconds=0.05):
            seen.append(item.position)

    thread = threading.Thread(target=follower, daemon=True)
    thread.start()
    writers = Writers(store.open, clock, rounds=4)
    writers.start()
    writers.join()
    positions = log_positions(app)
    started = time.monotonic()
    while len(seen) < len(positions) and time.monotonic() - started < DEADLINE:
        time.sleep(0.02)
    stop.set()
    thread.join(timeout=10)
    assert seen == positions
    # resuming after a position gives the rest, and wait=False ends when caught up
    middle = positions[len(positions) // 2]
    rest = [item.position for item in events.follow(app, after=middle, wait=False)]
    assert rest == [p for p in positions if p > middle]


def _history(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock())
    register(app, "r2", at=clock(), pool_name="pool-b")
    create_sandbox(app, "s1")
    create_sandbox(app, "s2", pool_name="pool-b")
    a1, _ = app.schedule(schedule_request("s1", clock()))
    from tests.factories import requirements

    app.schedule(schedule_request("s2", clock(), requirements=requirements(pool_name="pool-b")))
    app.mark_running("s1", 1, a1.fencing_token)
    app.release("s1", 1, a1.fencing_token, {"gone": "yes"})
    app.advance_generation("s1", 1)
    app.start_drain("r2")


def test_the_filters_let_through_exactly_what_concerns_them(
    app: SchedulerApplication, clock: Clock
) -> None:
    _history(app, clock)
    every = read_feed(app, 0, MAX_LIMIT).events
    by_type = {item.type for item in every}
    assert {
        "Sandbox.AssignmentRunning",
        "Runner.CapacityReleased",
        "Runner.DrainStarted",
    } <= by_type

    def only(**wanted: Any) -> list[int]:
        return [item.position for item in read_feed(app, 0, MAX_LIMIT, FeedFilter(**wanted)).events]

    s1 = only(sandbox_id="s1")
    assert s1 == [i.position for i in every if i.subject.sandbox_id == "s1"]
    s1_types = {i.type for i in every if i.position in s1}
    assert {"Sandbox.Created", "Sandbox.AssignmentFenced", "Runner.CapacityReserved",
            "Sandbox.AssignmentRunning", "Sandbox.AssignmentReleased",
            "Runner.CapacityReleased", "FencingTokenUse.Used",
            "Sandbox.GenerationAdvanced"} <= s1_types  # fmt: skip
    r2 = {i.type for i in every if i.position in only(runner_id="r2")}
    assert {"Runner.Registered", "RunnerLease.Opened", "Sandbox.Created",
            "Sandbox.AssignmentFenced", "Runner.DrainStarted"} <= r2  # fmt: skip
    assert all(i.subject.sandbox_id != "s1" for i in every if i.position in only(runner_id="r2"))
    pool_b = only(pool_name="pool-b")
    assert pool_b == [i.position for i in every if i.subject.pool_name == "pool-b"]
    assert {i.subject.sandbox_id for i in every if i.position in pool_b} == {None, "s2"}
    fenced = only(types=("Sandbox.AssignmentFenced",))
    assert [i.type for i in every if i.position in fenced] == ["Sandbox.AssignmentFenced"] * 2
    both = only(types=("Sandbox.AssignmentFenced",), pool_name="pool-b")
    assert len(both) == 1
    # the running event of s1 names the runner its generation was fenced on
    running = next(i for i in every if i.type == "Sandbox.AssignmentRunning")
    assert running.subject.runner_id == "r1"
    assert running.subject.pool_name == "pool-a"


def test_a_placement_on_the_stream_names_its_actor_and_the_feed_hides_token_digests(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    issued = issue_token(app, role="control-plane")
    with api_client(app) as client:
        auth = {"Authorization": f"Bearer {issued.token}"}
        body = schedule_body("s1", clock())
        assert client.post("/v1/sandboxes/s1/schedule", json=body, headers=auth).status_code == 201
        with client.stream(
            "GET", "/v1/events/stream", params={"timeout": 0}, headers=auth
        ) as response:
            text = "".join(response.iter_text())
        page = client.get("/v1/events", params={"type": "AccessTokens.Issued"}, headers=auth)
    messages = [m for m in text.split("\n\n") if "data: " in m]
    fenced = [
        json.loads(m.split("data: ", 1)[1])
        for m in messages
        if "event: Sandbox.AssignmentFenced" in m
    ]
    assert len(fenced) == 1
    assert fenced[0]["actor"] == {"kind": "token", "name": issued.token_id, "role": "control-plane"}
    assert fenced[0]["runner_id"] == "r1"
    assert fenced[0]["sandbox_id"] == "s1"
    assert text.startswith("retry: ")
    [issued_event] = page.json()["events"]
    assert issued_event["data"]["token_id"] == issued.token_id
    assert "token_sha256" not in issued_event["data"]
    assert issued.token not in text
    assert issued.token not in page.text


BAD_INPUT: list[tuple[dict[str, Any], dict[str, str], str]] = [
    ({"after": -1}, {}, "after"),
    ({"after": "x"}, {}, "after"),
    ({"after": 2**63}, {}, "after"),
    ({"limit": 0}, {}, "limit"),
    ({"limit": "many"}, {}, "limit"),
    ({"wait": -1}, {}, "wait"),
    ({"wait": "nan"}, {}, "wait"),
    ({"type": "Sandbox.Nope"}, {}, "type"),
    ({"sandbox_id": "bad\u202eid"}, {}, "sandbox_id"),
    ({}, {"Last-Event-ID": "seven"}, "Last-Event-ID"),
    ({}, {"Last-Event-ID": str(2**63)}, "Last-Event-ID"),
]


def test_bad_feed_input_is_refused_naming_the_field(app: SchedulerApplication) -> None:
    with api_client(app) as client:
        for params, headers, field in BAD_INPUT:
            path = "/v1/events/stream" if headers else "/v1/events"
            response = client.get(path, params=params, headers=headers)
            problem = error_of(response, 422, "invalid_request")
            assert problem["field"] == field, (params, headers)
    assert app.head_position() == 0


def test_a_huge_limit_is_served_bounded_and_next_continues(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reading, "MAX_LIMIT", 4)
    for index in range(3):
        register(app, f"r{index}", at=clock())  # 3 events each
    head = app.head_position()
    positions: list[int] = []
    after = 0
    with api_client(app) as client:
        for _ in range(head):
            page = client.get("/v1/events", params={"after": after, "limit": 10**30}).json()
            assert 0 < len(page["events"]) <= 4
            positions += [event["position"] for event in page["events"]]
            after = page["next"]
            if after == head:
                break
    assert positions == list(range(1, head + 1))
    assert len(positions) == 9


def test_a_long_poll_answers_with_the_first_new_event(
    app: SchedulerApplication, clock: Clock
) -> None:
    register(app, "r1", at=clock())
    head = app.head_position()
    with api_client(app) as client:

        def later() -> None:
            time.sleep(0.3)
            app.start_drain("r1")

        writer = threading.Thread(target=later)
        writer.start()
        page = client.get("/v1/events", params={"after": head, "wait": 20}).json()
        writer.join()
    assert [e["type"] for e in page["events"]] == ["Runner.DrainStarted"]
    assert page["next"] == head + 1


def test_a_page_covers_a_bounded_window_of_positions_and_next_goes_on(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rare type's page never reads the whole log: it ends after the window, empty if
    need be, with a next that goes on; paging to the head still gives every match once."""
    monkeypatch.setattr(reading, "POSITION_WINDOW", 4)
    for index in range(4):
        register(app, f"r{index}", at=clock())  # 3 events each: 12 positions
    app.start_drain("r3")
    wanted = FeedFilter(types=("Runner.DrainStarted",))
    first = read_feed(app, 0, 10, wanted)
    assert (first.events, first.next, first.more) == ([], 4, True)
    found, after, pages = [], 0, 0
    while True:
        page = read_feed(app, after, 10, wanted)
        found += [item.type for item in page.events]
        assert page.next > after or not page.more
        after, pages = page.next, pages + 1
        if not page.more:
            break
    assert found == ["Runner.DrainStarted"]
    assert after == app.head_position() == 13
    assert pages == 4
