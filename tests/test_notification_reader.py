"""The replay reader returns exactly what the recorder's select_notifications returns."""

from __future__ import annotations

import threading

from eventsourcing.persistence import Notification
from eventsourcing.utils import get_topic

from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.projections.notification_reader import read_pages
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, schedule_request


def recorder_read(
    app: SchedulerApplication, after: int, until: int | None, topics: list[str]
) -> list[Notification]:
    return list(
        app.recorder.select_notifications(
            start=after, limit=10_000, stop=until, topics=topics, inclusive_of_start=False
        )
    )


def test_pages_equal_the_recorders_notifications(app: SchedulerApplication, clock: Clock) -> None:
    for runner_id in ("r1", "r2"):
        register(app, runner_id, at=clock())
    for number in range(5):
        create_sandbox(app, f"s{number}")
        app.schedule(schedule_request(f"s{number}", clock()))
    head = app.recorder.max_notification_id()
    assert head is not None
    reserved = [get_topic(Runner.CapacityReserved), get_topic(Runner.Registered)]
    for after, until, topics in [
        (0, None, []),
        (3, head - 2, []),
        (0, None, reserved),
        (4, head - 1, reserved),
    ]:
        expected = recorder_read(app, after, until, topics)
        assert expected  # each case reads something
        for read_ahead in (False, True):
            pages = list(
                read_pages(
                    app.recorder, after=after, until=until, topics=topics,
                    page_size=3, first_page_size=2, read_ahead=read_ahead,
                )
            )  # fmt: skip
            assert len(pages[0]) == min(2, len(expected))
            assert all(len(page) == 3 for page in pages[1:-1])
            assert [n for page in pages for n in page] == expected


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("read-ahead")]


def test_read_ahead_thread_runs_on_postgres_and_ends_when_closed_early(
    app: SchedulerApplication, clock: Clock, store: Store
) -> None:
    for runner_id in ("r1", "r2", "r3"):
        register(app, runner_id, at=clock())
    pages = read_pages(app.recorder, page_size=1, read_ahead=True)
    assert len(next(pages)) == 1
    assert bool(_readers()) == (store.kind == "postgres")  # SQLite reads in line
    pages.close()
    assert not _readers()
