"""An event of the feed as JSON: what ``GET /v1/events`` and ``secondbox-scheduler
events --json`` answer, one object per event::

    {"position": 7, "type": "Sandbox.AssignmentFenced",
     "stream_id": "806b5b66-...", "stream_version": 2,
     "timestamp": "2026-12-03T08:40:01.123456+00:00",
     "actor": {"kind": "token", "name": "3f9a1c0b2d4e", "role": "control-plane"},
     "sandbox_id": "sbx-1", "runner_id": "runner-1", "pool_name": "pool-a",
     "data": {"assignment": {...}, "placement": {...}, "token_indexed": true}}

``data`` holds the event's other attributes as docs/events.md documents them (times
in ISO 8601, sets as sorted lists), except what the feed never shows:
``AccessTokens.Issued.token_sha256`` (a token's digest is for the service that checks
tokens, not for every reader). ``actor`` is null for an event recorded before actors
existed; ``sandbox_id``, ``runner_id`` and ``pool_name`` are null when the event
concerns none (:mod:`.subjects`). An event of a type this release does not know has
its stored JSON as ``data`` and null subjects.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from secondbox_scheduler.infrastructure.feed.reading import FeedEvent
from secondbox_scheduler.infrastructure.read_model_verify import plain

# (event type, attribute): never shown by the feed
HIDDEN = frozenset({("AccessTokens.Issued", "token_sha256")})
_ENVELOPE = frozenset(
    {"originator_id", "originator_version", "timestamp", "actor", "originator_topic"}
)


def event_json(item: FeedEvent) -> dict[str, Any]:
    """``item`` as the feed's JSON object (see the module's docstring)."""
    if item.event is None:
        state = dict(item.state or {})
        timestamp = state.pop("timestamp", None)
        actor = state.pop("actor", None)
        data = {k: v for k, v in state.items() if k not in _ENVELOPE}
    else:
        attributes = vars(item.event)
        timestamp = attributes.get("timestamp")
        actor = attributes.get("actor")
        data = {
            name: plain(value)
            for name, value in attributes.items()
            if name not in _ENVELOPE and (item.type, name) not in HIDDEN
        }
    if isinstance(timestamp, datetime):
        timestamp = timestamp.isoformat()
    elif isinstance(timestamp, dict):  # a stored {"_type_": "datetime_iso", "_data_": ...}
        timestamp = timestamp.get("_data_")
    return {
        "position": item.position,
        "type": item.type,
        "stream_id": str(item.stream_id),
        "stream_version": item.stream_version,
        "timestamp": timestamp,
        "actor": plain(actor) if isinstance(actor, dict) else None,
        "sandbox_id": item.subject.sandbox_id,
        "runner_id": item.subject.runner_id,
        "pool_name": item.subject.pool_name,
        "data": data,
    }
