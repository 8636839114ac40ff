"""The service's access tokens: who may call the HTTP service, in which role.

One stream (``access-tokens``) holds every token ever issued, so that every replica
reads the same tokens from the store, and each issue and revocation is in the
chain-covered log with the actor who asked for it. A token is stored by its SHA-256
only: the token itself is shown once, to whoever issued it
(``infrastructure/access/tokens.py`` makes it). A token has one role:

- ``runner``: a runner agent, for the runner ids the token names only (register, heartbeat,
  and its reports on the assignments placed on those runners);
- ``control-plane``: sandbox and runner commands, and every read;
- ``auditor``: reads and audit only;
- ``admin``: tokens, drains and deregistration, and every read.

Which role may call which route is the HTTP service's table
(``infrastructure/http/access.py``). A revoked token stays in the stream (its id is never
reused); revoking it again changes nothing. Once any token was issued, the service asks
every caller for one, even when all are revoked or expired.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, TypedDict

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.actors import ActedEvent
from secondbox_scheduler.domain.errors import AccessTokenNotFoundError, InvalidRequestError
from secondbox_scheduler.domain.ids import access_tokens_uuid
from secondbox_scheduler.domain.limits import MAX_ITEMS
from secondbox_scheduler.domain.values import require_aware, require_text

ROLE_RUNNER = "runner"
ROLE_CONTROL_PLANE = "control-plane"
ROLE_AUDITOR = "auditor"
ROLE_ADMIN = "admin"
ROLES = (ROLE_RUNNER, ROLE_CONTROL_PLANE, ROLE_AUDITOR, ROLE_ADMIN)
MAX_TOKEN_LIFETIME = timedelta(days=3660)  # about ten years
TOKEN_ID_PATTERN = re.compile(r"[0-9a-f]{12}")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")


class AccessTokenRecord(TypedDict):
    """One token as the stream keeps it (the token itself never: its SHA-256)."""

    token_id: str
    role: str
    runner_ids: list[str]
    token_sha256: str
    issued_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


def token_state(record: AccessTokenRecord, now: datetime) -> str:
    """``active``, ``expired`` or ``revoked`` at ``now``."""
    if record["revoked_at"] is not None:
        return "revoked"
    expires = record["expires_at"]
    return "expired" if expires is not None and expires <= now else "active"


class AccessTokens(Aggregate):
    """Every access token of the service (one stream, ``access_tokens_uuid()``)."""

    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class Opened(Aggregate.Created):
        pass

    def __init__(self) -> None:
        self.tokens: dict[str, AccessTokenRecord] = {}

    @classmethod
    def open(cls, at: datetime) -> AccessTokens:
        return cls._create(cls.Opened, id=access_tokens_uuid(), timestamp=at)

    class Issued(Aggregate.Event):
        token_id: str
        role: str
        runner_ids: list[str]
        token_sha256: str
        expires_at: datetime | None

        def apply(self, tokens: AccessTokens) -> None:
            tokens.tokens[self.token_id] = {
                "token_id": self.token_id,
                "role": self.role,
                "runner_ids": list(self.runner_ids),
                "token_sha256": self.token_sha256,
                "issued_at": self.timestamp,
                "expires_at": self.expires_at,
                "revoked_at": None,
            }

    class Revoked(Aggregate.Event):
        token_id: str

        def apply(self, tokens: AccessTokens) -> None:
            # a new record, never a change in place (a copy of the aggregate shares them)
            tokens.tokens[self.token_id] = {
                **tokens.tokens[self.token_id],
                "revoked_at": self.timestamp,
            }

    def issue(
        self,
        *,
        token_id: str,
        role: str,
        runner_ids: Sequence[str],
        token_sha256: str,
        expires_at: datetime | None,
        at: datetime,
    ) -> None:
        """Record a new token. A ``runner`` token names 1 to 64 runner ids, no other
        role names any; ``expires_at`` (if any) lies after ``at``, within ten years."""
        if not TOKEN_ID_PATTERN.fullmatch(token_id):
            raise InvalidRequestError("token_id", "must be 12 lowercase hexadecimal digits")
        if token_id in self.tokens:
            raise InvalidRequestError("token_id", "must not be the id of an earlier token")
        if role not in ROLES:
            raise InvalidRequestError("role", f"must be one of {', '.join(ROLES)}", role)
        runners = sorted({require_text("runner_ids", runner) for runner in runner_ids})
        if role == ROLE_RUNNER and not runners:
            raise InvalidRequestError("runner_ids", "a runner token names at least one runner")
        if role != ROLE_RUNNER and runners:
            raise InvalidRequestError("runner_ids", "only a runner token names runners")
        if len(runners) > MAX_ITEMS:
            raise InvalidRequestError("runner_ids", f"must hold at most {MAX_ITEMS} items")
        if not SHA256_PATTERN.fullmatch(token_sha256):
            raise InvalidRequestError("token_sha256", "must be 64 lowercase hexadecimal digits")
        if expires_at is not None:
            expires_at = require_aware("expires_at", expires_at)
            if expires_at <= at:
                raise InvalidRequestError("expires_at", "must lie in the future")
            if expires_at - at > MAX_TOKEN_LIFETIME:
                raise InvalidRequestError("expires_at", "must lie within ten years")
        self.trigger_event(
            self.Issued,
            timestamp=at,
            token_id=token_id,
            role=role,
            runner_ids=runners,
            token_sha256=token_sha256,
            expires_at=expires_at,
        )

    def revoke(self, token_id: str, at: datetime) -> bool:
        """Revoke a token from now on; False when it was revoked already."""
        record = self.tokens.get(token_id)
        if record is None:
            raise AccessTokenNotFoundError(token_id)
        if record["revoked_at"] is not None:
            return False
        self.trigger_event(self.Revoked, timestamp=at, token_id=token_id)
        return True


# Every event class of the access tokens: what a consumer of the log that keeps no
# access state (the audit fold, the what-if replay, the read models) passes over.
ACCESS_TOKEN_EVENTS: tuple[type[Any], ...] = (
    AccessTokens.Opened,
    AccessTokens.Issued,
    AccessTokens.Revoked,
)
