"""Deterministic aggregate ids: ``uuid5`` of a namespace and the domain's string id.

``repository.get`` can then find a runner, its lease or a sandbox by the string id
that callers use, and two replicas creating the same id collide on the same stream.
"""

from __future__ import annotations

from functools import lru_cache
from uuid import UUID, uuid5

NAMESPACE = UUID("3f4c1f0e-5b8e-4f7a-9d57-2f1a6c0b9e11")
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
