"""The replay decoder gives exactly the mapper's events, and the mapper's errors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from eventsourcing.persistence import MapperDeserialisationError, Notification

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.simulation import SimulationConfig, run_simulation
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import read_pages
from tests.conftest import PostgresSchema

KINDS = {
    "Runner.Registered", "Runner.CapacityReserved", "Runner.CapacityReleased",
    "Runner.DrainStarted", "RunnerLease.EvidenceRecorded", "Sandbox.Created",
    "Sandbox.AssignmentFenced", "Sandbox.AssignmentReleased", "RefusalLog.Refused",
}  # fmt: skip


@pytest.fixture(params=["sqlite", "postgres"])
def simulated(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SchedulerApplication]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/sim.db"
    else:
        schema: PostgresSchema = request.getfixturevalue("postgres_schema")
        url = schema.url()
    run_simulation(SimulationConfig(database_url=url, runners=9, sandboxes=25))
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    yield app
    app.close()


def notifications(app: SchedulerApplication) -> list[Notification]:
    return [n for page in read_pages(app.recorder) for n in page]


def test_every_event_decodes_as_the_mapper_decodes_it(simulated: SchedulerApplication) -> None:
    decode = EventDecoder(simulated.mapper)
    assert decode.lean
    seen = set()
    for notification in notifications(simulated):
        lean, usual = decode(notification), simulated.mapper.to_domain_event(notification)
        assert type(lean) is type(usual)
        assert vars(lean) == vars(usual)
        seen.add(notification.topic.split(":")[1])
    assert seen >= KINDS


def _with_state(notification: Notification, state: bytes) -> Notification:
    return Notification(
        id=notification.id, originator_id=notification.originator_id,
        originator_version=notification.originator_version, topic=notification.topic,
        state=state,
    )  # fmt: skip


def test_what_the_fast_parser_refuses_goes_to_the_mapper(simulated: SchedulerApplication) -> None:
    decode = EventDecoder(simulated.mapper)
    fenced = next(n for n in notifications(simulated) if n.topic.endswith("AssignmentFenced"))
    assert b'"attempt":0' in fenced.state
    huge = _with_state(fenced, fenced.state.replace(b'"attempt":0', b'"attempt":' + b"9" * 30))
    event = decode(huge)
    assert event.placement["attempt"] == int("9" * 30)  # orjson would read 1e30, a float
    assert vars(event) == vars(simulated.mapper.to_domain_event(huge))
    nan = _with_state(fenced, fenced.state.replace(b'"attempt":0', b'"attempt":NaN'))
    assert math.isnan(decode(nan).placement["attempt"])  # orjson refuses NaN; json reads it
    with pytest.raises(MapperDeserialisationError):
        decode(_with_state(fenced, b"{oops"))
