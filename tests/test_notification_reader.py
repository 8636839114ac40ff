"""The replay reader returns exactly what the recorder's select_notifications returns."""

from __future__ import annotations

import gc
import threading
from typing import Any

from eventsourcing.persistence import Notification
from eventsourcing.utils import get_topic

from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.projections.notification_reader import gc_paused, read_pages, read_rows
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
            rows = list(
                read_rows(
                    app.recorder, after=after, until=until,
                    page_size=3, first_page_size=2, read_ahead=read_ahead,
                )
            )  # fmt: skip
            if not topics:  # the same notifications, as rows of their five fields
                assert len(rows[0]) == min(2, len(expected))
                assert [row for page in rows for row in page] == [
                    (n.id, n.originator_id, n.originator_version, n.topic, n.state)
                    for n in expected
                ]


def test_objects_made_while_paused_are_not_collected_at_the_next_allocation() -> None:
    # the objects a replay made while the collector was paused move to the oldest
    # generation: the first allocation after the pause runs no collection over them
    collections: list[int] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    try:
        with gc_paused():
            kept = [{"event": [number]} for number in range(20_000)]
            gc.callbacks.append(record)  # from here to the allocations after the pause
        assert gc.get_count()[0] < 100
        after = [[number] for number in range(500)]
    finally:
        gc.callbacks.remove(record)
    assert collections == []
    assert gc.isenabled()
    assert all(gc.is_tracked(item) for item in kept[:10])
    del kept, after


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
