"""The fencing-token index: one stream per (sandbox, token) ever fenced.

Invariant 3 says that a generation's fencing token never repeats for the same sandbox.
The Sandbox keeps only its current generation's assignment, so that its state (and its
snapshots) stay the same size however many generations it had; it cannot remember
every earlier token itself. Instead each fence creates a ``FencingTokenUse`` whose
stream id is derived from the sandbox id and the token's SHA-256, saved in the same
transaction as the fence. A reused token collides with the existing stream: the event
store's uniqueness on (stream, version), the guard that also makes ids unique, refuses
the whole save, so no second assignment can be written with an earlier token. The
stream stores the digest, never the token.

Histories of release 0.1 fenced without this index; their tokens are kept by the
Sandbox itself (``Sandbox.legacy_tokens``, bounded by that history).
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from eventsourcing.domain import Aggregate
from eventsourcing.utils import get_topic

from secondbox_scheduler.domain.actors import ActedEvent
from secondbox_scheduler.domain.ids import fencing_token_uuid


def token_sha256(token_hex: str) -> str:
    """The digest that names a token's use (the token is stored as hex in events)."""
    return hashlib.sha256(bytes.fromhex(token_hex)).hexdigest()


class FencingTokenUse(Aggregate):
    """One sandbox's use of one fencing token, in the generation that used it."""

    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class Used(Aggregate.Created):
        sandbox_id: str
        generation: int
        token_sha256: str

    def __init__(self, sandbox_id: str, generation: int, token_sha256: str) -> None:
        self.sandbox_id = sandbox_id
        self.generation = generation
        self.token_sha256 = token_sha256

    @classmethod
    def use(
        cls, *, sandbox_id: str, generation: int, token_hex: str, at: datetime
    ) -> FencingTokenUse:
        """The new stream of the token's use, its ``Used`` event pending: what
        ``cls._create(cls.Used, id=..., timestamp=at, ...)`` builds (the same event, the
        same aggregate, attribute for attribute), without its generic work (the id's
        and the initialisers' parameters found by name, the topic resolved back to the
        class): half the time, once per placement. ``tests/test_placement_shortcuts.py``
        compares both."""
        if cls is not FencingTokenUse:  # a subclass: the library's way
            digest = token_sha256(token_hex)
            return cls._create(
                cls.Used,
                id=fencing_token_uuid(sandbox_id, digest),
                timestamp=at,
                sandbox_id=sandbox_id,
                generation=generation,
                token_sha256=digest,
            )
        digest = token_sha256(token_hex)
        stream = fencing_token_uuid(sandbox_id, digest)
        event_class: Any = cls.Used  # a dataclass the library makes (unseen by mypy)
        used = event_class(  # as _create constructs it
            originator_id=stream,
            originator_version=cls.INITIAL_VERSION,
            timestamp=at,
            originator_topic=_TOPIC,
            sandbox_id=sandbox_id,
            generation=generation,
            token_sha256=digest,
        )
        # as Used.mutate(None) builds the aggregate: the base initialiser, the class's
        # own, the event's apply; then the event pending, as _create leaves it
        use = object.__new__(cls)
        use.__base_init__(stream, used.originator_version, used.timestamp)
        use.__init__(sandbox_id, generation, digest)  # type: ignore[misc]
        used.apply(use)
        use.pending_events.append(used)
        return use


_TOPIC = get_topic(FencingTokenUse)
