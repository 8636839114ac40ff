"""Hostile input: malformed requests and commands get typed errors and change nothing."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain import InvalidRequestError, ScheduleRequest, SchedulerError
from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH, text_problem
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import T0, Clock
from tests.factories import create_sandbox, register, schedule_request, token

HOSTILE_TEXT = st.one_of(
    st.just(""),
    st.just("\x00"),
    st.text(min_size=1, max_size=5).map(lambda s: s + "\x00"),
    st.integers(),
    st.none(),
    st.binary(max_size=8),
    st.lists(st.text(max_size=3), max_size=2),
)
WEIRD_BUT_VALID_TEXT = st.one_of(
    st.text(min_size=1, max_size=40).filter(
        lambda s: text_problem(s, max_length=MAX_NAME_LENGTH, name=True) is None
    ),
    st.just("é" * 5000),
)
BAD_CAPACITY = st.dictionaries(
    st.sampled_from(["vcpu_count", "memory_bytes", "disk_bytes", "instances", "operations",
                     "gpus"]),
    st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), st.floats(),
              st.text(max_size=3), st.booleans()),
    min_size=1, max_size=3,
)  # fmt: skip
BAD_TIME = st.one_of(
    st.datetimes(max_value=datetime(2100, 1, 1)),  # naive
    st.none(),
    st.text(max_size=10),
    st.integers(),
)
BAD_TOKEN = st.one_of(st.binary(max_size=31), st.text(max_size=40), st.none(), st.integers())


@st.composite
def hostile_requests(draw: st.DrawFn) -> dict[str, Any]:
    """Overrides that break at least one field of an otherwise valid request."""
    field = draw(
        st.sampled_from(
            [*ScheduleRequest.IDENTITY_FIELDS, "fencing_token", "claim_expires_at",
             "operation_deadline", "now", "effect_started_at", "plan_ready_at",
             "heartbeat_timeout", "retry_limit", "serialization_retry_limit", "capacity",
             "guest_protocol_generation", "resolved_artifacts", "timing", "requirements"]
        )
    )  # fmt: skip
    if field in ScheduleRequest.IDENTITY_FIELDS:
        return {field: draw(HOSTILE_TEXT)}
    if field == "fencing_token":
        return {field: draw(BAD_TOKEN)}
    if field in ("claim_expires_at", "operation_deadline", "now", "effect_started_at",
                 "plan_ready_at"):  # fmt: skip
        return {field: draw(BAD_TIME)}
    if field == "heartbeat_timeout":
        return {field: draw(st.one_of(st.timedeltas(max_value=timedelta(0)), st.integers()))}
    if field in ("retry_limit", "serialization_retry_limit"):
        return {field: draw(st.one_of(st.integers(max_value=-1), st.text(max_size=2)))}
    if field == "capacity":
        return {"requirements": {"pool_name": "pool-a", "architecture": "x86_64",
                                 "guest_protocol_generation": 2,
                                 "capacity": draw(BAD_CAPACITY)}}  # fmt: skip
    if field == "guest_protocol_generation":
        value = draw(st.one_of(st.just(0), st.integers(max_value=-1), st.integers(min_value=2**32)))
        return {"requirements": {"pool_name": "pool-a", "architecture": "x86_64",
                                 "guest_protocol_generation": value}}  # fmt: skip
    if field == "resolved_artifacts":
        return {field: draw(st.one_of(st.just({"a": 1}), st.just({1: "a"}), st.just("x")))}
    if field == "timing":
        skew = draw(st.integers(min_value=1, max_value=10**6))
        late = T0 - timedelta(microseconds=skew)
        return draw(st.sampled_from([{"effect_started_at": late}, {"plan_ready_at": late}]))
    return {"requirements": draw(st.one_of(st.just("x"), st.integers(), st.just({"pools": 1})))}


def snapshot(app: SchedulerApplication) -> tuple[int, Any, Any]:
    read_models = app.current_read_models()
    assert read_models is not None
    return (
        app.head_position(),
        [view.rows() for view in read_models.views.values()],  # type: ignore[attr-defined]
        app.get_runner("r1"),
    )


@pytest.fixture
def seeded(app: SchedulerApplication, clock: Clock) -> SchedulerApplication:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    return app


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(overrides=hostile_requests())
def test_hostile_schedule_requests_change_nothing(
    seeded: SchedulerApplication, overrides: dict[str, Any]
) -> None:
    before = snapshot(seeded)
    with pytest.raises(SchedulerError) as raised:
        seeded.schedule(schedule_request("s1", T0, **overrides))
    if isinstance(raised.value, InvalidRequestError):
        assert raised.value.field, "the error names the field"
        assert raised.value.field.split(".")[0] in {*overrides, "requirements"}
    assert snapshot(seeded) == before


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sandbox_id=WEIRD_BUT_VALID_TEXT)
def test_unicode_and_very_long_ids_are_safe(seeded: SchedulerApplication, sandbox_id: str) -> None:
    """Valid but unusual ids: refused for the right reason (no such sandbox), nothing written."""
    before = snapshot(seeded)
    with pytest.raises(SchedulerError):
        seeded.schedule(schedule_request(sandbox_id, T0, workspace_id="w"))
    assert snapshot(seeded) == before


# Values wrong for every parameter they are given to (no plain valid text among them).
COMMAND_VALUES = st.one_of(
    HOSTILE_TEXT,
    BAD_CAPACITY,
    st.datetimes(max_value=datetime(2100, 1, 1)),
    st.binary(max_size=31),
    st.floats(),
)
COMMANDS = st.sampled_from(["register", "heartbeat", "allocatable", "create", "fail",
                            "release", "claim", "running", "advance"])  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(command=COMMANDS, value=COMMAND_VALUES)
def test_hostile_commands_change_nothing(
    seeded: SchedulerApplication, command: str, value: Any
) -> None:
    app = seeded
    request = schedule_request("s1", T0, fencing_token=token())
    calls: dict[str, Any] = {
        "register": lambda: app.register_runner(
            runner_id="r9", pool_name=value, backend_kind="firecracker", architecture="x86_64",
            capabilities=["compute"], allocatable={"instances": 1},
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        ),
        "heartbeat": lambda: app.record_heartbeat(runner_id="r1", at=value),
        "allocatable": lambda: app.change_allocatable("r1", value),
        "create": lambda: app.create_sandbox(
            sandbox_id="s9", workspace_id=value, profile_revision_id="p",
            requirements={"pool_name": "pool-a", "architecture": "x86_64",
                          "guest_protocol_generation": 2},
            heartbeat_timeout=timedelta(seconds=30),
        ),
        "fail": lambda: app.fail("s1", 1, request.fencing_token, value),
        "release": lambda: app.release("s1", 1, value, {"proof": "x"}),
        "claim": lambda: app.claim_reconcile("s1", 1, "owner", value),
        "running": lambda: app.mark_running("s1", value, request.fencing_token),
        "advance": lambda: app.advance_generation(value, 1),
    }  # fmt: skip
    before = snapshot(app)
    with pytest.raises(SchedulerError):
        calls[command]()
    assert snapshot(app) == before


class _Owner(str, Enum):  # noqa: UP042 (a str-mixin Enum, as embedders write them)
    """A str whose Enum value is not its text: json writes "ops", orjson "OPS"."""

    OPS = "ops"

    def __new__(cls, text: str) -> _Owner:
        member = str.__new__(cls, text)
        member._value_ = text.upper()
        return member


class _One(int, Enum):
    """An int whose Enum value is True: json writes 1, orjson true."""

    YES = 1

    def __new__(cls, number: int) -> _One:
        member = int.__new__(cls, number)
        member._value_ = bool(number)
        return member


def test_enum_members_are_refused_as_ids_and_generations(seeded: SchedulerApplication) -> None:
    """An Enum member would be stored by its value, not its text (the domain's events are
    encoded with orjson): refused at the boundary, naming the field; nothing written."""
    before = snapshot(seeded)
    with pytest.raises(InvalidRequestError) as owner:
        seeded.claim_reconcile("s1", 1, _Owner.OPS, T0 + timedelta(minutes=5))
    assert owner.value.field == "owner"
    with pytest.raises(InvalidRequestError) as generation:
        seeded.mark_running("s1", _One.YES, token())
    assert generation.value.field == "generation"
    with pytest.raises(InvalidRequestError) as proof:
        seeded.release("s1", 1, token(), {"proof": _Owner.OPS})
    assert proof.value.field == "release_proof"
    assert snapshot(seeded) == before
