"""Encoding the domain's events for the store: orjson where it gives what ``json`` gives.

The library's mapper encodes every event's state with the standard library's ``json``
and a ``default`` hook for datetimes: in a batched placement that is about a tenth of
the scheduler's CPU (three events per placement, the fence's state about 3 KB).
:class:`EventMapper` encodes the events of the domain's own aggregates
(``secondbox_scheduler.domain``), and the snapshots of those aggregates, with orjson,
datetimes still through the transcoder's hook (``{"_type_": "datetime_iso", ...}``, as
the library writes them; a UTC datetime's, its ISO text most of an event's encoding, is
written once and remembered: :func:`_datetime_fragment`), so the stored state parses to
the same JSON value and decodes to the same event; it may differ in spelling only (a
small float: ``1e-06`` for ``json``, ``1e-6`` for orjson). Anything else goes to the
library's mapper, unchanged: other modules' events and snapshots, another transcoder,
and any state orjson refuses (an integer beyond 64 bits, a key that is not a string, a
type no transcoding knows: ``json`` then encodes it or raises the library's own error).

What orjson would write differently and never raises on, a ``UUID``, ``date``,
``time``, ``Enum``, or a non-finite float inside a domain event's or aggregate's state,
is kept out by the domain itself (identifiers and generations must be ``str`` and
``int`` themselves, not subclasses such as an ``Enum``'s members, and pydantic turns
its fields into them): its records hold strings, integers, booleans, lists,
dicts, datetimes and finite floats (``timedelta.total_seconds()``); a snapshot's state
leaves the aggregate's ``UUID`` out (the library stores it as the stream id). The test
suite holds it to that: with :attr:`EventMapper.check` on (``tests/conftest.py`` turns it on) every
orjson encoding is compared with ``json``'s and a difference raises
:class:`EncodingMismatchError`; ``tests/test_event_encoding.py`` shows that it would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, ClassVar
from uuid import UUID

try:
    import orjson
except ImportError:  # without the [fast] extra: the json module's way (same values)
    orjson = None  # type: ignore[assignment]
from eventsourcing.domain import CanSnapshotAggregate, DomainEventProtocol
from eventsourcing.persistence import (
    Cipher,
    Compressor,
    DatetimeAsISO,
    JSONTranscoder,
    Mapper,
    StoredEvent,
    Transcoder,
)
from eventsourcing.utils import get_topic

DOMAIN_MODULES = "secondbox_scheduler.domain."
_OPTIONS = (
    0
    if orjson is None
    else orjson.OPT_PASSTHROUGH_DATETIME  # through the transcoder's hook, as json does
    | orjson.OPT_PASSTHROUGH_SUBCLASS  # a str or int subclass: json's way
    | orjson.OPT_PASSTHROUGH_DATACLASS  # json refuses a dataclass unless registered
)


# UTC datetimes already written, each as the transcoder's hook writes it (isoformat is
# most of an event's encoding: a fence holds eight datetimes, four of them distinct, and
# a batch's requests often share their times); cleared when full
_REMEMBERED_DATETIMES = 4096
_datetimes: dict[datetime, Any] = {}


def _datetime_fragment(value: datetime) -> Any:
    """``{"_type_": "datetime_iso", "_data_": value.isoformat()}`` as orjson would write
    the transcoder's dict, ready written (an ``orjson.Fragment``), for a ``datetime``
    itself in UTC: two of those that are equal (hash alike) have the same fields, so the
    same ISO text. Another offset's datetime can equal a UTC one and write another text,
    and a subclass could write its own: neither is ever remembered."""
    try:
        return _datetimes[value]
    except KeyError:
        pass
    fragment = orjson.Fragment(
        b'{"_type_":"datetime_iso","_data_":"' + value.isoformat().encode() + b'"}'
    )
    if len(_datetimes) >= _REMEMBERED_DATETIMES:
        _datetimes.clear()
    _datetimes[value] = fragment
    return fragment


def _remembering_hook(encode_obj: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The transcoder's hook, UTC datetimes through :func:`_datetime_fragment`."""

    def default(value: Any) -> Any:
        if type(value) is datetime and value.tzinfo is UTC:
            return _datetime_fragment(value)
        return encode_obj(value)

    return default


