"""The scheduler's events, for an embedding application that follows them.

Every change the scheduler makes is one of these events, appended to the notification
log of the application's store (SQLite or PostgreSQL), each at a position that only
grows. docs/events.md documents every type: which command appends it, its attributes
and their shapes as stored, the invariants it serves; :func:`schema` gives one type's
attributes and their types from the class itself. Each class is exported under its
aggregate's name and its own (``SandboxAssignmentFenced`` is ``Sandbox.AssignmentFenced``
of docs/events.md); :data:`EVENT_TYPES` maps the documented names to the classes.

Follow the log with :func:`follow`::

    from secondbox_scheduler import SchedulerApplication
    from secondbox_scheduler.events import SandboxAssignmentFenced, follow

    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": "sqlite:///secondbox.db"})
    for item in follow(app, after=saved_position, wait=False):
        if isinstance(item.event, SandboxAssignmentFenced):
            ...  # apply item.event to your read model
        saved_position = item.position  # in the same transaction as what you applied

Each item is a :class:`FeedEvent`: its ``position`` (pass the last one you applied as
``after`` to resume exactly there), its ``type`` name, its ``stream_id`` and
``stream_version``, its ``subject`` (the sandbox, runner and pool it concerns) and the
domain ``event`` (its attributes as docs/events.md gives them, and ``actor``: who
asked). ``follow`` filters by ``types``, ``sandbox_id``, ``runner_id`` and
``pool_name``, waits for new events when it has caught up (until ``stop`` is set), or
ends there with ``wait=False``. :func:`read_feed` reads one page; :func:`event_json`
gives an event as the HTTP feed's JSON (``GET /v1/events``, docs/api.md).
docs/examples/assignment_host.py is a host that follows assignments into a read model
of its own, exactly once across restarts.
"""

from __future__ import annotations

import typing
from typing import Any

from secondbox_scheduler.domain.access_tokens import AccessTokens
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure.feed.reading import (
    FeedEvent,
    FeedFilter,
    FeedPage,
    event_types,
    follow,
    read_feed,
)
from secondbox_scheduler.infrastructure.feed.subjects import Subject
from secondbox_scheduler.infrastructure.feed.wire import event_json

RunnerRegistered = Runner.Registered
RunnerCapacityReserved = Runner.CapacityReserved
RunnerCapacityReleased = Runner.CapacityReleased
RunnerDrainStarted = Runner.DrainStarted
RunnerDrainCancelled = Runner.DrainCancelled
RunnerAllocatableChanged = Runner.AllocatableChanged
RunnerDeregistered = Runner.Deregistered
RunnerLeaseOpened = RunnerLease.Opened
RunnerLeaseLivenessRenewed = RunnerLease.LivenessRenewed
RunnerLeaseEvidenceRecorded = RunnerLease.EvidenceRecorded
SandboxCreated = Sandbox.Created
SandboxAssignmentFenced = Sandbox.AssignmentFenced
SandboxAssignmentRunning = Sandbox.AssignmentRunning
SandboxAssignmentReleased = Sandbox.AssignmentReleased
SandboxAssignmentFailed = Sandbox.AssignmentFailed
SandboxReconcileClaimed = Sandbox.ReconcileClaimed
SandboxReconcileClaimReleased = Sandbox.ReconcileClaimReleased
SandboxAssignmentUncertain = Sandbox.AssignmentUncertain
SandboxReconcileScheduled = Sandbox.ReconcileScheduled
SandboxGenerationAdvanced = Sandbox.GenerationAdvanced
RefusalLogOpened = RefusalLog.Opened
RefusalLogRefused = RefusalLog.Refused
FencingTokenUseUsed = FencingTokenUse.Used
AccessTokensOpened = AccessTokens.Opened
AccessTokensIssued = AccessTokens.Issued
AccessTokensRevoked = AccessTokens.Revoked

# The documented name of each event type (docs/events.md) -> its class.
EVENT_TYPES: dict[str, type[Any]] = event_types()
_LIBRARY = frozenset({"originator_id", "originator_version", "originator_topic"})


def schema(name: str) -> dict[str, str]:
    """The attributes of event type ``name`` (``Sandbox.AssignmentFenced``) and their
    types, as the class declares them: ``timestamp`` and ``actor`` first, then its own
    (docs/events.md says what each means). KeyError for a name that is no event type."""
    cls = EVENT_TYPES[name]
    found: dict[str, str] = {"timestamp": "datetime", "actor": "ActorRecord | None"}
    for klass in reversed(cls.__mro__):
        for attribute, annotation in vars(klass).get("__annotations__", {}).items():
            if attribute in _LIBRARY or attribute in found or attribute.startswith("_"):
                continue
            if typing.get_origin(annotation) is typing.ClassVar or "ClassVar" in str(annotation):
                continue
            found[attribute] = annotation if isinstance(annotation, str) else repr(annotation)
    return found


__all__ = [
    "EVENT_TYPES",
    "AccessTokens",
    "AccessTokensIssued",
    "AccessTokensOpened",
    "AccessTokensRevoked",
    "FeedEvent",
    "FeedFilter",
    "FeedPage",
    "FencingTokenUse",
    "FencingTokenUseUsed",
    "RefusalLog",
    "RefusalLogOpened",
    "RefusalLogRefused",
    "Runner",
    "RunnerAllocatableChanged",
    "RunnerCapacityReleased",
    "RunnerCapacityReserved",
    "RunnerDeregistered",
    "RunnerDrainCancelled",
    "RunnerDrainStarted",
    "RunnerLease",
    "RunnerLeaseEvidenceRecorded",
    "RunnerLeaseLivenessRenewed",
    "RunnerLeaseOpened",
    "RunnerRegistered",
    "Sandbox",
    "SandboxAssignmentFailed",
    "SandboxAssignmentFenced",
    "SandboxAssignmentReleased",
    "SandboxAssignmentRunning",
    "SandboxAssignmentUncertain",
    "SandboxCreated",
    "SandboxGenerationAdvanced",
    "SandboxReconcileClaimReleased",
    "SandboxReconcileClaimed",
    "SandboxReconcileScheduled",
    "Subject",
    "event_json",
    "follow",
    "read_feed",
    "schema",
]
