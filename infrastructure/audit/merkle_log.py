"""The log as a Merkle tree, for an outsider: tree heads, signed checkpoints, inclusion
and consistency proofs, and their offline check (docs/audit.md, "Merkle tree").

``audit checkpoint --sign-key``, ``audit prove`` and the ``/v1/audit`` routes are thin
over these; ``audit check-proof`` is :func:`check_inclusion` and
:func:`check_consistency`, which need no database. The tree is brought up to date
before each answer (``MerkleTree.update``, :mod:`..store.merkle_tree`), reading only
the events after it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.audit.merkle import (
    LEAF_FORMAT,
    Node,
    consistency_path,
    inclusion_path,
    leaf_hash,
    root,
    verify_consistency,
    verify_inclusion,
)
from secondbox_scheduler.domain.errors import InvalidRequestError, SchedulerError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.signed_notes import (
    Note,
    NoteError,
    SignedCheckpoint,
    Signer,
    Verifier,
    parse_checkpoint_note,
)
from secondbox_scheduler.infrastructure.store.merkle_tree import MerkleTree, TreeUnavailableError

MAX_PATH = 64  # hashes in a proof of a tree of at most 2**63 leaves


class CheckpointKeyMissingError(SchedulerError):
    """No key to sign checkpoints with (``SECONDBOX_CHECKPOINT_KEY`` unset or unusable)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(
            "this service signs no checkpoints: SECONDBOX_CHECKPOINT_KEY is "
            + (f"unusable ({detail})" if detail else "not set")
        )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: Any, field: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidRequestError(field, "must be a base64 string", repr(text)[:40])
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise InvalidRequestError(field, "must be standard base64", text[:40]) from None


class _Tree(MerkleTree):
    """The stored tree, whose missing nodes (rows deleted) are a typed error."""

    def read(self, nodes: Iterable[Node]) -> dict[Node, bytes]:
        wanted = list(nodes)
        found = super().read(wanted)
        if len(found) < len(set(wanted)):
            raise TreeUnavailableError(
                "the stored Merkle tree lacks nodes it covers (rows deleted): the schema "
                "owner rebuilds it (MerkleTree.rebuild, docs/audit.md)"
            )
        return found


def tree(app: SchedulerApplication) -> MerkleTree:
    return _Tree(app.recorder)


def tree_head(app: SchedulerApplication, size: int | None = None) -> tuple[int, bytes]:
    """The tree size and head: of the whole log (None), or of its first ``size`` leaves."""
    log = tree(app)
    current = log.update()
    if size is None:
        size = current
    if not 0 <= size <= current:
        raise InvalidRequestError("size", f"must be 0 to the log's size {current}", str(size))
    return size, root(size, log.read)


def signed_checkpoint(
    app: SchedulerApplication, signer: Signer, origin: str | None = None
) -> tuple[Note, SignedCheckpoint]:
    """The checkpoint of the whole log now, signed by ``signer`` (origin: the key's name
    unless given)."""
    size, head = tree_head(app)
    checkpoint = SignedCheckpoint(origin or signer.name, size, head)
    try:
        SignedCheckpoint.from_body(checkpoint.body())
    except NoteError as error:
        raise InvalidRequestError("origin", str(error), origin or "") from None
    return Note(checkpoint.body()).signed(signer), checkpoint


@dataclass(frozen=True)
class InclusionProof:
    leaf_index: int
    tree_size: int
    leaf_data: bytes
    inclusion_path: tuple[bytes, ...]
    root_hash: bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "leaf_index": self.leaf_index,
            "tree_size": self.tree_size,
            "leaf_data": b64(self.leaf_data),
            "inclusion_path": [b64(h) for h in self.inclusion_path],
            "root_hash": b64(self.root_hash),
        }

    @classmethod
    def from_dict(cls, data: Any) -> InclusionProof:
        if not isinstance(data, dict) or set(data) != {
            "leaf_index", "tree_size", "leaf_data", "inclusion_path", "root_hash"
        }:  # fmt: skip
            raise InvalidRequestError(
                "proof",
                "must be an object of leaf_index, tree_size, leaf_data, inclusion_path, root_hash",
                "",
            )
        return cls(
            _count(data["leaf_index"], "leaf_index"),
            _count(data["tree_size"], "tree_size"),
            unb64(data["leaf_data"], "leaf_data"),
            _hashes(data["inclusion_path"], "inclusion_path"),
            _hash(data["root_hash"], "root_hash"),
        )


@dataclass(frozen=True)
class ConsistencyProof:
    old_size: int
    new_size: int
    old_root: bytes
    new_root: bytes
    consistency_path: tuple[bytes, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "old_size": self.old_size,
            "new_size": self.new_size,
            "old_root": b64(self.old_root),
            "new_root": b64(self.new_root),
            "consistency_path": [b64(h) for h in self.consistency_path],
        }

    @classmethod
    def from_dict(cls, data: Any) -> ConsistencyProof:
        if not isinstance(data, dict) or set(data) != {
            "old_size", "new_size", "old_root", "new_root", "consistency_path"
        }:  # fmt: skip
            raise InvalidRequestError(
                "proof",
                "must be an object of old_size, new_size, old_root, new_root, consistency_path",
                "",
            )
        return cls(
            _count(data["old_size"], "old_size"),
            _count(data["new_size"], "new_size"),
            _hash(data["old_root"], "old_root"),
            _hash(data["new_root"], "new_root"),
            _hashes(data["consistency_path"], "consistency_path"),
        )


