"""Every consumer of the log accounts for every event class, and reports the others.

For the what-if replay and for each read model (the two SQL projections and the runner
index): every class of the catalogue is handled or ignored with a reason
(``domain/event_catalogue.py``'s :func:`unaccounted` is empty); the check names a class
whose handler is taken out of a copy of the table (so it can fail); and an event of a
class outside the catalogue (:class:`Stranger`'s, or a topic that does not even resolve
here) met at run time is reported, not silently skipped, and stops nothing.
"""

from __future__ import annotations

import inspect
import uuid
from functools import singledispatchmethod
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import StoredEvent, Tracking
from eventsourcing.utils import get_topic
from typer.testing import CliRunner

from secondbox_scheduler.domain.event_catalogue import event_classes, event_name, unaccounted
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.whatif.engine import WhatIf
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.whatif_replay import whatif
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.projections.notification_reader import read_pages
from secondbox_scheduler.projections.read_models import (
    PROJECTIONS,
    ReadModels,
    handled_topics,
    rebuild,
)
from secondbox_scheduler.projections.runner_index import RunnerIndex
from secondbox_scheduler.projections.sql_view import SqlProjection
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, schedule_request
from tests.test_projections import folded, projected


class Stranger(Aggregate):
    """An aggregate the scheduler does not know: its events are outside the catalogue."""

    class Appeared(Aggregate.Created):
        note: str

    class Happened(Aggregate.Event):
        pass

    @event(Appeared)
    def __init__(self, note: str) -> None:
        self.note = note

    @event(Happened)
    def happen(self) -> None:
        pass


APPEARED, HAPPENED = get_topic(Stranger.Appeared), get_topic(Stranger.Happened)
LATER = "secondbox_scheduler.later:Thing.Happened"  # a class that does not resolve here
SQL_PROJECTIONS = sorted(PROJECTIONS)


def save_strangers(app: SchedulerApplication) -> None:
    """Two events of Stranger's (Appeared, Happened) and one of a topic that does not
    resolve, appended to the application's log."""
    stranger = Stranger("from another release")
    stranger.happen()
    app.save(stranger)
    app.recorder.insert_events(
        [StoredEvent(originator_id=uuid.uuid4(), originator_version=1, topic=LATER, state=b"{}")]
    )


def a_history(app: SchedulerApplication, clock: Clock) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s1", clock()))


def events_of(app: SchedulerApplication) -> list[Any]:
    """The log's events, decoded by the application's mapper."""
    return [
        app.mapper.to_domain_event(notification)
        for page in read_pages(app.recorder)
        for notification in page
    ]


def handler_table(projection_class: type[SqlProjection[Any]]) -> Any:
    """The projection's handler table: its ``changes``, a ``singledispatchmethod``."""
    return inspect.getattr_static(projection_class, "changes")


def changes_without(original: Any, removed: type[Any]) -> Any:
    """A copy of a handler table (``changes``) without the handler of ``removed``."""
    copy: singledispatchmethod[Any] = singledispatchmethod(original.func)
    for cls, handler in original.dispatcher.registry.items():
        if cls is not object and cls is not removed:
            copy.register(cls, handler)
    return copy


# -- the catalogue itself ----------------------------------------------------------------


def test_the_catalogue_holds_every_event_class_the_consumers_name() -> None:
    catalogue = set(event_classes())
    assert {Runner.Registered, Sandbox.AssignmentFenced, FencingTokenUse.Used} <= catalogue
    assert Stranger.Appeared not in catalogue


# -- the what-if replay ----------------------------------------------------------------------


def test_the_whatif_replay_accounts_for_every_event_class() -> None:
    assert WhatIf.handled_events()
    assert unaccounted(WhatIf.handled_events(), WhatIf.IGNORED) == []


def test_the_check_names_a_class_whose_whatif_handler_is_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = dict(WhatIf.HANDLERS)
    for removed in table:
        without = {c: h for c, h in table.items() if c is not removed}
        monkeypatch.setattr(WhatIf, "HANDLERS", without)
        assert unaccounted(WhatIf.handled_events(), WhatIf.IGNORED) == [event_name(removed)]
    monkeypatch.setattr(WhatIf, "HANDLERS", table)
    ignored: dict[type[Any], str] = dict(WhatIf.IGNORED)
    without_reason: dict[type[Any], str] = {**ignored, FencingTokenUse.Used: " "}
    monkeypatch.setattr(WhatIf, "IGNORED", without_reason)
    assert unaccounted(WhatIf.handled_events(), WhatIf.IGNORED) == ["FencingTokenUse.Used"]
    stranger: dict[type[Any], str] = {**ignored, Stranger.Happened: "x"}
    monkeypatch.setattr(WhatIf, "IGNORED", stranger)
    assert unaccounted(WhatIf.handled_events(), WhatIf.IGNORED) == [
        "Stranger.Happened (not an event of the catalogue)"
    ]