class EncodingMismatchError(AssertionError):
    """orjson and json encoded an event's state to different JSON values (check mode)."""


class EventMapper(Mapper[UUID]):
    """The library's mapper; ``to_stored_event`` takes the orjson path for the domain's
    own event classes (see the module's docstring)."""

    check: ClassVar[bool] = False  # also encode with json and compare (the test suite)

    def __init__(
        self,
        transcoder: Transcoder,
        compressor: Compressor | None = None,
        cipher: Cipher | None = None,
    ) -> None:
        super().__init__(transcoder, compressor=compressor, cipher=cipher)
        self._lean = (
            orjson is not None  # without orjson, the library's mapper encodes every event
            and isinstance(transcoder, JSONTranscoder)
            and type(transcoder).encode is JSONTranscoder.encode
            and type(transcoder)._encode_obj is JSONTranscoder._encode_obj
            # a transcoding for a type orjson writes itself (an Enum, say) would be bypassed
            and set(transcoder.types) <= {UUID, Decimal, datetime}
        )
        self._topics: dict[type[Any], str | None] = {}  # event class: topic, or None
        self._default: Callable[[Any], Any] | None = None  # orjson's hook (lean only)
        if self._lean:
            assert isinstance(transcoder, JSONTranscoder)
            self._default = transcoder._encode_obj
            datetimes = transcoder.types.get(datetime)
            if (  # the library's own datetime transcoding: its text remembered
                hasattr(orjson, "Fragment")  # not in the oldest orjson the extra allows
                and datetimes is not None
                and type(datetimes) is DatetimeAsISO
                and datetimes.name == "datetime_iso"
            ):
                self._default = _remembering_hook(transcoder._encode_obj)
        self._snapshots: set[type[Any]] = set()  # snapshot classes (of any aggregate)

    def to_stored_event(self, domain_event: DomainEventProtocol[UUID]) -> StoredEvent:
        cls = type(domain_event)
        try:
            topic = self._topics[cls]
        except KeyError:
            topic = self._learn(cls)
        if topic is None or (
            cls in self._snapshots
            and not getattr(domain_event, "topic", "").startswith(DOMAIN_MODULES)
        ):
            return super().to_stored_event(domain_event)
        state = dict(vars(domain_event))
        originator_id = state.pop("originator_id")
        originator_version = state.pop("originator_version")
        class_version = getattr(cls, "class_version", 1)
        if class_version > 1:
            state["class_version"] = class_version
        transcoder = self.transcoder
        assert isinstance(transcoder, JSONTranscoder)
        try:
            stored = orjson.dumps(state, default=self._default, option=_OPTIONS)
        except TypeError:  # orjson.JSONEncodeError: json's encoding, or json's error
            stored = transcoder.encode(state)
        else:
            if self.check:
                _compare(topic, stored, transcoder.encode(state))
        if self.compressor:
            stored = self.compressor.compress(stored)
        if self.cipher:
            stored = self.cipher.encrypt(stored)
        return StoredEvent(
            originator_id=originator_id,
            originator_version=originator_version,
            topic=topic,
            state=stored,
        )

    def _learn(self, cls: type[Any]) -> str | None:
        topic = None
        if self._lean and issubclass(cls, CanSnapshotAggregate):
            topic = get_topic(cls)  # whether its aggregate is the domain's: per snapshot
            self._snapshots.add(cls)
        elif self._lean and cls.__module__.startswith(DOMAIN_MODULES):
            topic = get_topic(cls)
        self._topics[cls] = topic
        return topic


def _canonical(stored: bytes) -> str:
    """The JSON value written again one way: equal for equal values, and unlike Python's
    ``==``, different for ``true`` and ``1``, ``1`` and ``1.0``, ``null`` and ``NaN``."""
    return json.dumps(json.loads(stored), separators=(",", ":"), ensure_ascii=False)


def _compare(topic: str, fast: bytes, usual: bytes) -> None:
    if fast != usual and _canonical(fast) != _canonical(usual):
        raise EncodingMismatchError(
            f"{topic}: orjson wrote {fast[:200]!r}, json wrote {usual[:200]!r}"
        )
