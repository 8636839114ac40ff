"""Who calls: the bearer token of a request, checked (docs/operations.md, "Access").

:func:`authenticate` reads the ``Authorization`` header of a request and gives the
:class:`Principal` of a valid token, or why there is none (the 401's message: never
the token itself). A valid token is well formed (``tokens.token_id_of``), of a known
id, matches that id's digest in constant time, and is neither revoked nor expired at
the scheduler's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from secondbox_scheduler.domain.access_tokens import AccessTokens, token_state
from secondbox_scheduler.domain.actors import KIND_TOKEN, ActorRecord
from secondbox_scheduler.infrastructure.access.tokens import MAX_TOKEN_LENGTH, matches, token_id_of

SCHEME = "bearer"
MAX_AUTHORIZATION_BYTES = len(SCHEME) + 1 + MAX_TOKEN_LENGTH


@dataclass(frozen=True)
class Principal:
    """The caller a valid token names."""

    token_id: str
    role: str
    runner_ids: frozenset[str]

    def actor(self) -> ActorRecord:
        """The actor its requests' events record (the id and role were checked when the
        token was issued: no check again on every request)."""
        return {"kind": KIND_TOKEN, "name": self.token_id, "role": self.role}


def authenticate(
    authorization: Sequence[bytes], tokens: AccessTokens, now: datetime
) -> Principal | str:
    """The principal of the one ``Authorization: Bearer`` header given, or the reason
    it is refused."""
    if not authorization:
        return "a bearer token is required (Authorization: Bearer <token>)"
    if len(authorization) > 1:
        return "give one Authorization header"
    value = authorization[0]
    if len(value) > MAX_AUTHORIZATION_BYTES:
        return "not a valid token"
    try:
        scheme, _, token = value.decode("ascii").partition(" ")
    except UnicodeDecodeError:
        return "not a valid token"
    if scheme.lower() != SCHEME:
        return "a bearer token is required (Authorization: Bearer <token>)"
    token = token.strip(" ")
    token_id = token_id_of(token)
    record = tokens.tokens.get(token_id) if token_id is not None else None
    if not matches(token, record) or record is None:
        return "not a valid token"
    state = token_state(record, now)
    if state != "active":
        return f"token {record['token_id']} is {state}"
    return Principal(record["token_id"], record["role"], frozenset(record["runner_ids"]))
