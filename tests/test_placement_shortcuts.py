"""The batched placement's shortcuts build what the library's and pydantic's long ways
build: a schedule through them stores the same events, byte for byte, as through the
long ways; each shortcut gives the same objects as the long way it replaces (the token's
stream id as ``uuid.uuid5``, the token's use as the library's ``_create``, a requirements
record as ``to_record``, a datetime's stored text as the transcoder's hook)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from secondbox_scheduler.domain import ids, sandbox, values
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse, token_sha256
from secondbox_scheduler.domain.ids import (
    NAMESPACE,
    fencing_token_uuid,
    lease_uuid,
    runner_uuid,
    sandbox_uuid,
)
from secondbox_scheduler.domain.lease import materialization_snapshots
from secondbox_scheduler.domain.values import (
    Capacity,
    MaterializationSnapshot,
    requirements_record,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.store import encoding, fast_forward
from secondbox_scheduler.infrastructure.store.encoding import EventMapper
from secondbox_scheduler.projections.event_decoder import EventDecoder
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, requirements, schedule_request

AT = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


# -- a schedule through the shortcuts and through the long ways ---------------


def _library_use(
    cls: type[FencingTokenUse], *, sandbox_id: str, generation: int, token_hex: str, at: datetime
) -> FencingTokenUse:
    """``FencingTokenUse.use`` as it was: the library's ``_create``."""
    digest = token_sha256(token_hex)
    return cls._create(
        cls.Used,
        id=uuid.uuid5(NAMESPACE, f"fencing-token:{sandbox_id}:{digest}"),
        timestamp=at,
        sandbox_id=sandbox_id,
        generation=generation,
        token_sha256=digest,
    )


