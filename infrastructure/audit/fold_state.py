"""The fold state of ``audit verify``, sealed at a checkpoint, for the incremental
re-audit (``audit verify --save-state FILE``, then ``--since CHECKPOINT --since-state
FILE``; docs/audit.md, "Incremental re-audit").

What a verify holds after the last event it read, before it judges the end of the log:
the audit fold (every stream's plain state, the pending transaction, the time-order
marks, the violations so far), the chain verifier (its head link, the strays named),
the snapshot check's counts and findings, the Merkle refold (the compact range: one hash
per set bit of the size), how many events it read and the last position. A re-audit
restores it and folds only the events after that position, so its findings are those of
a full verify over the same log.

The file is ``secondbox-fold-state-v1``, a newline, a JSON header (the tree size and
root hash the state is sealed at, the events read, the SHA-256 of the payload), a
newline, the payload (Python's pickle of the state). The payload is read back with an
unpickler that builds only the project's domain classes and a few standard value types
(sets, datetimes, UUIDs, decimals): it runs no other code of the file. The header seals
the state to one checkpoint: a re-audit refuses a state whose tree size and root are not
its checkpoint's, and one whose payload does not hash to the header's digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.audit.chain import ChainVerifier
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.merkle import MerkleRefold
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.snapshot_check import SnapshotCheck

MAGIC = b"secondbox-fold-state-v1\n"
MAX_STATE_BYTES = 4 << 30
# attributes that are the fold's machinery, not its state (rebuilt on restore)
TRANSIENT = {"_handlers", "_current", "_stream", "_names", "auditor_clock", "_requirements_seen",
             "_numbered"}  # fmt: skip
SAFE_GLOBALS = {
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytes", "bytearray", "int",
                 "str", "float", "bool", "complex", "object", "slice", "range"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "uuid": {"UUID", "SafeUUID"},
    "decimal": {"Decimal"},
    "collections": {"OrderedDict", "defaultdict", "deque"},
    "copyreg": {"_reconstructor"},
    "array": {"array", "_array_reconstructor"},
}  # fmt: skip
SNAPSHOT_FIELDS = ("checked", "violations", "left", "broken", "decoded")


class StateError(InvalidRequestError):
    def __init__(self, rule: str) -> None:
        super().__init__("since-state", rule)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in SAFE_GLOBALS.get(module, ()) or (
            module.startswith("secondbox_scheduler.domain.")
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class of a fold state")


@dataclass
class FoldState:
    """A verify's state after its last event (the module docstring)."""

    audit: AuditFold
    verifier_state: dict[str, Any]
    refold: MerkleRefold
    violations: list[Violation]  # unreadable, unfoldable: the loop's own findings
    snapshots: dict[str, Any]
    read: int
    last: int
    header: dict[str, Any] = field(default_factory=dict)
    events_before: int = 0  # the events the fold had applied when it was sealed

    def restore(self, verifier: ChainVerifier) -> None:
        """The chain verifier's state onto ``verifier`` (which holds the chain and the
        stored links' lookup)."""
        verifier.__dict__.update(self.verifier_state)

    @classmethod
    def capture(
        cls,
        audit: AuditFold,
        verifier: ChainVerifier,
        refold: MerkleRefold,
        violations: list[Violation],
        snapshots: SnapshotCheck,
        read: int,
        last: int,
    ) -> bytes:
        """The sealed file's bytes: the state now, at tree size ``last``."""
        refold.fill(last)
        payload = pickle.dumps(
            {
                "audit": {k: v for k, v in vars(audit).items() if k not in TRANSIENT},
                "verifier": {
                    k: v for k, v in vars(verifier).items() if k not in ("chain", "lookup")
                },
                "refold": (refold.size, list(refold.stack)),
                "violations": list(violations),
                "snapshots": {name: getattr(snapshots, name) for name in SNAPSHOT_FIELDS},
                "read": read,
                "last": last,
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        header = {
            "tree_size": refold.size,
            "root_hash": refold.root().hex(),
            "events": read,
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }
        return MAGIC + json.dumps(header).encode() + b"\n" + payload

    @classmethod
    def load(cls, data: bytes) -> FoldState:
        """The state of a sealed file, restored onto a new fold."""
        if not data.startswith(MAGIC):
            raise StateError("not a fold state (audit verify --save-state)")
        header_end = data.find(b"\n", len(MAGIC))
        try:
            header = json.loads(data[len(MAGIC) : header_end])
            size, root = int(header["tree_size"]), bytes.fromhex(header["root_hash"])
            digest = str(header["payload_sha256"])
        except (ValueError, KeyError, TypeError):
            raise StateError("its header is malformed") from None
        payload = data[header_end + 1 :]
        if header_end < 0 or hashlib.sha256(payload).hexdigest() != digest:
            raise StateError("its payload does not hash to its header's digest (changed)")
        try:
            saved = _Unpickler(io.BytesIO(payload)).load()
        except Exception as error:
            raise StateError(f"its payload cannot be read ({error})") from None
        audit = AuditFold(compact=True)
        audit.__dict__.update(saved["audit"])
        refold = MerkleRefold()
        refold.size, refold.stack = saved["refold"]
        if refold.size != size or refold.root() != root:
            raise StateError("its tree size and root are not those its header seals")
        return cls(
            audit,
            dict(saved["verifier"]),
            refold,
            list(saved["violations"]),
            dict(saved["snapshots"]),
            int(saved["read"]),
            int(saved["last"]),
            {"tree_size": size, "root_hash": root, "events": int(header["events"])},
            audit.events,
        )


class ResumedSnapshotCheck(SnapshotCheck):
    """The snapshot check of a re-audit: the snapshots at positions after ``after``, the
    counts and findings of those before restored. A stream's aggregate is refolded from
    its own events up to the first one after ``after`` (the events before the
    checkpoint, read by stream: the re-audit takes them as the audit sealed them)."""

    def __init__(self, app: SchedulerApplication, after: int, saved: dict[str, Any]) -> None:
        super().__init__(app)
        for name in SNAPSHOT_FIELDS:
            setattr(self, name, saved[name])
        self.after = after
        self.started: set[UUID] = set()
        for stream in self.broken:
            self.last.pop(stream, None)

    def apply(self, event: Any) -> None:
        stream = event.originator_id
        if stream in self.last and stream not in self.started:
            self.started.add(stream)
            version = event.originator_version
            if self.last[stream] < version:  # its snapshots are all before the checkpoint
                self.last.pop(stream, None)
                return
            if version > 1:
                aggregate: Any = None
                try:
                    earlier: Any
                    for earlier in self.app.events.get(stream, lte=version - 1):
                        aggregate = earlier.mutate(aggregate)
                except Exception:  # a tampered history; the chain names it
                    self.last.pop(stream, None)
                    self.broken.add(stream)
                    return
                self.aggregates[stream] = aggregate
        super().apply(event)
