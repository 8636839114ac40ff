"""What ``audit verify`` checks of the Merkle tree (docs/audit.md, "Merkle tree"):

- ``merkle``: the stored tree's head at the size verified equals the head refolded from
  the log there (the tree is derived data: a tree table edited, or events changed after
  the tree covered them, differ);
- ``checkpoint-signature`` / ``checkpoint-witness``: a signed checkpoint given (``--checkpoint
  FILE``, ``--since FILE``) carries a valid signature of the log's key (``--log-key``) and
  of every witness named (``--witness``);
- ``checkpoint-truncated`` / ``checkpoint-rewritten``: the log reaches the checkpoint's
  tree size, and its tree there has the checkpoint's root (refolded from the log, or, for
  ``--since``, the stored tree's: the events before it are not read again);
- ``checkpoint-inconsistent``: for ``--since``, the consistency proof from the
  checkpoint's size to the size verified does not verify against the two roots.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from eventsourcing.persistence import PersistenceError

from secondbox_scheduler.domain.audit.merkle import (
    MerkleRefold,
    consistency_path,
    root,
    verify_consistency,
)
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.fold_state import FoldState, StateError
from secondbox_scheduler.infrastructure.audit.signed_notes import (
    Note,
    SignedCheckpoint,
    Verifier,
)
from secondbox_scheduler.infrastructure.store.merkle_tree import MerkleTree, TreeUnavailableError


@dataclass
class MerkleReport:
    tree_size: int = 0  # the size verified (the last position read)
    root_hash: str | None = None  # base64 of the refolded head there
    stored_checked: bool = False  # the stored tree was compared with it
    since: int | None = None  # the checkpoint's size a re-audit started from

    def to_dict(self) -> dict[str, Any]:
        return {
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "stored_checked": self.stored_checked,
            "since": self.since,
        }


def _violation(position: int, rule: str, detail: str) -> Violation:
    return Violation(position, "log", "(checkpoint)", rule, detail)


@dataclass
class MerkleChecks:
    """The signed checkpoints, keys and fold state one verify is given."""

    signed: list[tuple[Note, SignedCheckpoint]] = field(default_factory=list)
    log_key: Verifier | None = None
    witnesses: list[Verifier] = field(default_factory=list)
    since: tuple[Note, SignedCheckpoint] | None = None
    since_state: bytes | None = None
    violations: list[Violation] = field(default_factory=list)

    @property
    def stop(self) -> int | None:
        """Where a verify that saves its state stops: at the signed checkpoint given."""
        return max((c.size for _, c in self.signed), default=None)

    def watched(self) -> list[int]:
        return [c.size for _, c in self.signed]

    def _signatures(self, note: Note, checkpoint: SignedCheckpoint) -> None:
        at = checkpoint.size
        if self.log_key is not None and not note.verified_by(self.log_key):
            self.violations.append(
                _violation(at, "checkpoint-signature", f"the checkpoint of tree size {at} "
                           f"carries no valid signature of the log's key {self.log_key.name}")
            )  # fmt: skip
        for witness in self.witnesses:
            if not note.verified_by(witness):
                self.violations.append(
                    _violation(at, "checkpoint-witness", f"the checkpoint of tree size {at} is "
                               f"not co-signed by the witness {witness.name}")
                )  # fmt: skip

    def resume(self, app: SchedulerApplication) -> FoldState | None:
        """The fold state to start from (``--since``), checked against its checkpoint."""
        if self.since is None:
            return None
        note, checkpoint = self.since
        if self.since_state is None:
            raise StateError("give the fold state sealed at the checkpoint (--since-state)")
        state = FoldState.load(self.since_state)
        if (state.header["tree_size"], state.header["root_hash"]) != (
            checkpoint.size,
            checkpoint.root,
        ):
            raise StateError(
                f"it is sealed at tree size {state.header['tree_size']}, not at the "
                f"checkpoint's {checkpoint.size} with its root"
            )
        self._signatures(note, checkpoint)
        return state

    def finish(
        self,
        app: SchedulerApplication,
        refold: MerkleRefold,
        position: int,
        resume: FoldState | None,
    ) -> MerkleReport:
        """After the fold reached ``position``: every check of the module docstring."""
        refold.fill(position)
        head = refold.root()
        report = MerkleReport(refold.size, base64.b64encode(head).decode())
        for note, checkpoint in self.signed:
            self._signatures(note, checkpoint)
            at = checkpoint.size
            if at > refold.size:
                self.violations.append(
                    _violation(refold.size + 1, "checkpoint-truncated", f"the log ends at "
                               f"position {refold.size}, before the checkpoint's tree size {at}")
                )  # fmt: skip
            elif refold.watched.get(at) != checkpoint.root:
                self.violations.append(
                    _violation(at, "checkpoint-rewritten", f"the log's tree of size {at} has "
                               "another root than the checkpoint's (the log was rewritten or "
                               "forked)")
                )  # fmt: skip
        try:
            tree = MerkleTree(app.recorder)
        except TreeUnavailableError:
            return report
        stored = None
        try:
            covered = tree.update(refold.size)
        except PersistenceError:  # a role that may not run the tree's function: read it
            covered = tree.size()
        if covered >= refold.size:
            report.stored_checked = True
            stored = root(refold.size, tree.read)
            if stored != head:
                self.violations.append(
                    _violation(refold.size, "merkle", f"the stored Merkle tree's head at size "
                               f"{refold.size} is not the one refolded from the log (its table "
                               "was edited, or events changed after the tree covered them)")
                )  # fmt: skip
        if resume is not None and self.since is not None:
            _, checkpoint = self.since
            end = tree.log_size()
            if end < checkpoint.size:
                self.violations.append(
                    _violation(end + 1, "checkpoint-truncated", f"the log ends at position "
                               f"{end}, before the --since checkpoint's tree size "
                               f"{checkpoint.size}")
                )  # fmt: skip
        if resume is not None and self.since is not None and stored is not None:
            # the log as its tree has it (``merkle`` above: the tree is the log's)
            _, checkpoint = self.since
            report.since = checkpoint.size
            old = root(checkpoint.size, tree.read)
            path = consistency_path(checkpoint.size, refold.size, tree.read)
            if old != checkpoint.root or not verify_consistency(
                checkpoint.size, refold.size, checkpoint.root, stored, path
            ):
                self.violations.append(
                    _violation(checkpoint.size, "checkpoint-inconsistent", f"the log's tree "
                               f"of size {refold.size} does not extend the checkpoint's tree "
                               f"size {checkpoint.size} (its consistency proof fails)")
                )  # fmt: skip
        return report