def test_the_whatif_replay_reports_events_of_unknown_classes(tmp_path: Path, clock: Clock) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    try:
        a_history(app, clock)
        before = whatif(app).report
        assert before.decisions == before.reproduced == 2
        assert before.unknown_events == {}
        assert before.identical
        stranger = Stranger("from another release")
        stranger.happen()
        app.save(stranger)
        create_sandbox(app, "s2")  # the replay goes on after them
        after = whatif(app).report
    finally:
        app.close()
    assert after.decisions == after.reproduced == 3
    assert after.unknown_events == {APPEARED: 1, HAPPENED: 1}
    assert not after.identical, "a history with events it could not replay is not reproduced"
    assert after.events == before.events + 3
    found = CliRunner().invoke(cli, ["audit", "whatif", "--database-url", url])
    assert found.exit_code == 1, found.output
    assert "not reproduced" in found.output
    assert "Stranger.Happened" in found.output


def test_the_whatif_engine_counts_an_unknown_event_and_skips_an_ignored_one() -> None:
    stranger = Stranger("x")
    stranger.happen()
    engine = WhatIf()
    for position, pending in enumerate(stranger.collect_events(), start=1):
        engine.apply(position, pending)
    report = engine.report()
    assert report.unknown_events == {APPEARED: 1, HAPPENED: 1}
    assert report.events == 2
    assert not report.identical
    assert WhatIf().report().identical  # nothing met: nothing unknown


# -- the read models -------------------------------------------------------------------------


@pytest.mark.parametrize("name", SQL_PROJECTIONS)
def test_each_projection_accounts_for_every_event_class(name: str) -> None:
    projection_class = PROJECTIONS[name]
    assert projection_class.handled_events()
    assert unaccounted(projection_class.handled_events(), projection_class.IGNORED) == []


def test_the_runner_index_accounts_for_every_event_class() -> None:
    assert RunnerIndex.handled_events() == {Runner.Registered, Runner.Deregistered}
    assert unaccounted(RunnerIndex.handled_events(), RunnerIndex.IGNORED) == []


