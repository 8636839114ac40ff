"""Topics: the names under which stored events and snapshots locate their classes.

The eventsourcing library stores each event with the topic of its class, the module
path and the qualified name (``secondbox_scheduler.domain.sandbox:Sandbox.AssignmentFenced``),
and a snapshot with the topic of its aggregate class. Release 0.1 installed the layers
as top-level packages, so its histories name the same classes ``domain.sandbox:...``.
Those topics are registered here with the library's own means (``register_topic``) for
exactly the classes that events and snapshots name, never for the bare ``domain``
package, so that a host application's own ``domain`` package keeps resolving its own
topics. docs/events.md ("Versioning") gives the rules.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

from eventsourcing.domain import Aggregate, DomainEvent
from eventsourcing.utils import get_topic, register_topic

import secondbox_scheduler.domain.access_tokens as access_tokens
import secondbox_scheduler.domain.cell_claims as cell_claims
import secondbox_scheduler.domain.fencing_tokens as fencing_tokens
import secondbox_scheduler.domain.lease as lease
import secondbox_scheduler.domain.refusals as refusals
import secondbox_scheduler.domain.runner as runner
import secondbox_scheduler.domain.sandbox as sandbox

PACKAGE = "secondbox_scheduler."
# The modules that define stored classes (aggregates and their events).
EVENT_MODULES: tuple[ModuleType, ...] = (
    runner, lease, sandbox, refusals, fencing_tokens, access_tokens, cell_claims,
)  # fmt: skip
# Release by release, how each module that existed then was named (0.1: top-level layers).
FORMER_MODULE_NAMES: tuple[dict[str, str], ...] = (
    {module.__name__: module.__name__.removeprefix(PACKAGE) for module in
     (runner, lease, sandbox, refusals)},
)  # fmt: skip


def stored_classes(module: ModuleType) -> Iterator[type[Any]]:
    """The aggregate classes a module defines and the event classes nested in them."""
    for value in vars(module).values():
        if not (
            isinstance(value, type)
            and issubclass(value, Aggregate)
            and value.__module__ == module.__name__
        ):
            continue
        yield value
        for nested in vars(value).values():
            if isinstance(nested, type) and issubclass(nested, DomainEvent):
                yield nested


def former_topics(cls: type[Any]) -> tuple[str, ...]:
    """The topics earlier releases stored for ``cls`` (empty for a class they lacked)."""
    topics = []
    for renames in FORMER_MODULE_NAMES:
        former = renames.get(cls.__module__)
        if former is not None:
            topics.append(f"{former}:{cls.__qualname__}")
    return tuple(topics)


def topics_of(cls: type[Any]) -> tuple[str, ...]:
    """Every topic under which events of ``cls`` may be stored, today's first."""
    return (get_topic(cls), *former_topics(cls))


def register_former_topics() -> None:
    """Make the library resolve every former topic of a stored class to the class."""
    for module in EVENT_MODULES:
        for cls in stored_classes(module):
            for topic in former_topics(cls):
                register_topic(topic, cls)


register_former_topics()
