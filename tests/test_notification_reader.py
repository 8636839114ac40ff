"""The replay reader returns exactly what the recorder's select_notifications returns."""

from __future__ import annotations

from eventsourcing.persistence import Notification

from infrastructure import SchedulerApplication
from projections.notification_reader import read_pages
from tests.conftest import Clock
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
    reserved = ["domain.runner:Runner.CapacityReserved", "domain.runner:Runner.Registered"]
    for after, until, topics in [
        (0, None, []),
        (3, head - 2, []),
        (0, None, reserved),
        (4, head - 1, reserved),
    ]:
        pages = list(read_pages(app.recorder, after=after, until=until, topics=topics, page_size=3))
        assert all(len(page) == 3 for page in pages[:-1])
        expected = recorder_read(app, after, until, topics)
        assert [n for page in pages for n in page] == expected
        assert expected  # each case reads something
