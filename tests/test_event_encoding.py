"""The domain's events are stored with orjson exactly as json would store them, and
whatever orjson would write differently goes to json (or is caught in the suite)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from eventsourcing.domain import Aggregate, Snapshot
from eventsourcing.persistence import Mapper, TranscodingNotRegisteredError

from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.store.encoding import (
    EncodingMismatchError,
    EventMapper,
    _compare,
)
from secondbox_scheduler.infrastructure.tools.simulation import SimulationConfig, run_simulation
from secondbox_scheduler.projections.notification_reader import read_pages


@pytest.fixture
def simulated(tmp_path: Path) -> Iterator[SchedulerApplication]:
    url = f"sqlite:///{tmp_path}/sim.db"
    run_simulation(SimulationConfig(database_url=url, runners=9, sandboxes=25))
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    yield app
    app.close()


def library_mapper(app: SchedulerApplication) -> Mapper[UUID]:
    return Mapper(transcoder=app.mapper.transcoder)


def test_the_application_encodes_with_the_event_mapper(simulated: SchedulerApplication) -> None:
    assert type(simulated.mapper) is EventMapper


def test_every_stored_event_is_what_the_library_mapper_would_store(
    simulated: SchedulerApplication,
) -> None:
    """Decode each stored event, encode it again with both mappers: the same JSON value
    (and, for these states, the same bytes), the same event decoded."""
    usual = library_mapper(simulated)
    kinds = set()
    for page in read_pages(simulated.recorder):
        for notification in page:
            event = simulated.mapper.to_domain_event(notification)
            fast, slow = simulated.mapper.to_stored_event(event), usual.to_stored_event(event)
            assert (fast.topic, fast.originator_id) == (slow.topic, slow.originator_id)
            assert json.loads(fast.state) == json.loads(slow.state)
            assert fast.state == slow.state
            assert vars(usual.to_domain_event(fast)) == vars(event)
            kinds.add(notification.topic.split(":")[1])
    assert {"Sandbox.AssignmentFenced", "Runner.CapacityReserved", "FencingTokenUse.Used"} <= kinds


def _fenced_event(app: SchedulerApplication) -> Any:
    for page in read_pages(app.recorder):
        for notification in page:
            if notification.topic.endswith("AssignmentFenced"):
                return app.mapper.to_domain_event(notification)
    raise AssertionError("no fence in the simulation")


def _with_placement(event: Any, **changes: Any) -> Any:
    state = dict(vars(event))
    state["placement"] = {**state["placement"], **changes}
    clone = object.__new__(type(event))
    object.__setattr__(clone, "__dict__", state)
    return clone


def test_what_orjson_refuses_is_encoded_by_json(simulated: SchedulerApplication) -> None:
    event = _fenced_event(simulated)
    usual = library_mapper(simulated)
    for value in (10**30, {1: "integer key"}):  # beyond 64 bits; a key json turns to text
        changed = _with_placement(event, attempt=value)
        assert simulated.mapper.to_stored_event(changed).state == (
            usual.to_stored_event(changed).state
        )


def test_a_type_no_transcoding_knows_raises_the_library_error(
    simulated: SchedulerApplication,
) -> None:
    @dataclass
    class Unknown:
        x: int

    changed = _with_placement(_fenced_event(simulated), attempt=Unknown(1))
    with pytest.raises(TranscodingNotRegisteredError):
        simulated.mapper.to_stored_event(changed)
    with pytest.raises(TranscodingNotRegisteredError):
        library_mapper(simulated).to_stored_event(changed)


def test_the_check_catches_a_value_orjson_would_write_differently(
    simulated: SchedulerApplication,
) -> None:
    """A UUID inside a domain event's state: orjson writes it as plain text, the library
    as a typed object. The domain never puts one there; if it did, the suite would fail."""
    changed = _with_placement(_fenced_event(simulated), attempt=uuid4())
    assert EventMapper.check
    with pytest.raises(EncodingMismatchError, match="AssignmentFenced"):
        simulated.mapper.to_stored_event(changed)


def test_snapshots_are_stored_as_the_library_stores_them_and_foreign_events_by_it(
    simulated: SchedulerApplication,
) -> None:
    runner_id = next(
        notification.originator_id
        for page in read_pages(simulated.recorder)
        for notification in page
        if notification.topic.endswith("Runner.Registered")
    )
    assert isinstance(runner_id, UUID)
    runner: Any = simulated.repository.get(runner_id)
    assert isinstance(runner, Runner)
    snapshot = Snapshot.take(runner)
    assert simulated.mapper.to_stored_event(snapshot).state == (
        library_mapper(simulated).to_stored_event(snapshot).state
    )
    mapper = simulated.mapper
    assert isinstance(mapper, EventMapper)
    assert type(snapshot) in mapper._snapshots  # the orjson path took it

    class Foreign(Aggregate):  # not of secondbox_scheduler.domain: left to the library
        class Created(Aggregate.Created):
            ref: UUID

        def __init__(self, ref: UUID) -> None:
            self.ref = ref

    foreign = Foreign._create(Foreign.Created, id=uuid4(), timestamp=datetime.now(UTC), ref=uuid4())
    (created,) = foreign.collect_events()
    stored = simulated.mapper.to_stored_event(created)
    assert json.loads(stored.state)["ref"]["_type_"] == "uuid_hex"
    decoded: Any = simulated.mapper.to_domain_event(stored)
    assert decoded.ref == vars(created)["ref"]


@pytest.mark.parametrize(
    ("fast", "usual"),
    [(b'{"a":true}', b'{"a":1}'), (b'{"a":1}', b'{"a":1.0}'), (b'{"a":null}', b'{"a":NaN}')],
)
def test_the_check_tells_values_python_calls_equal(fast: bytes, usual: bytes) -> None:
    """``True == 1 == 1.0`` in Python; the stored JSON must not change them into another."""
    with pytest.raises(EncodingMismatchError):
        _compare("t", fast, usual)
    _compare("t", b'{"a":1e-6}', b'{"a":1e-06}')  # spelling only: the same value


def test_a_transcoder_with_more_transcodings_keeps_the_library_path(
    simulated: SchedulerApplication,
) -> None:
    """A transcoding registered for a type orjson would write itself must not be bypassed."""
    from enum import Enum

    from eventsourcing.persistence import JSONTranscoder, Transcoding

    class Colour(Enum):
        RED = 1

    class ColourAsName(Transcoding):
        type = Colour
        name = "colour"

        def encode(self, obj: Colour) -> str:
            return obj.name

        def decode(self, data: str) -> Colour:
            return Colour[data]

    transcoder = JSONTranscoder()
    simulated.register_transcodings(transcoder)
    transcoder.register(ColourAsName())
    mapper = EventMapper(transcoder)
    changed = _with_placement(_fenced_event(simulated), attempt=Colour.RED)
    stored = mapper.to_stored_event(changed)
    assert json.loads(stored.state)["placement"]["attempt"] == {"_type_": "colour", "_data_": "RED"}
