"""The access tokens' stream and their check (domain/access_tokens.py,
infrastructure/access/): what an issue refuses, revocation, and the check of a
presented token."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from secondbox_scheduler.domain.access_tokens import AccessTokens, token_state
from secondbox_scheduler.domain.errors import AccessTokenNotFoundError, InvalidRequestError
from secondbox_scheduler.infrastructure.access.principal import Principal, authenticate
from secondbox_scheduler.infrastructure.access.tokens import new_token, token_digest, token_id_of

T0 = datetime(2026, 11, 29, 12, tzinfo=UTC)


def issued(role: str = "auditor", **overrides: object) -> tuple[AccessTokens, str]:
    tokens = AccessTokens.open(T0)
    token_id, token = new_token(tokens.tokens)
    fields: dict[str, object] = {
        "token_id": token_id,
        "role": role,
        "runner_ids": ["r1"] if role == "runner" else [],
        "token_sha256": token_digest(token).hex(),
        "expires_at": None,
        "at": T0,
    }
    fields.update(overrides)
    tokens.issue(**fields)  # type: ignore[arg-type]
    return tokens, token


@pytest.mark.parametrize(
    ("role", "overrides", "field"),
    [
        ("owner", {}, "role"),
        ("runner", {"runner_ids": []}, "runner_ids"),
        ("auditor", {"runner_ids": ["r1"]}, "runner_ids"),
        ("runner", {"runner_ids": [f"r{n}" for n in range(65)]}, "runner_ids"),
        ("runner", {"runner_ids": ["r\x00"]}, "runner_ids"),
        ("auditor", {"expires_at": T0}, "expires_at"),
        ("auditor", {"expires_at": T0 + timedelta(days=4000)}, "expires_at"),
        ("auditor", {"expires_at": datetime(2027, 1, 1)}, "expires_at"),  # naive
        ("auditor", {"token_id": "XYZ"}, "token_id"),
        ("auditor", {"token_sha256": "00"}, "token_sha256"),
    ],
)
def test_an_issue_is_refused_naming_the_field(
    role: str, overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        issued(role, **overrides)
    assert refused.value.field == field


def test_an_id_is_never_issued_twice_and_a_revocation_once() -> None:
    tokens, token = issued()
    (token_id,) = tokens.tokens
    with pytest.raises(InvalidRequestError):
        tokens.issue(
            token_id=token_id, role="admin", runner_ids=[], token_sha256="0" * 64,
            expires_at=None, at=T0,
        )  # fmt: skip
    assert tokens.revoke(token_id, T0 + timedelta(seconds=1))
    assert not tokens.revoke(token_id, T0 + timedelta(seconds=2))
    assert token_state(tokens.tokens[token_id], T0) == "revoked"
    with pytest.raises(AccessTokenNotFoundError):
        tokens.revoke("0123456789ab", T0)
    assert token.encode() not in repr(tokens.__dict__).encode()


def test_a_token_is_checked_by_its_id_digest_state_and_header() -> None:
    tokens, token = issued("runner", expires_at=T0 + timedelta(hours=1))
    (token_id,) = tokens.tokens
    header = [f"Bearer {token}".encode()]
    principal = authenticate(header, tokens, T0)
    assert principal == Principal(token_id, "runner", frozenset({"r1"}))
    assert principal.actor() == {"kind": "token", "name": token_id, "role": "runner"}
    assert authenticate(header, tokens, T0 + timedelta(hours=1)) == f"token {token_id} is expired"
    assert authenticate([], tokens, T0) == authenticate([b"Basic x"], tokens, T0)
    assert authenticate(header * 2, tokens, T0) == "give one Authorization header"
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    assert authenticate([f"Bearer {wrong}".encode()], tokens, T0) == "not a valid token"
    assert authenticate([b"Bearer \xff"], tokens, T0) == "not a valid token"
    assert authenticate([b"Bearer " + b"a" * 200], tokens, T0) == "not a valid token"
    assert token_id_of(token) == token_id
    assert token_id_of(token + "x") is None
    assert token_id_of("sbt_" + token_id + "_" + "A" * 42) is None
