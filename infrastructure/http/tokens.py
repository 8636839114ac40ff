"""``/v1/tokens``: issue, list and revoke access tokens (admin tokens only).

The same operations as ``secondbox-scheduler tokens``; a token is shown once, in the
answer that issued it. Revoking is seen by every replica within the token refresh
interval (:mod:`..access.cache`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field
from starlette.responses import Response

from secondbox_scheduler.domain.access_tokens import ROLES
from secondbox_scheduler.domain.limits import MAX_ITEMS
from secondbox_scheduler.infrastructure.access.tokens import issue_token, list_tokens, revoke_token
from secondbox_scheduler.infrastructure.http.common import Scheduler, respond, tokens_application
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES
from secondbox_scheduler.infrastructure.http.models import ActorOut, Body, PathName, Time

router = APIRouter(prefix="/v1/tokens", tags=["access"], responses=ERROR_RESPONSES)

Role = Literal["runner", "control-plane", "auditor", "admin"]
assert set(Role.__args__) == set(ROLES)  # type: ignore[attr-defined]
TokenId = Annotated[
    str,
    Path(pattern=r"^[0-9a-f]{12}$", description="The token's id.", examples=["3f9a1c0b2d4e"]),
]


class TokenRequest(Body):
    role: Role
    runner_ids: list[PathName] = Field(
        default_factory=list,
        max_length=MAX_ITEMS,
        description="A runner token's runners (1 to 64); none for the other roles.",
    )
    expires_at: Time | None = Field(default=None, description="None: until revoked.")


class IssuedTokenOut(BaseModel):
    id: str
    role: str
    runner_ids: list[str]
    expires_at: datetime | None
    token: str = Field(description="The token itself: shown this once, never stored.")


class TokenOut(BaseModel):
    id: str
    role: str
    runner_ids: list[str]
    issued_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    state: Literal["active", "expired", "revoked"]
    issued_by: ActorOut | None = Field(default=None, description="Who issued it.")
    revoked_by: ActorOut | None = Field(default=None, description="Who revoked it.")


class TokenList(BaseModel):
    tokens: list[TokenOut]


class TokenRevoked(BaseModel):
    id: str
    revoked: bool = Field(description="False: it was revoked already.")


@router.post("", status_code=201, response_model=IssuedTokenOut, summary="Issue a token")
def create_token(body: TokenRequest, app: Scheduler) -> Response:
    """A new token of the role (a runner token for its runner ids); the token is in this
    answer only. Once any token exists, every route but the health probes needs one."""
    issued = issue_token(
        tokens_application(app),
        role=body.role,
        runner_ids=list(body.runner_ids),
        expires_at=body.expires_at,
    )
    return respond(IssuedTokenOut.model_validate(issued.to_dict()), 201)


@router.get("", response_model=TokenList, summary="Every token")
def get_tokens(app: Scheduler) -> Response:
    """Every token ever issued, oldest first, with its state (never a token or digest)."""
    tokens = [TokenOut.model_validate(t.to_dict()) for t in list_tokens(tokens_application(app))]
    return respond(TokenList(tokens=tokens))


@router.delete("/{token_id}", response_model=TokenRevoked, summary="Revoke a token")
def delete_token(token_id: TokenId, app: Scheduler) -> Response:
    """Refused from now on by every replica (within the refresh interval); an unknown id
    is 404 ``access_token_not_found``."""
    return respond(
        TokenRevoked(id=token_id, revoked=revoke_token(tokens_application(app), token_id))
    )