@pytest.fixture
def long_ways(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A function that turns every shortcut off, for the rest of the test."""

    def off() -> None:
        monkeypatch.setattr(sandbox, "passes_every_rule", lambda *_, **__: False)
        monkeypatch.setattr(sandbox, "requirements_record", lambda value: value.to_record())
        monkeypatch.setattr(ids, "uuid5", uuid.uuid5)
        monkeypatch.setattr(FencingTokenUse, "use", classmethod(_library_use))
        monkeypatch.setattr(
            EventMapper, "to_stored_event", _with_the_transcoders_hook(EventMapper.to_stored_event)
        )

    return off


def _with_the_transcoders_hook(to_stored_event: Any) -> Any:
    def encode(mapper: EventMapper, event: Any) -> Any:
        mapper._default = mapper.transcoder._encode_obj  # type: ignore[attr-defined]
        return to_stored_event(mapper, event)

    return encode


def _placements(app: SchedulerApplication, requests: list[Any]) -> list[Any]:
    """Five sandboxes on a runner that takes four (the fifth refused by the capacity
    rule, with its evidence), a replay of the first, a sandbox whose runner drains (the
    draining rule refuses it), in batches as ``schedule_many`` decides them."""
    register(app, "r1", at=AT)
    register(app, "r2", at=AT, pool_name="pool-b")
    for n in range(5):
        create_sandbox(app, f"s{n}")
    create_sandbox(app, "t0", pool_name="pool-b")
    app.start_drain("r2")
    answers = app.schedule_many(requests[:3])
    answers += app.schedule_many([*requests[3:5], requests[0], requests[5]])
    return [a if isinstance(a, Exception) else a[1] for a in answers]


def _stored(app: SchedulerApplication) -> list[tuple[Any, ...]]:
    return [
        (n.originator_id, n.originator_version, n.topic, n.state)
        for n in app.recorder.select_notifications(start=1, limit=10_000)
    ]


def test_a_schedule_stores_the_same_events_as_through_the_long_ways(
    long_ways: Callable[[], None],
) -> None:
    requests = [schedule_request(f"s{n}", AT) for n in range(5)]
    requests.append(schedule_request("t0", AT, requirements=requirements(pool_name="pool-b")))
    stored, answers = [], []
    for shortcuts in (True, False):
        if not shortcuts:
            long_ways()
        app = SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"}, now=lambda: AT)
        answers.append([repr(a) for a in _placements(app, requests)])
        stored.append(_stored(app))
        app.close()
    assert answers[0] == answers[1]
    assert [a.split("(")[0] for a in answers[0]] == [
        "True", "True", "True", "True",
        "HomeRunnerUnavailableError", "False", "HomeRunnerUnavailableError",
    ]  # fmt: skip
    assert stored[0] == stored[1]
    topics = {topic.rsplit(":", 1)[1] for _, _, topic, _ in stored[0]}
    assert {"Sandbox.AssignmentFenced", "FencingTokenUse.Used", "RefusalLog.Refused"} <= topics


# -- each shortcut against the long way it replaces ---------------------------


@given(st.text(max_size=80))
def test_uuid5_is_the_standard_librarys(name: str) -> None:
    for namespace in (NAMESPACE, uuid.NAMESPACE_DNS):
        built, expected = ids.uuid5(namespace, name), uuid.uuid5(namespace, name)
        assert type(built) is uuid.UUID
        assert (built.int, built.is_safe, built.version) == (
            expected.int,
            expected.is_safe,
            expected.version,
        )
        assert built == expected
        assert hash(built) == hash(expected)
        assert str(built) == str(expected)


def test_a_tokens_use_is_what_the_librarys_create_builds() -> None:
    token = bytes(range(0xE0, 0x100)).hex()
    built = FencingTokenUse.use(sandbox_id="s1", generation=3, token_hex=token, at=AT)
    expected = _library_use(FencingTokenUse, sandbox_id="s1", generation=3, token_hex=token, at=AT)
    assert getattr(FencingTokenUse, "TOPIC", None) is None  # _create's topic check: none
    assert type(built) is FencingTokenUse
    assert built.id == fencing_token_uuid("s1", token_sha256(token))
    (event,), (expected_event,) = built.pending_events, expected.pending_events
    assert type(event) is type(expected_event)
    assert list(vars(event).items()) == list(vars(expected_event).items())
    state = {k: v for k, v in vars(built).items() if k != "_pending_events"}
    expected_state = {k: v for k, v in vars(expected).items() if k != "_pending_events"}
    assert list(vars(built)) == list(vars(expected))  # the order a snapshot follows
    assert list(state.items()) == list(expected_state.items())
    assert built.collect_events()
    assert not built.pending_events


def test_a_requirements_record_is_to_record_once_per_value() -> None:
    first = requirements()
    assert requirements_record(first) == first.to_record()
    assert requirements_record(first) is requirements_record(first)
    other = requirements(pool_name="pool-b", required_capabilities=frozenset({"b", "a"}))
    assert requirements_record(other) == other.to_record()
    assert requirements_record(other) != requirements_record(first)
    equal = requirements()  # another value, equal: its own record, equal
    assert requirements_record(equal) == requirements_record(first)
    for n in range(values._REMEMBERED_RECORDS + 5):  # past the bound: cleared, still right
        value = requirements(capacity=Capacity(instances=n))
        assert requirements_record(value) == value.to_record()
    assert len(values._requirements_records) <= values._REMEMBERED_RECORDS
    assert requirements_record(first) == first.to_record()


def test_materialization_snapshots_are_what_model_construct_builds() -> None:
    records: list[dict[str, str]] = [
        {"digest": "d", "toolchain_digest": "t", "runtime_digest": "r", "architecture": "a",
         "backend_kind": "b"},
        {"backend_kind": "", "architecture": "", "runtime_digest": "", "toolchain_digest": "",
         "digest": ""},
    ]  # fmt: skip
    for built, record in zip(materialization_snapshots(records), records, strict=True):
        expected = MaterializationSnapshot.model_construct(None, **record)
        assert type(built) is MaterializationSnapshot
        assert built == expected
        assert list(vars(built).items()) == list(vars(expected).items())
        assert built.model_dump() == expected.model_dump()
        assert built.model_fields_set == expected.model_fields_set
        assert built.__pydantic_extra__ == expected.__pydantic_extra__
        assert built.__pydantic_private__ == expected.__pydantic_private__


class _Later(datetime):
    def isoformat(self, sep: str = "T", timespec: str = "auto") -> str:
        return "later"


def test_a_datetimes_text_is_what_the_transcoders_hook_writes() -> None:
    """Each twice (the second time remembered), with and without microseconds; another
    offset's time equal to a remembered UTC one, a naive one, a subclass: their own."""
    app = SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})
    mapper = app.mapper
    assert isinstance(mapper, EventMapper)
    hook = mapper.transcoder._encode_obj  # type: ignore[attr-defined]
    app.close()
    assert mapper._default is not hook  # the remembering hook is in use
    times = [
        AT,
        AT + timedelta(microseconds=1),
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        AT.astimezone(timezone(timedelta(hours=1))),  # equal to AT, another text
        AT.replace(tzinfo=None),
        AT.replace(fold=1),
    ]
    option = encoding._OPTIONS
    for value in [*times, *times]:
        state = {"at": value, "list": [value, {"nested": value}], "none": None}
        written = orjson.dumps(state, default=mapper._default, option=option)
        assert written == orjson.dumps(state, default=hook, option=option)
    later = _Later(2024, 5, 1, 12, 0, tzinfo=UTC)  # equal to AT, remembered: not its text
    assert later == AT
    for default in (mapper._default, hook):  # no transcoding for it: json's way (the mapper)
        with pytest.raises(TypeError):
            orjson.dumps({"at": later}, default=default, option=option)
    assert all(type(t) is datetime and t.tzinfo is UTC for t in encoding._datetimes)
    for n in range(encoding._REMEMBERED_DATETIMES + 5):  # past the bound: cleared, still right
        value = AT + timedelta(seconds=n)
        assert orjson.dumps(value, default=mapper._default, option=option) == orjson.dumps(
            value, default=hook, option=option
        )
    assert len(encoding._datetimes) <= encoding._REMEMBERED_DATETIMES


