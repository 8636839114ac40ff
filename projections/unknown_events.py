"""Events a read model meets but does not know: counted by topic and logged, never fatal.

Every consumer of the log in ``projections/`` declares the event classes it handles and
those it ignores, each with a reason (``IGNORED``); ``domain/event_catalogue.py`` and
``tests/test_completeness_whatif_projections.py`` check that together they are every
class the aggregates record. The consumers read everything but what they ignore, so an
event of any other class (written by a later release, say) is met rather than filtered
out by its topic: it changes no row, and :class:`UnknownEvents` counts it by topic and
logs the first of each topic as a warning. The read model goes on: a newer writer must
not stop an older reader. Its topic is not even decoded (its class may not exist here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from threading import Lock
from typing import Any

from secondbox_scheduler.domain.event_topics import topics_of

log = logging.getLogger(__name__)


def topics_of_classes(classes: Iterable[type[Any]]) -> frozenset[str]:
    """Every topic under which events of these classes may be stored (former ones too)."""
    return frozenset(topic for cls in classes for topic in topics_of(cls))


class UnknownEvents:
    """How many events of each unknown topic a consumer (``name``) has met."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._counts: dict[str, int] = {}
        self._lock = Lock()  # met by a catch-up while a status reads

    def add(self, counts: Mapping[str, int]) -> None:
        """Count events met, by topic; the first of a topic is logged."""
        if not counts:
            return
        with self._lock:
            for topic, count in counts.items():
                if topic not in self._counts:
                    log.warning(
                        "%s: events of a class it does not know (topic %s) are not "
                        "projected, only counted (written by another release?)",
                        self.name,
                        topic,
                    )
                self._counts[topic] = self._counts.get(topic, 0) + count

    def counts(self) -> dict[str, int]:
        """The events met so far by topic, sorted by topic."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def clear(self) -> None:
        """Forget them (a rebuild meets them again)."""
        with self._lock:
            self._counts.clear()

    def __bool__(self) -> bool:
        return bool(self._counts)
