"""``/healthz`` and ``/readyz`` answer while every thread that serves requests is busy
(found by a red team: with 45 writes stalled on the store, both timed out, queued for
the same 40-thread pool as the requests)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock, Store
from tests.factories import register
from tests.http_helpers import api_client

IN_FLIGHT = 45  # more than the 40 threads of the request pool
PATIENCE_SECONDS = 20  # only ends a test that stalls; never a measure of success


class Stuck:
    """Makes ``get_runner`` block until released, counting the calls inside it."""

    def __init__(self, app: SchedulerApplication) -> None:
        self.original = app.get_runner
        self.inside = 0
        self.changed = threading.Condition()
        self.released = threading.Event()

    def __call__(self, runner_id: str) -> Any:
        with self.changed:
            self.inside += 1
            self.changed.notify_all()
        self.released.wait(PATIENCE_SECONDS * 3)
        return self.original(runner_id)

    def wait_until_inside(self, count: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.inside >= count, PATIENCE_SECONDS)


@contextmanager
def requests_stuck(app: SchedulerApplication, client: httpx.Client) -> Iterator[Stuck]:
    stuck = Stuck(app)
    app.get_runner = stuck  # type: ignore[method-assign]
    pool = ThreadPoolExecutor(IN_FLIGHT)
    url = str(client.base_url)
    try:

        def one() -> int:
            with httpx.Client(base_url=url, timeout=PATIENCE_SECONDS * 4) as own:
                return own.get("/v1/runners/r1").status_code

        answers = [pool.submit(one) for _ in range(IN_FLIGHT)]
        assert stuck.wait_until_inside(40), "the requests never filled the pool"
        yield stuck
        stuck.released.set()
        assert [a.result() for a in answers] == [200] * IN_FLIGHT
    finally:
        stuck.released.set()
        pool.shutdown()
        app.get_runner = stuck.original  # type: ignore[method-assign]


def test_health_and_readiness_answer_while_every_request_thread_is_busy(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    register(app, "r1", at=clock())
    with api_client(app) as client, requests_stuck(app, client):
        try:
            health = client.get("/healthz", timeout=PATIENCE_SECONDS)
            ready = client.get("/readyz", timeout=PATIENCE_SECONDS)
        except httpx.TimeoutException as error:
            raise AssertionError(f"a probe queued behind the stuck requests: {error!r}") from None
        assert health.status_code == 200
        assert ready.status_code == 200, ready.text
        assert ready.json()["store"] == "ok"