def _state(aggregate: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(aggregate).items() if k != "_pending_events"}


def test_loads_decode_the_mappers_events(store: Store, clock: Clock) -> None:
    """``load_many`` decodes through an EventDecoder of the mapper: the aggregates it
    reads (snapshots and events, and events after cached versions) are those the
    repository folds from the mapper's events."""
    app, rival = store.open(), store.open()
    for n in range(3):
        register(app, f"r{n}", at=clock())
    sandboxes = [f"s{n}" for n in range(12)]
    for sandbox_id in sandboxes:
        create_sandbox(app, sandbox_id)
    app.schedule_many([schedule_request(s, clock()) for s in sandboxes[:6]])
    runners = [runner_uuid(f"r{n}") for n in range(3)] + [lease_uuid(f"r{n}") for n in range(3)]
    ids_ = [sandbox_uuid(s) for s in sandboxes] + runners
    app.load_many(runners)  # cached here, then changed by another replica
    rival.schedule_many([schedule_request(s, clock()) for s in sandboxes[6:]])
    decode = getattr(app.mapper, fast_forward._DECODE, None)
    assert isinstance(decode, EventDecoder)
    assert decode.lean
    for cache_new in (False, True):
        loaded = app.load_many(ids_, cache_new=cache_new)
        assert set(loaded) == set(ids_)
        folded = store.open()  # nothing cached: the library's reads and mapper
        for aggregate_id, aggregate in loaded.items():
            expected: Any = folded.repository.get(aggregate_id)
            assert type(aggregate) is type(expected)
            assert list(_state(aggregate)) == list(_state(expected))
            assert _state(aggregate) == _state(expected)
