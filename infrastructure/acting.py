"""The actor of the commands a thread or task issues, and recording it on their events.

Who asks is known where the call enters: the HTTP service (the bearer token's id and
role, :mod:`.http.authentication`), the command line (``cli`` and the OS user), or an
embedding application, which names itself::

    from secondbox_scheduler import acting_as

    with acting_as("billing-control-plane"):
        app.create_sandbox(...)

or once for the whole application with the setting ``SECONDBOX_ACTOR``. The actor is
a context variable: it follows a thread, an asyncio task and what they hand to a thread
pool with the context (``starlette.concurrency.run_in_threadpool`` does). Every save
sets it on each new event that has none yet (:func:`stamp`, from
``StoredApplication._record``): one attribute per event, the same small dict for all of a
command's events. A batch of placements committed by one caller on behalf of others
(``placing/batcher.py``) sets each request's own actor on that request's events first.
"""

from __future__ import annotations

import getpass
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from secondbox_scheduler.domain.actors import Actor, ActorRecord
from secondbox_scheduler.domain.errors import InvalidRequestError

ACTOR_SETTING = "SECONDBOX_ACTOR"  # the embedding application's name (section 10)

_current: ContextVar[ActorRecord | None] = ContextVar("secondbox_actor", default=None)


@contextmanager
def acting_as(actor: Actor | str) -> Iterator[ActorRecord]:
    """Record ``actor`` (an :class:`Actor`, or an embedder's name) on the events of the
    commands issued inside the block (this thread or task, and what it hands on with its
    context). Nested blocks: the innermost wins."""
    if isinstance(actor, str):
        actor = Actor.library(actor)
    with acting_as_record(actor.to_record()) as record:
        yield record


@contextmanager
def acting_as_record(record: ActorRecord) -> Iterator[ActorRecord]:
    """:func:`acting_as` for an actor already in its stored form."""
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


def set_actor(actor: Actor) -> None:
    """Make ``actor`` the actor of this context from now on (the command line: once,
    for the whole process)."""
    _current.set(actor.to_record())


def command_line_actor() -> Actor:
    """``cli`` and the operating-system user running the command (``getpass.getuser``:
    ``LOGNAME``, ``USER``, ``LNAME``, ``USERNAME``, then the password database); no name
    when none of them gives one."""
    try:
        user: str | None = getpass.getuser()
    except (OSError, KeyError):  # no variable and no entry for the uid
        user = None
    return Actor.cli(user)


def current_actor() -> ActorRecord | None:
    """The actor of this context (None: none was set)."""
    return _current.get()


def actor_setting(name: str | None) -> ActorRecord:
    """The actor of an embedding application's commands when their context sets none:
    ``SECONDBOX_ACTOR``'s name, or a library without a name. A name that is not an
    acceptable name (docs/spec.md, section 9) is ``InvalidRequestError`` naming the
    setting."""
    try:
        return Actor.library(name or None).to_record()
    except InvalidRequestError as error:
        raise InvalidRequestError(ACTOR_SETTING, error.rule, name) from None


def stamp(events: Iterable[Any], actor: ActorRecord | None) -> None:
    """Set ``actor`` on each of ``events`` that records an actor and has none yet (an
    event that already has one keeps it: a batch set its request's own)."""
    if actor is None:
        return
    setattr_ = object.__setattr__  # the events are frozen dataclasses, not yet stored
    for event in events:
        if "actor" in event.__dict__ and event.__dict__["actor"] is None:
            setattr_(event, "actor", actor)
