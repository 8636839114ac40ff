"""Decoding stored events for a replay (rebuild, catch-up, audit), faster than the mapper.

A replay decodes every event of the log, and with the library's mapper decoding is
most of its cost: the standard library's ``json`` with an object hook called for every
JSON object, then the event class resolved from its topic for every event.
:class:`EventDecoder` gives the same domain events for the application's own mapper
(the library's ``Mapper`` and ``JSONTranscoder``, no cipher, no compressor): it parses
with orjson, converts the transcoder's ``{"_type_": ..., "_data_": ...}`` objects
innermost first as the object hook does (ISO datetimes and hex UUIDs parsed directly),
and looks each topic's event class and id convertor up once.

A class with a ``class_version`` is upcast as the mapper does (the stored state's
``class_version``, 1 when absent, then each ``upcast_vN_vN+1`` in turn). Anything else
goes to the mapper itself, so results and errors are always the mapper's: another mapper
or transcoder, a state orjson refuses (NaN) or may read differently (orjson reads an
integer beyond 64 bits as a float, so any float of that size goes to the mapper).
``tests/test_event_decoder.py`` checks that both give equal events for every kind.

Most of the decoding is the walk that finds the transcoded objects. Events of one topic
keep them in the same few places (a fence's nine times), so the decoder learns, per
topic, where they were (paths of keys and list indexes) and converts an event of that
topic at those places only: when it converted there as many objects as the state holds
``"_type_"`` keys (counted in the bytes, in C), there is none elsewhere, and the result
is the walk's. Otherwise (another shape, an escaped key: a backslash-u escape anywhere, a key
``_type_`` in an object of other keys) the walk goes over the rest, and the places it
found are learned. An integer literal of 19 digits or more (which orjson would read as
a float) sends the event to the mapper before parsing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

try:
    import orjson
except ImportError:  # without the [fast] extra: the json module's way (same values)
    orjson = None  # type: ignore[assignment]
from eventsourcing.persistence import (
    DatetimeAsISO,
    JSONTranscoder,
    Mapper,
    StoredEvent,
    UUIDAsHex,
    find_id_convertor,
)
from eventsourcing.utils import resolve_topic

Convert = Callable[[Any], Any]
_BIG = float(2**63)  # orjson reads an integer beyond 64 bits as a float at least this big
# an integer literal of 19 digits or more (2**63 has 19): orjson may read it as a float
_LONG_INTEGER = re.compile(rb"[:,\[]\s*-?\d{19}")
_TYPE_KEY = b'"_type_"'
PLAN_PATHS = 64  # places of transcoded objects learned per topic, at most
Path = tuple[tuple[str | int, ...], str | int]  # the keys to a container, the key in it


class _Unsure(Exception):
    """orjson's reading may differ from the json module's: ask the mapper."""


class EventDecoder:
    """``mapper.to_domain_event`` for a replay, with the per-event overhead cut."""

    def __init__(self, mapper: Any) -> None:
        self.mapper = mapper
        self._topics: dict[str, tuple[type[Any], Convert, int] | None] = {}
        transcoder = getattr(mapper, "transcoder", None)
        self.lean = (
            orjson is not None  # else the mapper decodes every event
            and type(mapper).to_domain_event is Mapper.to_domain_event
            and not mapper.cipher
            and not mapper.compressor
            and isinstance(transcoder, JSONTranscoder)
            and type(transcoder).decode is JSONTranscoder.decode
            and type(transcoder)._decode_obj is JSONTranscoder._decode_obj
        )
        self._decoders: dict[str, Convert] = {}
        for name, transcoding in getattr(transcoder, "names", {}).items():
            if type(transcoding) is DatetimeAsISO:
                self._decoders[name] = datetime.fromisoformat
            elif type(transcoding) is UUIDAsHex:
                self._decoders[name] = UUID
            else:
                self._decoders[name] = transcoding.decode
        self._convert = _converter(self._decoders)
        self._plans: dict[str, list[Path]] = {}  # per topic: where its objects were

    def __call__(self, stored: StoredEvent) -> Any:
        try:
            entry = self._topics[stored.topic]
        except KeyError:
            entry = self._learn(stored.topic)
        if entry is None or type(stored.originator_id) is not UUID:
            return self.mapper.to_domain_event(stored)
        try:
            raw = stored.state
            if _LONG_INTEGER.search(raw) is not None:
                raise _Unsure
            state = orjson.loads(raw)
            if type(state) is not dict:
                return self.mapper.to_domain_event(stored)
            self._decode(stored.topic, raw, state)
        except Exception:
            return self.mapper.to_domain_event(stored)  # the mapper's result or error
        cls, convert_id, class_version = entry
        state["originator_id"] = convert_id(stored.originator_id)
        state["originator_version"] = stored.originator_version
        version = state.pop("class_version", 1)
        while version < class_version:
            getattr(cls, f"upcast_v{version}_v{version + 1}")(state)
            version += 1
        event = object.__new__(cls)
        object.__setattr__(event, "__dict__", state)
        return event

    def _decode(self, topic: str, raw: bytes, state: dict[str, Any]) -> None:
        """Convert every transcoded object of ``state`` in place: at the places learned
        for ``topic`` when that accounts for all of them, else by the walk."""
        wanted = raw.count(_TYPE_KEY)
        plan = self._plans.get(topic)
        if b"\\u" not in raw and (  # no key spelled with escapes
            not wanted or (plan is not None and _convert_at(state, plan, self._decoders) == wanted)
        ):
            return
        fresh = orjson.loads(raw)
        self._convert(state)
        if plan is None:
            plan = self._plans[topic] = []
        if len(plan) < PLAN_PATHS:
            known = set(plan)
            plan += [p for p in _places(fresh) if p not in known][: PLAN_PATHS - len(plan)]

    def _learn(self, topic: str) -> tuple[type[Any], Convert, int] | None:
        entry = None
        if self.lean:
            cls = resolve_topic(topic)
            entry = (cls, find_id_convertor(cls, UUID), getattr(cls, "class_version", 1))
        self._topics[topic] = entry
        return entry


def _converter(decoders: dict[str, Convert]) -> Callable[[dict[str, Any]], None]:
    """A function that replaces, in place, every ``{"_type_": name, "_data_": data}``
    object inside a parsed state by ``decoders[name](data)``, innermost first (as the
    transcoder's object hook sees them). One closure with local names: this walk runs
    for every object of every event of a replay."""

    def convert_object(obj: dict[str, Any]) -> Any:
        if len(obj) == 2 and "_type_" in obj and "_data_" in obj:
            data = obj["_data_"]
            kind = type(data)
            if kind is dict:
                data = convert_object(data)
            elif kind is list:
                convert_items(data)
            return decoders[obj["_type_"]](data)
        convert_members(obj)
        return obj

    def convert_members(obj: dict[str, Any]) -> None:
        for key, value in obj.items():
            kind = type(value)
            if kind is dict:
                obj[key] = convert_object(value)
            elif kind is list and value:
                convert_items(value)
            elif kind is float and not -_BIG < value < _BIG:
                raise _Unsure

    def convert_items(items: list[Any]) -> None:
        for index, value in enumerate(items):
            kind = type(value)
            if kind is dict:
                items[index] = convert_object(value)
            elif kind is list and value:
                convert_items(value)
            elif kind is float and not -_BIG < value < _BIG:
                raise _Unsure

    return convert_members


def _is_leaf_object(value: Any) -> bool:
    """A transcoded object whose data holds no other (a time, an id): converted alone."""
    return (
        type(value) is dict
        and len(value) == 2
        and type(value.get("_type_")) is str
        and type(value.get("_data_")) is str
    )


def _convert_at(state: dict[str, Any], plan: list[Path], decoders: dict[str, Convert]) -> int:
    """Convert the transcoded objects found at the places of ``plan``; how many."""
    done = 0
    for keys, last in plan:
        node: Any = state
        try:
            for key in keys:
                node = node[key]
            value = node[last]
        except (KeyError, IndexError, TypeError):
            continue
        if _is_leaf_object(value):
            node[last] = decoders[value["_type_"]](value["_data_"])
            done += 1
    return done


def _places(state: dict[str, Any]) -> list[Path]:
    """The places of the leaf transcoded objects of a parsed (not converted) state."""
    found: list[Path] = []

    def visit(node: Any, keys: tuple[str | int, ...]) -> None:
        items = node.items() if type(node) is dict else enumerate(node)
        for key, value in items:
            if _is_leaf_object(value):
                found.append((keys, key))
            elif type(value) is dict or type(value) is list:
                visit(value, (*keys, key))

    visit(state, ())
    return found
