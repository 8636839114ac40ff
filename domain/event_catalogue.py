"""The catalogue of event classes, and the completeness check of their consumers.

Every consumer of the log (the audit fold, the what-if replay, each projection) says,
for every event class the aggregates record, either how it handles it or why it ignores
it. :func:`unaccounted` names the classes a consumer does neither for: the completeness
test runs it over every consumer, so that adding an event without teaching the
consumers fails the suite, and a consumer meeting an event class it does not know at
run time reports it (a finding, never a silent skip). docs/extending.md ("Adding an
event") lists the places to touch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.event_topics import EVENT_MODULES, stored_classes


def event_classes() -> tuple[type[Any], ...]:
    """Every event class that the aggregates record, in the order of their modules.

    The library's base classes of an aggregate's events (``X.Event``, and ``X.Created``
    where the creation event has a name of its own) are left out: no event is stored
    under them."""
    found: list[type[Any]] = []
    for module in EVENT_MODULES:
        for cls in stored_classes(module):
            if issubclass(cls, Aggregate):
                continue
            if cls.__name__ == "Event":  # the library's base of the aggregate's events
                continue
            if cls.__name__ == "Created" and _named_creation(cls):
                continue
            found.append(cls)
    return tuple(found)


def _named_creation(created: type[Any]) -> bool:
    """Whether the aggregate of ``created`` (the library's generated ``X.Created``) is
    created by an event of another name (``Runner.Registered``): then none is stored as
    ``X.Created``."""
    outer = getattr(sys.modules[created.__module__], created.__qualname__.split(".")[0])
    return any(
        isinstance(value, type) and issubclass(value, Aggregate.Created) and value is not created
        for value in vars(outer).values()
    )


def event_name(cls: type[Any]) -> str:
    """``Aggregate.Event``, as the catalogue (docs/events.md) names it."""
    return cls.__qualname__


def unaccounted(handled: Iterable[type[Any]], ignored: Mapping[type[Any], str]) -> list[str]:
    """The event classes a consumer neither handles nor ignores with a reason, and the
    classes it names that are not in the catalogue (stale entries)."""
    handled_set, catalogue = set(handled), set(event_classes())
    missing = [
        event_name(cls)
        for cls in event_classes()
        if cls not in handled_set and not ignored.get(cls, "").strip()
    ]
    stale = [
        f"{event_name(cls)} (not an event of the catalogue)"
        for cls in sorted(handled_set | set(ignored), key=event_name)
        if cls not in catalogue
    ]
    both = [
        f"{event_name(cls)} (both handled and ignored)"
        for cls in sorted(handled_set & set(ignored), key=event_name)
    ]
    return missing + stale + both
