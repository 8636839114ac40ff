"""Who asked: the actor that every stored event records (docs/events.md, "The actor").

Each command's events carry the actor of the call that caused them, a small record:

- ``{"kind": "token", "name": TOKEN_ID, "role": ROLE}``: an HTTP caller with a bearer
  token of that id and role (``secondbox-scheduler tokens``);
- ``{"kind": "anonymous", "name": ADDRESS}``: an HTTP caller on a service with no
  token yet (loopback, or ``serve --insecure``), by its client address;
- ``{"kind": "library", "name": NAME}``: an embedding application, by the name it
  passes (``acting_as``, ``SECONDBOX_ACTOR``; ``None`` when it passes none);
- ``{"kind": "cli", "name": USER}``: the command line, by the operating-system user.

Events written before the actor existed read as ``None``, actor unknown: every event
class is at a new class version whose upcast sets it (:class:`ActedEvent`).

The domain never decides on the actor and never reads it: the infrastructure records
it on the events after the aggregates decided (``infrastructure/acting.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.limits import MAX_NAME_LENGTH
from secondbox_scheduler.domain.values import require_text

KIND_TOKEN = "token"
KIND_ANONYMOUS = "anonymous"
KIND_LIBRARY = "library"
KIND_CLI = "cli"
KINDS = (KIND_TOKEN, KIND_ANONYMOUS, KIND_LIBRARY, KIND_CLI)
UNKNOWN = "unknown"  # how an event without an actor (written before 0.3) is shown
ACTOR_VERSION = 2  # the class version at which every event class records its actor


class ActorRecord(TypedDict):
    """An actor as events store it (JSON: strings and null only)."""

    kind: str
    name: str | None
    role: NotRequired[str]


@dataclass(frozen=True, slots=True)
class Actor:
    """Who asked for a command: what an event's ``actor`` record says, as a value."""

    kind: str
    name: str | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError("actor.kind", f"must be one of {', '.join(KINDS)}")
        if self.name is not None:
            require_text("actor.name", self.name)
        if (self.role is None) != (self.kind != KIND_TOKEN):
            raise InvalidRequestError("actor.role", "a token's actor has a role, no other has")
        if self.role is not None:
            require_text("actor.role", self.role)

    @classmethod
    def token(cls, token_id: str, role: str) -> Actor:
        return cls(KIND_TOKEN, token_id, role)

    @classmethod
    def anonymous(cls, address: str | None) -> Actor:
        return cls(KIND_ANONYMOUS, _bounded(address))

    @classmethod
    def library(cls, name: str | None = None) -> Actor:
        return cls(KIND_LIBRARY, name)

    @classmethod
    def cli(cls, user: str | None) -> Actor:
        return cls(KIND_CLI, _bounded(user))

    def to_record(self) -> ActorRecord:
        record: ActorRecord = {"kind": self.kind, "name": self.name}
        if self.role is not None:
            record["role"] = self.role
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> Actor | None:
        """The actor of a stored record (None: unknown). Read back without the input
        checks: a history is never refused for what it recorded."""
        if not record:
            return None
        actor = object.__new__(cls)
        for name, value in (
            ("kind", str(record.get("kind", UNKNOWN))),
            ("name", record.get("name")),
            ("role", record.get("role")),
        ):
            object.__setattr__(actor, name, value)
        return actor

    def describe(self) -> str:
        """One line for people: ``token 3f9a1c0b2d4e (control-plane)``, ``cli root``."""
        words = [self.kind]
        if self.name is not None:
            words.append(self.name)
        if self.role is not None:
            words.append(f"({self.role})")
        return " ".join(words)


def describe_actor(record: Mapping[str, Any] | None) -> str:
    """An event's actor for people; ``unknown`` for an event recorded before 0.3."""
    actor = Actor.from_record(record)
    return UNKNOWN if actor is None else actor.describe()


def actor_of(event: Any) -> ActorRecord | None:
    """The actor an event recorded (None: unknown, or an event of another class)."""
    record: ActorRecord | None = getattr(event, "actor", None)
    return record


def _bounded(text: str | None) -> str | None:
    """A name from the environment (an OS user, a client address), kept only if it is
    an acceptable name (docs/spec.md, section 9), else None."""
    if not text or len(text) > MAX_NAME_LENGTH:
        return None
    try:
        return require_text("actor.name", text)
    except InvalidRequestError:
        return None


def actor_unknown(state: dict[str, Any]) -> None:
    """The upcast of a state written before the actor: unknown."""
    state["actor"] = None


class ActedEvent(Aggregate.Event):
    """The base of every aggregate's events: the actor of the command that caused it.

    ``actor`` is keyword-only with a default, so that the aggregates trigger their
    events without it; the infrastructure sets it on the new events before they are
    saved. Version 2 of every event class (``ACTOR_VERSION``); a state of version 1
    (written before 0.3) reads as actor unknown. A class at a later version of its own
    (``Sandbox.AssignmentFenced``) declares its own upcast to it."""

    actor: ActorRecord | None = dataclasses.field(default=None, kw_only=True)

    class_version = ACTOR_VERSION
    upcast_v1_v2 = staticmethod(actor_unknown)
