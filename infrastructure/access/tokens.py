"""Making, issuing, listing and revoking access tokens (docs/operations.md, "Access").

A token is ``sbt_<id>_<secret>``: ``id`` is 12 hexadecimal digits (48 random bits),
the token's public name (in ``tokens list``, in each event's actor, in the service's
logs); ``secret`` is 32 random bytes in URL-safe base64 (43 characters). The store
keeps the SHA-256 of the whole token, never the token: :func:`issue_token` returns it
once. Checking a presented token (:func:`token_id_of`, :func:`matches`) reads its id,
finds that record, and compares the SHA-256 digests with :func:`hmac.compare_digest`
(constant time); a token of an unknown id is compared with a digest that matches
nothing, so that both take the same steps.

The tokens are events of one stream (``domain/access_tokens.py``): every replica reads
them from the store, the chain covers them, and each records the actor who issued or
revoked it. On PostgreSQL they are written, like every event, through the schema
owner's save functions: the request-serving role issues them too (``POST /v1/tokens``,
an admin token); docs/spec.md (section 8.1) says what that role can do.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.access_tokens import (
    AccessTokenRecord,
    AccessTokens,
    token_state,
)
from secondbox_scheduler.domain.actors import ActorRecord, actor_of
from secondbox_scheduler.domain.errors import SerializationContentionError
from secondbox_scheduler.domain.ids import access_tokens_uuid
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication

PREFIX = "sbt"
MAX_TOKEN_LENGTH = 128  # longer Authorization values are refused before any work
_TOKEN = re.compile(r"sbt_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_NOTHING = bytes(32)  # the digest an unknown id is compared with (no token hashes to it)
ISSUE_ATTEMPTS = 8  # another issue or revocation committed first: read again and retry


@dataclass(frozen=True)
class IssuedToken:
    """A token just issued: the only time the token itself is known."""

    token_id: str
    role: str
    runner_ids: list[str]
    expires_at: datetime | None
    token: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.token_id,
            "role": self.role,
            "runner_ids": self.runner_ids,
            "expires_at": None if self.expires_at is None else self.expires_at.isoformat(),
            "token": self.token,
        }


@dataclass(frozen=True)
class TokenInfo:
    """A token as ``tokens list`` shows it (never its digest)."""

    token_id: str
    role: str
    runner_ids: list[str]
    issued_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    state: str
    issued_by: ActorRecord | None = None  # the actor of its issue (None: unknown)
    revoked_by: ActorRecord | None = None

    @classmethod
    def of(
        cls, record: AccessTokenRecord, now: datetime, actors: dict[tuple[str, str], Any]
    ) -> TokenInfo:
        token_id = record["token_id"]
        return cls(
            token_id,
            record["role"],
            list(record["runner_ids"]),
            record["issued_at"],
            record["expires_at"],
            record["revoked_at"],
            token_state(record, now),
            actors.get(("Issued", token_id)),
            actors.get(("Revoked", token_id)),
        )

    def to_dict(self) -> dict[str, Any]:
        def iso(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        return {
            "id": self.token_id,
            "role": self.role,
            "runner_ids": self.runner_ids,
            "issued_at": self.issued_at.isoformat(),
            "expires_at": iso(self.expires_at),
            "revoked_at": iso(self.revoked_at),
            "state": self.state,
            "issued_by": self.issued_by,
            "revoked_by": self.revoked_by,
        }


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def token_id_of(token: str) -> str | None:
    """The id of a well-formed token, else None (nothing else is looked at)."""
    if len(token) > MAX_TOKEN_LENGTH:
        return None
    found = _TOKEN.fullmatch(token)
    return found.group(1) if found else None


def matches(token: str, record: AccessTokenRecord | None) -> bool:
    """Whether ``token`` is the one ``record`` was issued for (constant time)."""
    expected = bytes.fromhex(record["token_sha256"]) if record is not None else _NOTHING
    return hmac.compare_digest(token_digest(token), expected) and record is not None


def new_token(taken: set[str] | dict[str, Any]) -> tuple[str, str]:
    """A fresh (id, token), the id not among ``taken``."""
    while True:
        token_id = secrets.token_hex(6)
        if token_id not in taken:
            return token_id, f"{PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"


def load_tokens(app: StoredApplication) -> AccessTokens | None:
    """The access tokens as stored now (None: none was ever issued)."""
    return app.load(access_tokens_uuid(), AccessTokens)


def issue_token(
    app: Any,
    *,
    role: str,
    runner_ids: list[str] | tuple[str, ...] = (),
    expires_at: datetime | None = None,
) -> IssuedToken:
    """Issue a token of ``role`` (``runner``: for ``runner_ids``), valid until
    ``expires_at`` (None: until revoked). ``InvalidRequestError`` names a bad field."""
    for _ in range(ISSUE_ATTEMPTS):
        now = app.now()
        tokens = load_tokens(app) or AccessTokens.open(now)
        token_id, token = new_token(tokens.tokens)
        tokens.issue(
            token_id=token_id,
            role=role,
            runner_ids=runner_ids,
            token_sha256=hashlib.sha256(token.encode()).hexdigest(),
            expires_at=expires_at,
            at=now,
        )
        try:
            app.save(tokens)
        except IntegrityError:
            continue  # another issue or revocation first: read again
        record = tokens.tokens[token_id]
        return IssuedToken(token_id, role, record["runner_ids"], record["expires_at"], token)
    raise SerializationContentionError(ISSUE_ATTEMPTS, "access tokens")


def revoke_token(app: Any, token_id: str) -> bool:
    """Revoke a token (``AccessTokenNotFoundError`` for an unknown id); False when it
    was revoked already."""
    for _ in range(ISSUE_ATTEMPTS):
        now = app.now()
        tokens = load_tokens(app) or AccessTokens.open(now)
        if not tokens.revoke(token_id, now):
            return False
        try:
            app.save(tokens)
            return True
        except IntegrityError:
            continue
    raise SerializationContentionError(ISSUE_ATTEMPTS, "access tokens")


def list_tokens(app: Any) -> list[TokenInfo]:
    """Every token ever issued, oldest first, with its state now and who issued and
    revoked it (the actors of those events)."""
    tokens = load_tokens(app)
    if tokens is None:
        return []
    now = app.now()
    actors = {
        (type(event).__name__, event.token_id): actor_of(event)
        for event in app.events.get(access_tokens_uuid())
        if isinstance(event, (AccessTokens.Issued, AccessTokens.Revoked))
    }
    records = sorted(tokens.tokens.values(), key=lambda r: (r["issued_at"], r["token_id"]))
    return [TokenInfo.of(record, now, actors) for record in records]
