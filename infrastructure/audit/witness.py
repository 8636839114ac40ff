"""A witness of the log: it co-signs a checkpoint only when it extends the last one it
accepted for the same origin (docs/audit.md, "Witness").

The state is a directory: one file per origin (``<sha-256 of the origin, hex>.checkpoint``)
holding the last checkpoint accepted, as the co-signed note. A new checkpoint of a
smaller size is refused; of the same size, it must have the same root; of a larger size,
the log's consistency proof from the old size to the new must verify against the two
checkpoints' roots (RFC 9162, section 2.1.4.2) — the roots the witness holds and is
shown, never the log's own. Then the witness adds its signature line (an Ed25519
signed-note signature of its key) and keeps the new checkpoint. Runs against one state
directory are serialised by an exclusive lock on ``DIR/.lock``; the state file is
replaced atomically.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from secondbox_scheduler.domain.audit.merkle import verify_consistency
from secondbox_scheduler.infrastructure.audit.signed_notes import (
    Note,
    SignedCheckpoint,
    Signer,
    Verifier,
    parse_checkpoint_note,
)

# (old size, new size) -> the log's consistency path
ConsistencySource = Callable[[int, int], list[bytes]]


class CheckpointRefused(Exception):
    """The witness will not co-sign: the checkpoint does not extend the last one."""

    def __init__(self, detail: str, old_size: int | None, new_size: int) -> None:
        self.old_size = old_size
        self.new_size = new_size
        super().__init__(detail)


@dataclass(frozen=True)
class Witnessed:
    note: Note  # the checkpoint with the witness's signature
    checkpoint: SignedCheckpoint
    previous_size: int | None  # the size of the checkpoint it extends (None: the first)


def state_file(directory: Path, origin: str) -> Path:
    return directory / f"{hashlib.sha256(origin.encode()).hexdigest()}.checkpoint"


def witness(
    directory: Path,
    signer: Signer,
    note_text: str | bytes,
    consistency: ConsistencySource,
    log_key: Verifier | None = None,
) -> Witnessed:
    """Co-sign ``note_text`` if it extends the last checkpoint accepted for its origin
    (else :class:`CheckpointRefused`); ``log_key``: the log's verifier key, whose
    signature the checkpoint must carry."""
    note, checkpoint = parse_checkpoint_note(note_text)
    if log_key is not None and not note.verified_by(log_key):
        raise CheckpointRefused(
            f"the checkpoint of size {checkpoint.size} carries no valid signature of the "
            f"log's key {log_key.name}",
            None,
            checkpoint.size,
        )
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = state_file(directory, checkpoint.origin)
        previous = None
        if path.exists():
            _, previous = parse_checkpoint_note(path.read_bytes())
        if previous is not None:
            _extends(previous, checkpoint, consistency)
        mine = signer.verifier
        if not any(s.name == mine.name and s.hash == mine.hash for s in note.signatures):
            cosigned = note.signed(signer)
        elif note.verified_by(mine):  # co-signed already (shown again): kept as it is
            cosigned = note
        else:
            raise CheckpointRefused(
                f"refused: a signature line in the witness's name {mine.name} that does not verify",
                None if previous is None else previous.size,
                checkpoint.size,
            )
        scratch = path.with_suffix(".tmp")
        scratch.write_text(str(cosigned))
        os.replace(scratch, path)
        return Witnessed(cosigned, checkpoint, None if previous is None else previous.size)


def _extends(old: SignedCheckpoint, new: SignedCheckpoint, consistency: ConsistencySource) -> None:
    if new.size < old.size:
        raise CheckpointRefused(
            f"refused: the checkpoint's tree size {new.size} is smaller than the last "
            f"accepted {old.size} (a log does not shrink)",
            old.size,
            new.size,
        )
    if new.size == old.size:
        if new.root != old.root:
            raise CheckpointRefused(
                f"refused: tree size {new.size} has another root than the checkpoint of "
                "that size accepted before (the log forked)",
                old.size,
                new.size,
            )
        return
    path = consistency(old.size, new.size)
    if not verify_consistency(old.size, new.size, old.root, new.root, path):
        raise CheckpointRefused(
            f"refused: tree size {new.size} does not extend the last accepted tree size "
            f"{old.size} (the log's consistency proof fails against the two checkpoints: "
            "the log forked or was rewritten)",
            old.size,
            new.size,
        )


class LogUnreachableError(Exception):
    """The log's consistency proof could not be fetched (``--log-url``)."""


def http_consistency(
    url: str, token: str | None = None, timeout: float = 30.0
) -> ConsistencySource:
    """The log's consistency proofs from its HTTP service (``GET
    /v1/audit/proofs/consistency?from=&to=``, with a bearer token of a reading role)."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from secondbox_scheduler.infrastructure.audit.merkle_log import ConsistencyProof

    def fetch(old_size: int, new_size: int) -> list[bytes]:
        query = urllib.parse.urlencode({"from": old_size, "to": new_size})
        request = urllib.request.Request(
            f"{url.rstrip('/')}/v1/audit/proofs/consistency?{query}",
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = json.loads(response.read(1 << 20))
        except urllib.error.HTTPError as error:
            if error.code in (400, 404, 422):  # the log has no such tree: nothing extends
                return []
            raise LogUnreachableError(f"{url}: HTTP {error.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise LogUnreachableError(f"{url}: {error}") from None
        proof = ConsistencyProof.from_dict(body)
        if (proof.old_size, proof.new_size) != (old_size, new_size):
            return []  # a proof of other sizes proves nothing here
        return list(proof.consistency_path)

    return fetch
