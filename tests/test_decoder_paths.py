"""The replay decoder's conversion at learned paths gives what the walk gives: the
mapper's events for every stored state, and the same ``audit verify`` findings as the
walk alone on tampered histories.

An :class:`EventDecoder` converts the transcoder's objects of an event where its topic's
events held them, when the stored bytes prove that no other object needs converting
(``projections/event_decoder.py``); any other state is walked as before. The states
below are the simulated history's events edited so that a learned path would be wrong:
each must still decode as the mapper decodes it, and the walk must be what did it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.persistence import Notification

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import read_pages
from tests.test_tamper import (  # noqa: F401 (fixtures)
    EDITS,
    Copy,
    Raw,
    copy_of,
    edit_json,
    nth,
    simulated,
)

STAMP = {"_type_": "datetime_iso", "_data_": "2026-01-02T03:04:05+00:00"}


@pytest.fixture
def app(simulated: Path, tmp_path: Path) -> Iterator[SchedulerApplication]:  # noqa: F811
    copy = tmp_path / "history.db"  # the session's history stays as written
    shutil.copyfile(simulated, copy)
    opened = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": f"sqlite:///{copy}", "SECONDBOX_READ_MODELS": "off"}
    )
    yield opened
    opened.close()


def _notifications(app: SchedulerApplication) -> list[Notification]:
    return [n for page in read_pages(app.recorder) for n in page]


def _with_state(notification: Notification, state: bytes) -> Notification:
    return Notification(
        id=notification.id, originator_id=notification.originator_id,
        originator_version=notification.originator_version, topic=notification.topic,
        state=state,
    )  # fmt: skip


def _edited(notification: Notification, change: Callable[[dict[str, Any]], None]) -> bytes:
    state = json.loads(notification.state)
    change(state)
    return json.dumps(state, separators=(",", ":"), ensure_ascii=False).encode()


def _armed(app: SchedulerApplication) -> tuple[EventDecoder, list[int]]:
    """A decoder that has learned every topic's paths, and a count of its walks."""
    decode = EventDecoder(app.mapper)
    for notification in _notifications(app):
        decode(notification)
    walks = [0]
    walk = decode._convert

    def counted(state: dict[str, Any]) -> None:
        walks[0] += 1
        walk(state)

    decode._convert = counted
    return decode, walks


def _same(decode: EventDecoder, app: SchedulerApplication, notification: Notification) -> None:
    try:
        usual: Any = app.mapper.to_domain_event(notification)
    except Exception as error:
        with pytest.raises(type(error)):
            decode(notification)
        return
    lean = decode(notification)
    assert type(lean) is type(usual)
    assert vars(lean) == vars(usual)


def test_clean_events_are_converted_at_their_paths_without_the_walk(
    app: SchedulerApplication,
) -> None:
    decode, walks = _armed(app)
    notifications = _notifications(app)
    for notification in notifications:
        _same(decode, app, notification)
    assert walks[0] == 0
    fenced = next(n for n in notifications if n.topic.endswith("AssignmentFenced"))
    paths = decode._topics[fenced.topic].paths  # type: ignore[union-attr]
    assert paths is not None
    assert (("placement",), "decided_at") in paths


def _variants(fenced: Notification) -> dict[str, bytes]:
    """Edits of a fence's stored state that the learned paths do not describe."""
    state = fenced.state

    def at(change: Callable[[dict[str, Any]], None]) -> bytes:
        return _edited(fenced, change)

    return {
        "an object at a new key": at(lambda s: s.update(extra=dict(STAMP))),
        "an object in a list": at(lambda s: s["placement"]["candidates"][0].update(at=STAMP)),
        "an object inside an object": at(
            lambda s: s["placement"].update(nested={"deeper": dict(STAMP)})
        ),
        "a path holding a plain object": at(
            lambda s: s["placement"].update(decided_at={"deeper": dict(STAMP)})
        ),
        "a path's object with a third key": at(
            lambda s: s["placement"].update(decided_at={**STAMP, "more": 1})
        ),
        "a path's object holding an object": at(
            lambda s: s["placement"].update(
                decided_at={"_type_": "datetime_iso", "_data_": {"x": 1}}
            )
        ),
        "a path's object of an unknown type": at(
            lambda s: s["placement"].update(decided_at={"_type_": "nope", "_data_": "x"})
        ),
        "a path's object of another type": at(
            lambda s: s["placement"].update(decided_at={"_type_": "uuid_hex", "_data_": "0" * 32})
        ),
        "a path holding null": at(lambda s: s["placement"].update(decided_at=None)),
        "the key's name as a string value": at(lambda s: s.update(note="_type_")),
        "an escaped key": state.replace(b'"_type_"', b'"\\u005ftype_"', 1),
        "an escaped key at a new place": at(lambda s: s.update(extra=dict(STAMP))).replace(
            b'"extra":{"_type_"', b'"extra":{"\\u005ftype_"'
        ),
        "a big integer": state.replace(b'"attempt":0', b'"attempt":' + b"9" * 30),
        "a float as orjson writes it": state.replace(b'"attempt":0', b'"attempt":1e300'),
        "spaces": state.replace(b'","', b'", "'),
        "a non-ASCII character escaped": at(lambda s: s.update(note="é")).replace(
            "é".encode(), b"\\u00e9"
        ),
        "not JSON": state[:-1],
        "a list": b"[1,2]",
    }


