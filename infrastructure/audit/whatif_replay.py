"""What-if replay as a Python API: read a store's log, replay it under changes, report.

:func:`whatif` reads the notification log as ``audit verify`` does
(``projections.notification_reader.read_pages`` with read-ahead, decoded by
``projections.event_decoder.EventDecoder``, the garbage collector paused) and feeds
every event to the pure engine :class:`domain.whatif.engine.WhatIf`. Nothing is written to the
store. :func:`load_changes` reads changes from a JSON or YAML file, and
:func:`resolve_policy` finds a ranking policy by name, built in (``seed``,
``binpack``, ``spread``) or a user's own (``package.module:attribute``).

Example::

    from secondbox_scheduler.domain.whatif.changes import WhatIfChanges
    from secondbox_scheduler.infrastructure.audit.whatif_replay import whatif

    result = whatif(app, WhatIfChanges.from_record({"policy": "binpack"}))
    print(result.report.reproduced, result.report.changed)
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventsourcing.utils import TopicError, resolve_topic

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.placement.ranking import POLICIES, RankingPolicy
from secondbox_scheduler.domain.whatif.changes import WhatIfChanges
from secondbox_scheduler.domain.whatif.engine import WhatIf
from secondbox_scheduler.domain.whatif.report import WhatIfReport
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import gc_paused, read_pages

PAGE = 1000  # progress is reported every PAGE events
READ_PAGE = 5000  # notifications per query (the next page is read ahead)


@dataclass
class WhatIfResult:
    """A what-if replay's report and how fast the log was replayed."""

    report: WhatIfReport
    seconds: float

    @property
    def events_per_second(self) -> float:
        return self.report.events / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.report.to_dict(),
            "seconds": round(self.seconds, 3),
            "events_per_second": round(self.events_per_second, 1),
        }


def whatif(
    app: SchedulerApplication,
    changes: WhatIfChanges | None = None,
    progress: Callable[[int], None] = lambda _: None,
) -> WhatIfResult:
    """Replay the store's history under ``changes`` (none: identity) and report."""
    engine = WhatIf(changes)
    until = engine.changes.window.until
    decode = EventDecoder(app.mapper)
    undecoded = engine.undecoded()
    classes: dict[str, type[Any] | None] = {}
    started = time.perf_counter()
    with gc_paused():
        pages = read_pages(
            app.recorder,
            until=until if isinstance(until, int) else None,
            page_size=READ_PAGE,
            first_page_size=PAGE,
            read_ahead=True,
        )
        for page in pages:
            for notification in page:
                topic = notification.topic
                cls = classes[topic] if topic in classes else _class_of(topic, classes)
                if cls in undecoded:
                    engine.lifecycle(notification.id, notification.originator_id)
                else:
                    engine.apply(notification.id, decode(notification))
                if engine.done:
                    break
            progress(len(page))
            if engine.done:
                pages.close()
                break
        report = engine.report()
    return WhatIfResult(report, time.perf_counter() - started)


def _yaml(path: Path, text: str) -> Any:
    try:
        import yaml
    except ImportError:  # the yaml extra is not installed
        raise InvalidRequestError(
            "changes",
            f"{path}: reading YAML needs PyYAML (pip install 'secondbox-scheduler[yaml]'); "
            "or give the changes as a .json file",
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InvalidRequestError("changes", f"{path} is not valid YAML: {error}") from None


def _class_of(topic: str, known: dict[str, type[Any] | None]) -> type[Any] | None:
    """The event class of a topic (None when it does not resolve: the decoder then
    raises the mapper's own error)."""
    try:
        found: type[Any] | None = resolve_topic(topic)
    except TopicError:
        found = None
    known[topic] = found
    return found


def resolve_policy(name: str) -> RankingPolicy:
    """A ranking policy by name: built in, or ``package.module:attribute`` (a policy
    object, or a class that takes no arguments)."""
    if name in POLICIES:
        return POLICIES[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise InvalidRequestError(
            "policy", f"use one of {sorted(POLICIES)} or package.module:attribute", name
        )
    try:
        found: Any = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise InvalidRequestError("policy", f"cannot load {name!r}: {error}", name) from None
    if isinstance(found, type):
        found = found()
    if not isinstance(found, RankingPolicy):
        raise InvalidRequestError("policy", "needs `name` and `key(requirements, runner)`", name)
    return found


def changes_from(data: Mapping[str, Any]) -> WhatIfChanges:
    """Changes from their JSON/YAML shape (docs/audit.md); a policy named
    ``package.module:attribute`` is loaded."""
    fields = dict(data)
    policy = fields.get("policy")
    if isinstance(policy, str):
        fields["policy"] = resolve_policy(policy)
    return WhatIfChanges.from_record(fields)


def load_changes(path: Path) -> dict[str, Any]:
    """The changes in a JSON or YAML file (a mapping), not yet validated. A ``.json``
    file is read as JSON; any other as YAML (which JSON is too), with PyYAML (the
    ``yaml`` extra: ``pip install 'secondbox-scheduler[yaml]'``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidRequestError("changes", f"cannot read {path}: {error.strerror}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise InvalidRequestError("changes", f"{path} is not valid JSON: {error}") from None
    else:
        data = _yaml(path, text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidRequestError("changes", f"{path} must hold a mapping of changes")
    return data
