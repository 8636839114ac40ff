"""Deterministic aggregate ids: ``uuid5`` of a namespace and the domain's string id.

``repository.get`` can then find a runner, its lease or a sandbox by the string id
that callers use, and two replicas creating the same id collide on the same stream.
"""

from __future__ import annotations

from functools import lru_cache
from hashlib import sha1
from uuid import UUID, SafeUUID

NAMESPACE = UUID("3f4c1f0e-5b8e-4f7a-9d57-2f1a6c0b9e11")
_NAMESPACE_BYTES = NAMESPACE.bytes
_set = object.__setattr__
# uuid5's version and variant bits (RFC 4122), as ``UUID(bytes=..., version=5)`` sets them
_CLEARED = ~(0xC000 << 48) & ~(0xF000 << 64)
_VERSION_5 = 0x8000 << 48 | 5 << 76


def uuid5(namespace: UUID, name: str) -> UUID:
    """``uuid.uuid5(namespace, name)``, the same ``UUID`` (its ``int`` and ``is_safe``),
    without ``UUID.__init__``'s checks of its arguments (half the time: a placement
    derives a token's stream id, uncached). ``tests/test_ids.py`` compares both."""
    digest = sha1(
        (_NAMESPACE_BYTES if namespace is NAMESPACE else namespace.bytes) + name.encode()
    ).digest()
    uuid = object.__new__(UUID)
    _set(uuid, "int", int.from_bytes(digest[:16], "big") & _CLEARED | _VERSION_5)
    _set(uuid, "is_safe", SafeUUID.unknown)
    return uuid


# a placement derives the same few ids several times (SHA-1 each): the last ones are
# kept, a bounded number (sandbox ids are not)
REMEMBERED = 16_384


@lru_cache(maxsize=REMEMBERED)
def runner_uuid(runner_id: str) -> UUID:
    return uuid5(NAMESPACE, f"runner:{runner_id}")


@lru_cache(maxsize=REMEMBERED)
def lease_uuid(runner_id: str) -> UUID:
    return uuid5(NAMESPACE, f"runner-lease:{runner_id}")


@lru_cache(maxsize=REMEMBERED)
def sandbox_uuid(sandbox_id: str) -> UUID:
    return uuid5(NAMESPACE, f"sandbox:{sandbox_id}")


def refusal_log_uuid(sandbox_id: str) -> UUID:
    return uuid5(NAMESPACE, f"refusals:{sandbox_id}")


def fencing_token_uuid(sandbox_id: str, token_sha256: str) -> UUID:
    """The stream that records one fencing token's use by one sandbox (by its digest)."""
    return uuid5(NAMESPACE, f"fencing-token:{sandbox_id}:{token_sha256}")


def access_tokens_uuid() -> UUID:
    """The one stream of the service's access tokens (domain/access_tokens.py)."""
    return uuid5(NAMESPACE, "access-tokens")


def cell_claim_uuid(kind: str, subject_id: str) -> UUID:
    """The stream that names the cell of one runner or sandbox id (domain/cell_claims.py)."""
    return uuid5(NAMESPACE, f"cell-claim:{kind}:{subject_id}")