# edits whose state the paths still describe (or that never reach a conversion)
CONVERTED_AT_PATHS = {
    "a path holding null", "a path's object of another type",
    "not JSON", "a list",
}  # fmt: skip


def test_states_the_paths_do_not_describe_decode_as_the_mapper_decodes_them(
    app: SchedulerApplication,
) -> None:
    notifications = _notifications(app)
    fenced = next(n for n in notifications if n.topic.endswith("AssignmentFenced"))
    variants = _variants(fenced)
    for name, state in variants.items():
        assert state != fenced.state, name
        decode, walks = _armed(app)
        _same(decode, app, _with_state(fenced, state))
        # the paths convert what the walk would (the same decoder), else it walks
        assert walks[0] == (name not in CONVERTED_AT_PATHS), name
        # and the clean event after it still decodes (by the paths, as the mapper does)
        _same(decode, app, fenced)


def _walk_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event walked, as before the paths (the old path)."""
    monkeypatch.setattr(EventDecoder, "_at_paths", lambda self, state, paths, raw: False)


def _findings(copy: Copy, workers: int) -> list[dict[str, Any]]:
    app = copy.open()
    try:
        report = verify(app, measure_raw=False, workers=workers)
    finally:
        app.close()
    return [violation.to_dict() for violation in report.violations]


def _moved_stamp(raw: Raw) -> int:
    position = nth(raw, "Sandbox.AssignmentFenced", 1)
    edit_json(raw, position, lambda s: s["placement"].update(extra=dict(STAMP)))
    return position


def _escaped_key(raw: Raw) -> int:
    position = nth(raw, "Sandbox.Created", 2)
    state = raw.event(position)[3]
    raw.set_state(position, bytes(state).replace(b'"_type_"', b'"\\u005ftype_"', 1))
    return position


def _big_integer(raw: Raw) -> int:
    position = nth(raw, "Sandbox.AssignmentFenced", 2)
    state = bytes(raw.event(position)[3])
    raw.set_state(position, state.replace(b'"attempt":0', b'"attempt":' + b"9" * 30))
    return position


def _stamp_as_plain_object(raw: Raw) -> int:
    position = nth(raw, "Sandbox.AssignmentFenced", 3)
    edit_json(raw, position, lambda s: s["placement"].update(decided_at={"x": STAMP}))
    return position


DECODER_EDITS: dict[str, Callable[[Raw], int]] = {
    "a stamp at a new key": _moved_stamp,
    "an escaped _type_ key": _escaped_key,
    "a big integer": _big_integer,
    "a stamp inside a plain object": _stamp_as_plain_object,
    **{name: EDITS[name] for name in ("decision time moved back", "heartbeat timeout 1e9",
                                      "fencing token digit", "release proof")},
}  # fmt: skip


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("edit", DECODER_EDITS)
def test_audit_verify_finds_with_the_paths_what_it_finds_with_the_walk(
    edit: str,
    kind: str,
    copy_of: Callable[[str], Copy],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copy = copy_of(kind)
    DECODER_EDITS[edit](copy.raw)
    with_paths = {workers: _findings(copy, workers) for workers in (1, 2)}
    _walk_only(monkeypatch)
    walked = {workers: _findings(copy, workers) for workers in (1, 2)}
    assert with_paths[1], "the edit is found"
    assert with_paths == walked
    assert with_paths[1] == with_paths[2]
