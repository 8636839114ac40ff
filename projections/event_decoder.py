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
"""

from __future__ import annotations

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

    def __call__(self, stored: StoredEvent) -> Any:
        try:
            entry = self._topics[stored.topic]
        except KeyError:
            entry = self._learn(stored.topic)
        if entry is None or type(stored.originator_id) is not UUID:
            return self.mapper.to_domain_event(stored)
        try:
            state = orjson.loads(stored.state)
            if type(state) is not dict:
                return self.mapper.to_domain_event(stored)
            self._convert(state)
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