@pytest.mark.parametrize("name", SQL_PROJECTIONS)
def test_the_check_names_a_class_whose_projection_handler_is_removed(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    projection_class = PROJECTIONS[name]
    handled, table = projection_class.handled_events(), handler_table(projection_class)
    for removed in handled:
        monkeypatch.setattr(projection_class, "changes", changes_without(table, removed))
        assert projection_class.handled_events() == handled - {removed}
        assert unaccounted(projection_class.handled_events(), projection_class.IGNORED) == [
            event_name(removed)
        ]
        assert get_topic(removed) not in handled_topics(projection_class), "not decoded"
    ignored = dict(projection_class.IGNORED)
    dropped = next(iter(ignored))
    without = {c: r for c, r in ignored.items() if c is not dropped}
    monkeypatch.setattr(projection_class, "IGNORED", without)
    assert event_name(dropped) in unaccounted(
        projection_class.handled_events(), projection_class.IGNORED
    )


def test_the_check_names_a_class_whose_runner_index_handler_is_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = dict(RunnerIndex.HANDLERS)
    for removed in table:
        monkeypatch.setattr(
            RunnerIndex, "HANDLERS", {c: h for c, h in table.items() if c is not removed}
        )
        assert unaccounted(RunnerIndex.handled_events(), RunnerIndex.IGNORED) == [
            event_name(removed)
        ]


@pytest.mark.parametrize("name", SQL_PROJECTIONS)
def test_a_projection_without_a_handler_counts_that_class_as_unknown(
    name: str, tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At run time (the live runner's path, ``changes``): an event of a handled class
    changes rows, an ignored one changes nothing silently, and once its handler is taken
    out of the table the same event is counted as unknown."""
    env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "p.db")}
    app = SchedulerApplication(env=env, now=clock)
    try:
        a_history(app, clock)
        events = events_of(app)
        assert app.read_models is not None
        view = app.read_models.views[name]
    finally:
        app.close()
    projection_class = PROJECTIONS[name]
    table = handler_table(projection_class)
    met = set()
    for domain_event in events:
        cls = type(domain_event)
        projection = projection_class(view)
        if cls in projection_class.IGNORED:
            assert projection.changes(domain_event) == []
            assert projection.unknown_events.counts() == {}
            continue
        assert cls in projection_class.handled_events()
        assert projection.changes(domain_event) != []
        assert projection.unknown_events.counts() == {}
        with monkeypatch.context() as patch:
            patch.setattr(projection_class, "changes", changes_without(table, cls))
            projection = projection_class(view)
            assert projection.changes(domain_event) == []
            assert projection.unknown_events.counts() == {get_topic(cls): 1}
        met.add(cls)
    assert met, "the history holds events the projection handles"


def test_read_models_report_events_of_unknown_classes(store: Store, clock: Clock) -> None:
    """A catch-up reads them (they are not filtered out by topic), decodes none, changes
    no row, counts them per projection in its status and goes on; a rebuild counts them
    again from zero."""
    app = store.open()
    a_history(app, clock)
    save_strangers(app)
    create_sandbox(app, "s2")  # after them: still projected
    app.schedule(schedule_request("s2", clock()))
    read_models = app.read_models
    assert read_models is not None
    read_models.clear()
    read_models.catch_up()
    expected = {APPEARED: 1, HAPPENED: 1, LATER: 1}
    head = app.head_position()
    for status in read_models.status():
        assert (status.position, status.lag_events) == (head, 0)
        assert status.unknown_events == expected, status.name
        assert status.to_dict()["unknown_events"] == expected
    assert projected(app) == folded(app)
    assert {row["sandbox_id"] for row in read_models.assignments.rows()} == {"s1", "s2"}
    rebuild(read_models)
    assert {s.name: s.unknown_events for s in read_models.status()} == dict.fromkeys(
        SQL_PROJECTIONS, expected
    )
    assert projected(app) == folded(app)


def test_read_models_report_nothing_for_the_catalogue_events(store: Store, clock: Clock) -> None:
    app = store.open()
    a_history(app, clock)
    read_models = app.read_models
    assert read_models is not None
    read_models.catch_up()
    assert [s.unknown_events for s in read_models.status()] == [{}, {}]


def test_the_live_path_counts_an_unknown_event_and_moves_its_position(
    tmp_path: Path, clock: Clock
) -> None:
    env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "l.db")}
    app = SchedulerApplication(env={**env, "SECONDBOX_READ_MODELS": "external"}, now=clock)
    try:
        stranger = Stranger("x")
        app.save(stranger)
        read_models: ReadModels | None = app.read_models
        assert read_models is not None
        projection = read_models.projections["runner_snapshots"]
        (appeared,) = events_of(app)
        projection.process_event(appeared, Tracking(app.name, 1))  # as ProjectionRunner does
        assert read_models.position("runner_snapshots") == 1
        assert {s.name: s.unknown_events for s in read_models.status()} == {
            "runner_snapshots": {APPEARED: 1},
            "assignments": {},
        }
    finally:
        app.close()


@pytest.mark.parametrize("kind", ["popo", "sqlite"])
def test_the_runner_index_reports_events_of_unknown_classes(
    kind: str, tmp_path: Path, clock: Clock
) -> None:
    env = {"PERSISTENCE_MODULE": f"eventsourcing.{kind}", "SQLITE_DBNAME": str(tmp_path / "i.db")}
    app = SchedulerApplication(env=env, now=clock)
    try:
        register(app, "r1", at=clock())
        save_strangers(app)
        register(app, "r2", at=clock(), pool_name="pool-b")
        index = app.queries.runner_index
        assert index.runner_ids() == ["r1", "r2"]
        assert index.unknown_events.counts() == {
            APPEARED: 1,
            HAPPENED: 1,
            LATER: 1,
        }
        app.deregister_runner("r1")
        assert index.runner_ids() == ["r2"]
        assert app.queries.runner_index.runner_ids("pool-b") == ["r2"]
        assert app.queries.runner_index.unknown_events.counts() == {
            APPEARED: 1,
            HAPPENED: 1,
            LATER: 1,
        }
    finally:
        app.close()


@pytest.mark.parametrize("kind", ["popo", "sqlite"])
def test_pages_excluding_topics_hold_every_other_notification(
    kind: str, tmp_path: Path, clock: Clock
) -> None:
    """``read_pages(excluding=...)``: in SQL, or by the fallback that filters the
    recorder's pages (the in-memory store), in pages of any size."""
    env = {"PERSISTENCE_MODULE": f"eventsourcing.{kind}", "SQLITE_DBNAME": str(tmp_path / "e.db")}
    app = SchedulerApplication(env=env, now=clock)
    try:
        a_history(app, clock)
        save_strangers(app)
        create_sandbox(app, "s2")
        every = [n for page in read_pages(app.recorder) for n in page]
        excluded = [get_topic(Sandbox.Created), APPEARED, get_topic(Runner.Registered)]
        wanted = [n.id for n in every if n.topic not in excluded]
        assert len(wanted) < len(every)
        for size in (1, 2, 3, 1000):
            pages = list(read_pages(app.recorder, excluding=excluded, page_size=size))
            assert [n.id for page in pages for n in page] == wanted
            assert all(len(page) <= size for page in pages)
    finally:
        app.close()
