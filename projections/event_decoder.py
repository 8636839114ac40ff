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

The walk visits every object and list of every event; the transcoder's objects of one
event class sit at the same few places (a timestamp, a decision's time). So each topic
learns the key paths where its events held them (:func:`_type_paths`, from the events
walked), and an event of a topic with paths is converted at those paths only, when three
checks prove the walk would convert exactly those: orjson writes the parsed state back
to the very bytes stored (no escaped key, no integer read as a float, no other spelling
of a value), every object at a path is a transcoder's object with a string as its data,
and the stored bytes name ``"_type_"`` exactly as many times as objects were converted
(none elsewhere). Otherwise the event is parsed again and walked, as before.
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
Path = tuple[tuple[str, ...], str]  # the keys of the object holding it, its own key
MAX_PATHS = 16  # past this many places for one topic, its events are walked
_TYPE_KEY = b'"_type_"'
_BIG = float(2**63)  # orjson reads an integer beyond 64 bits as a float at least this big


class _Unsure(Exception):
    """orjson's reading may differ from the json module's: ask the mapper."""


class _Topic:
    """What the decoder knows of one topic: its class, id convertor and class version,
    and the key paths of its transcoder's objects (None: walk its events)."""

    __slots__ = ("class_version", "cls", "convert_id", "paths")

    def __init__(self, cls: type[Any], convert_id: Convert, class_version: int) -> None:
        self.cls, self.convert_id, self.class_version = cls, convert_id, class_version
        self.paths: tuple[Path, ...] | None = ()


class EventDecoder:
    """``mapper.to_domain_event`` for a replay, with the per-event overhead cut."""

    def __init__(self, mapper: Any) -> None:
        self.mapper = mapper
        self._topics: dict[str, _Topic | None] = {}
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
        return self.parts(
            stored.topic, stored.originator_id, stored.originator_version, stored.state, stored
        )

    def row(self, row: tuple[int, Any, int, str, Any]) -> Any:
        """The event of a notification given as its row (position, originator id,
        version, topic, state: ``notification_reader.Row``)."""
        return self.parts(row[3], row[1], row[2], row[4], None)

    def parts(
        self,
        topic: str,
        originator_id: Any,
        originator_version: int,
        raw: Any,
        stored: StoredEvent | None,
    ) -> Any:
        """The event of a stored event's fields (``stored``: the stored event itself,
        when there is one, for the mapper; else one is made when the mapper is needed)."""
        try:
            entry = self._topics[topic]
        except KeyError:
            entry = self._learn(topic)
        if entry is None or type(originator_id) is not UUID:
            return self._mapped(topic, originator_id, originator_version, raw, stored)
        try:
            state = orjson.loads(raw)
            if type(state) is not dict:
                return self._mapped(topic, originator_id, originator_version, raw, stored)
            paths = entry.paths
            done = paths is not None and self._at_paths(state, paths, raw)
            if done is None:  # not where this topic's were: learn, from a fresh reading
                state = orjson.loads(raw)
                self._learn_paths(entry, state)
            if not done:
                self._convert(state)
        except Exception:  # the mapper's result or error
            return self._mapped(topic, originator_id, originator_version, raw, stored)
        cls = entry.cls
        state["originator_id"] = entry.convert_id(originator_id)
        state["originator_version"] = originator_version
        version = state.pop("class_version", 1)
        while version < entry.class_version:
            getattr(cls, f"upcast_v{version}_v{version + 1}")(state)
            version += 1
        event = object.__new__(cls)
        object.__setattr__(event, "__dict__", state)
        return event

    def _mapped(
        self,
        topic: str,
        originator_id: Any,
        originator_version: int,
        raw: Any,
        stored: StoredEvent | None,
    ) -> Any:
        """The mapper's event (or error) for these fields."""
        if stored is None:
            stored = StoredEvent(
                originator_id=originator_id,
                originator_version=originator_version,
                topic=topic,
                state=raw,
            )
        return self.mapper.to_domain_event(stored)

    def _at_paths(self, state: dict[str, Any], paths: tuple[Path, ...], raw: Any) -> bool | None:
        """Convert the transcoder's objects at ``paths`` in place; True when that is
        exactly what the walk would do (the module docstring). False: the bytes are not
        orjson's writing of the state (``state`` untouched, to be walked); None: the
        objects are elsewhere or other (``state`` may be converted in part)."""
        if type(raw) is not bytes or orjson.dumps(state) != raw:
            return False
        decoders = self._decoders
        converted = 0
        for parents, key in paths:
            holder: Any = state
            for parent in parents:
                holder = holder.get(parent)
                if type(holder) is not dict:
                    break
            else:
                value = holder.get(key)
                if type(value) is dict:
                    data = value.get("_data_")
                    decoder = decoders.get(value.get("_type_"))  # type: ignore[arg-type]
                    if len(value) != 2 or type(data) is not str or decoder is None:
                        return None
                    holder[key] = decoder(data)
                    converted += 1
        return True if converted == raw.count(_TYPE_KEY) else None

    def _learn_paths(self, entry: _Topic, state: dict[str, Any]) -> None:
        """Add the paths of this (unconverted) state's transcoder's objects to its
        topic's; a topic whose objects sit where paths cannot name them is walked."""
        found = _type_paths(state, ())
        if found is None:
            entry.paths = None
            return
        known = entry.paths or ()
        paths = known + tuple(path for path in found if path not in known)
        entry.paths = paths if len(paths) <= MAX_PATHS else None

    def _learn(self, topic: str) -> _Topic | None:
        entry = None
        if self.lean:
            cls = resolve_topic(topic)
            entry = _Topic(cls, find_id_convertor(cls, UUID), getattr(cls, "class_version", 1))
        self._topics[topic] = entry
        return entry


def _is_typed(value: dict[str, Any]) -> bool:
    return len(value) == 2 and "_type_" in value and "_data_" in value


def _type_paths(obj: dict[str, Any], prefix: tuple[str, ...]) -> list[Path] | None:
    """The key paths of the transcoder's objects in a parsed state (not yet converted),
    each holding a string; None when one sits in a list or holds anything but a string
    (those topics are walked)."""
    paths: list[Path] = []
    for key, value in obj.items():
        kind = type(value)
        if kind is dict:
            if _is_typed(value):
                if type(value["_data_"]) is not str:
                    return None
                paths.append((prefix, key))
            else:
                inner = _type_paths(value, (*prefix, key))
                if inner is None:
                    return None
                paths.extend(inner)
        elif kind is list and _holds_typed(value):
            return None
    return paths


def _holds_typed(items: list[Any]) -> bool:
    """Whether a transcoder's object sits anywhere inside ``items``."""
    for value in items:
        if type(value) is dict:
            if _is_typed(value) or _type_paths(value, ()) != []:
                return True
        elif type(value) is list and _holds_typed(value):
            return True
    return False


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
