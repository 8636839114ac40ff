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

from eventsourcing.domain import Aggregate

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
        digest = token_sha256(token_hex)
        return cls._create(
            cls.Used,
            id=fencing_token_uuid(sandbox_id, digest),
            timestamp=at,
            sandbox_id=sandbox_id,
            generation=generation,
            token_sha256=digest,
        )