def _count(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise InvalidRequestError(field, "must be an integer from 0 to 2**63 - 1", repr(value))
    return value


def _hash(value: Any, field: str) -> bytes:
    digest = unb64(value, field)
    if len(digest) != 32:
        raise InvalidRequestError(field, "must be a 32-byte hash", str(value)[:60])
    return digest


def _hashes(value: Any, field: str) -> tuple[bytes, ...]:
    if not isinstance(value, list) or len(value) > MAX_PATH:
        raise InvalidRequestError(field, f"must be a list of at most {MAX_PATH} hashes", "")
    return tuple(_hash(item, field) for item in value)


def inclusion_proof(
    app: SchedulerApplication, position: int, size: int | None = None
) -> InclusionProof:
    """The proof that the event at ``position`` is leaf ``position - 1`` of the tree of
    the latest checkpoint (the whole log now), or of its first ``size`` leaves."""
    size, head = tree_head(app, size)
    if not 1 <= position <= size:
        raise InvalidRequestError("position", f"must be 1 to the tree size {size}", str(position))
    log = tree(app)
    path = inclusion_path(position - 1, size, log.read)
    return InclusionProof(position - 1, size, log.leaf_data_at(position), tuple(path), head)


def consistency_proof(
    app: SchedulerApplication, old_size: int, new_size: int | None = None
) -> ConsistencyProof:
    """The proof that the tree of ``new_size`` leaves (the whole log now) extends the
    tree of ``old_size``."""
    new_size, new_root = tree_head(app, new_size)
    if not 0 <= old_size <= new_size:
        raise InvalidRequestError(
            "from", f"must be 0 to the new tree size {new_size}", str(old_size)
        )
    log = tree(app)
    path = consistency_path(old_size, new_size, log.read)
    return ConsistencyProof(old_size, new_size, root(old_size, log.read), new_root, tuple(path))


# -- checks an outsider makes, with no database ----------------------------------------


def verified_checkpoint(text: str | bytes, verifier: Verifier) -> SignedCheckpoint:
    """The checkpoint of a signed note, if ``verifier`` signed it (else :class:`NoteError`)."""
    note, checkpoint = parse_checkpoint_note(text)
    if not note.verified_by(verifier):
        raise NoteError(f"the checkpoint carries no valid signature of {verifier.name}")
    return checkpoint


def leaf_position(leaf_data: bytes) -> int | None:
    """The position a leaf's data names (docs/audit.md), or None if it is not leaf data."""
    start = len(LEAF_FORMAT)
    if not leaf_data.startswith(LEAF_FORMAT) or len(leaf_data) < start + 9:
        return None
    return int.from_bytes(leaf_data[start : start + 8], "big")


def describe_leaf(leaf_data: bytes) -> str:
    """The stored row a leaf's data describes, for people (docs/audit.md's layout)."""
    start = len(LEAF_FORMAT)
    position = leaf_position(leaf_data)
    if position is None:
        return "not leaf data of this log"
    kind = leaf_data[start + 8]
    if kind == 0:
        return f"position {position}: no event (a position the sequence skipped)"
    at = start + 9
    try:
        stream = UUID(bytes=leaf_data[at : at + 16])
        version = int.from_bytes(leaf_data[at + 16 : at + 24], "big")
        length = int.from_bytes(leaf_data[at + 24 : at + 32], "big")
        topic = leaf_data[at + 32 : at + 32 + length].decode()
        end = at + 32 + length
        state = int.from_bytes(leaf_data[end : end + 8], "big")
    except (ValueError, UnicodeDecodeError):
        return f"position {position}: malformed leaf data"
    return (
        f"position {position}: stream {stream} version {version} "
        f"{topic.rpartition(':')[2]} ({state:,}-byte state)"
    )


def check_inclusion(proof: InclusionProof, checkpoint: SignedCheckpoint) -> list[str]:
    """What is wrong with ``proof`` against a verified checkpoint (empty: it proves the
    leaf is in the checkpoint's tree)."""
    problems = []
    if proof.tree_size != checkpoint.size:
        problems.append(
            f"the proof is for tree size {proof.tree_size}, the checkpoint's is {checkpoint.size}"
        )
    if proof.root_hash != checkpoint.root:
        problems.append("the proof's root hash is not the checkpoint's")
    if leaf_position(proof.leaf_data) != proof.leaf_index + 1:
        problems.append(
            f"the leaf data does not name position {proof.leaf_index + 1} (leaf index + 1)"
        )
    if not verify_inclusion(
        proof.leaf_index,
        checkpoint.size,
        leaf_hash(proof.leaf_data),
        proof.inclusion_path,
        checkpoint.root,
    ):
        problems.append("the inclusion path does not lead from the leaf to the checkpoint's root")
    return problems


def check_consistency(
    proof: ConsistencyProof,
    checkpoint: SignedCheckpoint,
    old_checkpoint: SignedCheckpoint | None = None,
) -> list[str]:
    """What is wrong with ``proof`` against a verified (new) checkpoint and, if given, a
    verified old one (empty: the new tree extends the old)."""
    problems = []
    if proof.new_size != checkpoint.size or proof.new_root != checkpoint.root:
        problems.append("the proof's new size and root are not the checkpoint's")
    old_root = proof.old_root
    if old_checkpoint is not None:
        if proof.old_size != old_checkpoint.size or proof.old_root != old_checkpoint.root:
            problems.append("the proof's old size and root are not the old checkpoint's")
        old_root = old_checkpoint.root
    if not verify_consistency(
        proof.old_size, checkpoint.size, old_root, checkpoint.root, proof.consistency_path
    ):
        problems.append(
            f"the consistency path does not prove that tree size {checkpoint.size} extends "
            f"tree size {proof.old_size}"
        )
    return problems
