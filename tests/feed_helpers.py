"""What the event feed's and the lists' tests share: a service that can be stopped and
started again on the same port, writers that go on meanwhile, and the log as the store
holds it (the answer every follower must reach).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from eventsourcing.persistence import OperationalError

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.server import (
    base_url,
    listening_socket,
    make_server,
)
from tests.factories import create_sandbox, register, schedule_request


def opened(open_app: Callable[[], SchedulerApplication]) -> SchedulerApplication:
    """``open_app()``, again while SQLite answers "database is locked": opening an
    application creates its tables if need be, and on SQLite that write fails at once,
    without waiting, when another connection wrote since it began (the library's
    deferred transaction), which the writers of these tests do all the time."""
    for _ in range(100):
        try:
            return open_app()
        except OperationalError as error:
            if "locked" not in str(error):
                raise
            time.sleep(0.05)
    return open_app()


@dataclass
class RestartableService:
    """``serve`` in a thread, over an application ``open_app`` opens anew at each start
    (a restart is a new process as far as the store can tell), on one port."""

    open_app: Callable[[], SchedulerApplication]
    port: int = 0
    url: str = ""
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _app: SchedulerApplication | None = None
    _sock: Any = None

    def start(self) -> None:
        self._app = opened(self.open_app)
        self._sock = listening_socket("127.0.0.1", self.port)
        self.port = self._sock.getsockname()[1]
        self.url = base_url(self._sock)
        self._server = make_server(create_app(self._app), self._sock)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        assert self._server is not None
        assert self._thread is not None
        assert self._app
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the service did not stop"
        self._sock.close()
        self._app.close()

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Writers:
    """Threads that each register runners, create sandboxes, schedule and release them,
    through an application of their own (another replica of the store), until done."""

    open_app: Callable[[], SchedulerApplication]
    clock: Callable[[], Any]
    count: int = 2
    rounds: int = 8
    midway: threading.Event | None = None  # set: the second half of the rounds may start
    prefix: str = ""  # of the runners' and sandboxes' ids
    errors: list[BaseException] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for writer in range(self.count):
            app = opened(self.open_app)
            thread = threading.Thread(target=self._write, args=(writer, app), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _write(self, writer: int, app: SchedulerApplication) -> None:
        try:
            for round_ in range(self.rounds):
                if round_ == self.rounds // 2 and self.midway is not None:
                    assert self.midway.wait(timeout=120), "never told to go on"
                runner = f"{self.prefix}r-{writer}-{round_}"
                sandbox = f"{self.prefix}s-{writer}-{round_}"
                register(app, runner, at=self.clock(), pool_name=f"pool-{writer}")
                create_sandbox(app, sandbox, pool_name=f"pool-{writer}")
                assignment, _ = app.schedule(
                    schedule_request(sandbox, self.clock(), requirements=_profile(writer))
                )
                if round_ % 2:
                    app.release(sandbox, 1, assignment.fencing_token, {"gone": "yes"})
        except BaseException as error:  # reported by join
            self.errors.append(error)
        finally:
            app.close()

    def start_and_join(self) -> None:
        self.start()
        self.join()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=120)
        assert not self.errors, self.errors


def _profile(writer: int) -> Any:
    from tests.factories import requirements

    return requirements(pool_name=f"pool-{writer}")


def log_positions(app: SchedulerApplication) -> list[int]:
    """Every position of the store's log, in order."""
    found: list[int] = []
    while True:
        page = app.recorder.select_notifications(
            start=found[-1] if found else 0, limit=1000, inclusive_of_start=False
        )
        found += [notification.id for notification in page]
        if len(page) < 1000:
            return found
