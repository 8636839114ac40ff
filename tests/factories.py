"""Builders of valid runners, requirements and schedule requests for tests.

The builders themselves ship with the package (:mod:`secondbox_scheduler.testing.builders`,
one copy for our tests and an embedder's); this module names them as our tests always
have, and adds what only our tests need: the topics written since a position.
"""

from __future__ import annotations

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.testing.builders import (
    CAPABILITIES,
    HEARTBEAT_TIMEOUT,
    RUNTIME,
    TOOLCHAIN,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
    token,
)
from secondbox_scheduler.testing.builders import profile as requirements

__all__ = [
    "CAPABILITIES",
    "HEARTBEAT_TIMEOUT",
    "REFUSAL_TOPICS",
    "RUNTIME",
    "TOOLCHAIN",
    "capacity",
    "create_sandbox",
    "materialization",
    "only_refusals_since",
    "register",
    "requirements",
    "schedule_request",
    "token",
    "topics_since",
]

REFUSAL_TOPICS = {"RefusalLog.Opened", "RefusalLog.Refused"}


def topics_since(app: SchedulerApplication, position: int) -> list[str]:
    """``Class.Event`` names of the events recorded after notification ``position``."""
    return [
        notification.topic.rsplit(":", 1)[1]
        for notification in app.recorder.select_notifications(
            start=position, limit=10_000, inclusive_of_start=False
        )
    ]


def only_refusals_since(app: SchedulerApplication, position: int) -> bool:
    """True when nothing but refusal evidence was recorded after ``position``."""
    return set(topics_since(app, position)) <= REFUSAL_TOPICS
