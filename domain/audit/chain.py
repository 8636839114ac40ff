"""The hash chain over the notification log, and its verification (pure: no I/O).

Every stored event is covered by one link of a chain over the notification log::

    digest(n) = H(tag || digest(p) || p || n || originator id || version || topic || state)

where ``p`` is the position of the previous link (0 and 32 zero bytes for the first
link: the genesis), every field is length-prefixed, and ``H`` is SHA-256, or
HMAC-SHA-256 keyed with the audit key when there is one (``SECONDBOX_AUDIT_KEY``). A
link is stored next to the events, in the same transaction
(infrastructure/store/chained_sqlite.py, chained_postgres.py).

:class:`ChainVerifier` is fed the log in order, position by position, each position
with its stored event and its stored link (either may be missing), and names the first
position at which the two disagree: an edited event (any byte of its id, version, topic
or state), an event without its link (inserted, duplicated), a link without its event
(deleted), a link that does not follow the previous one (events deleted with their
links, reordered). Positions before the first link are the unchained prefix written
before the chain existed (release 0.1). A :class:`Checkpoint` (a position and its
digest, kept elsewhere) also catches a truncated or wholesale rewritten log.

A snapshot is sealed with the digest of the link of the event at its version:
``seal = H(snapshot tag || that digest || originator id || version || topic || state)``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

DIGEST_SIZE = 32
GENESIS = bytes(DIGEST_SIZE)
_LINK_TAG = b"secondbox-chain-v1"
_SEAL_TAG = b"secondbox-snapshot-seal-v1"


def _length(value: bytes) -> bytes:
    return len(value).to_bytes(8, "big") + value


def _identity(originator_id: UUID | str) -> bytes:
    return originator_id.bytes if isinstance(originator_id, UUID) else originator_id.encode()


def hasher(key: bytes | None) -> Callable[[bytes], bytes]:
    """SHA-256, or HMAC-SHA-256 with ``key``."""
    if key:
        return lambda message: hmac.new(key, message, hashlib.sha256).digest()
    return lambda message: hashlib.sha256(message).digest()


@dataclass(frozen=True)
class Link:
    """A stored link: its position, the position of the link before it, its digest."""

    position: int
    previous: int
    digest: bytes


@dataclass(frozen=True)
class ChainedEvent:
    """The stored fields of an event that the chain covers."""

    position: int
    originator_id: UUID | str
    originator_version: int
    topic: str
    state: bytes


class Chain:
    """Computes digests (with or without a key)."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key or None
        self._hash = hasher(self.key)

    @property
    def keyed(self) -> bool:
        return self.key is not None

    def digest(self, previous: Link | None, event: ChainedEvent) -> bytes:
        before, prior = (0, GENESIS) if previous is None else (previous.position, previous.digest)
        return self._hash(
            b"".join((
                _LINK_TAG,
                prior,
                before.to_bytes(8, "big"),
                event.position.to_bytes(8, "big"),
                _length(_identity(event.originator_id)),
                event.originator_version.to_bytes(8, "big", signed=True),
                _length(event.topic.encode()),
                _length(event.state),
            ))
        )  # fmt: skip

    def links(self, previous: Link | None, events: list[ChainedEvent]) -> list[Link]:
        """The links of ``events`` (in log order) after ``previous``."""
        made = []
        for event in events:
            before = 0 if previous is None else previous.position
            previous = Link(event.position, before, self.digest(previous, event))
            made.append(previous)
        return made

    def seal(
        self, chain_digest: bytes, originator_id: UUID | str, version: int, topic: str, state: bytes
    ) -> bytes:
        """The seal of a snapshot taken at the event whose link has ``chain_digest``."""
        return self._hash(
            b"".join((
                _SEAL_TAG,
                _length(chain_digest),
                _length(_identity(originator_id)),
                version.to_bytes(8, "big", signed=True),
                _length(topic.encode()),
                _length(state),
            ))
        )  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """Something wrong with the stored log at ``position``."""

    position: int
    kind: str  # edited, unchained, deleted, relinked, truncated, rewritten, snapshot
    detail: str

    def __str__(self) -> str:
        return f"#{self.position} {self.kind}: {self.detail}"


@dataclass(frozen=True)
class Checkpoint:
    """A position of the log and the chain digest there."""

    position: int
    digest: bytes

    def __str__(self) -> str:
        return f"{self.position}:{self.digest.hex()}"

    @classmethod
    def parse(cls, text: str) -> Checkpoint | bytes:
        """``POSITION:HEX`` (a checkpoint) or ``HEX`` (a digest, position unknown)."""
        match = re.fullmatch(r"\s*(?:(\d{1,19}):)?([0-9a-fA-F]{64})\s*", text)
        if match is None:
            raise ValueError("a checkpoint is POSITION:DIGEST or DIGEST (64 hex digits)")
        digest = bytes.fromhex(match.group(2))
        if match.group(1) is None:
            return digest
        return cls(int(match.group(1)), digest)


@dataclass
class ChainVerifier:
    """Feed it every position of the log in order (:meth:`feed`), then :meth:`finish`."""

    chain: Chain
    findings: list[Finding] = field(default_factory=list)
    unchained_until: int = 0  # the last position of the unchained prefix (0: none)
    head: Link | None = None  # the last link seen
    last_position: int = 0  # the last position with an event or a link
    links_checked: int = 0
    _positions: dict[int, bytes] = field(default_factory=dict)
    _digests: dict[bytes, bool] = field(default_factory=dict)

    def expect(self, checkpoint: Checkpoint | bytes) -> None:
        """Before the log: remember what :meth:`check` will need for ``checkpoint``."""
        if isinstance(checkpoint, bytes):
            self._digests[checkpoint] = False
        else:
            self._positions[checkpoint.position] = b""

    def feed(self, event: ChainedEvent | None, link: Link | None) -> None:
        position = event.position if event is not None else link.position if link else 0
        self.last_position = max(self.last_position, position)
        if link is None:
            assert event is not None
            if self.head is None:
                self.unchained_until = position
            else:
                self.findings.append(
                    Finding(position, "unchained", "an event without a chain link (inserted?)")
                )
            return
        if event is None:
            self.findings.append(
                Finding(position, "deleted", "a chain link without its event (event deleted)")
            )
            self._advance(link)
            return
        expected_previous = 0 if self.head is None else self.head.position
        if self.head is not None and link.previous > expected_previous:
            self.findings.append(
                Finding(
                    link.previous,
                    "deleted",
                    f"the link at position {position} follows position {link.previous}, "
                    f"which is missing (events deleted after position {expected_previous})",
                )
            )
            self._advance(link)
            return
        expected = self.chain.digest(self.head, event)
        if not hmac.compare_digest(expected, link.digest):
            if self.head is None and link.previous != 0:
                detail = (
                    f"the first link follows position {link.previous}, which is missing "
                    "(the start of the chain was deleted)"
                )
                self.findings.append(Finding(link.previous, "deleted", detail))
            else:
                what = "its stored fields or its link were changed"
                if link.previous != expected_previous:
                    what = f"its link claims to follow position {link.previous}"
                self.findings.append(
                    Finding(position, "edited", f"digest mismatch: the event differs ({what})")
                )
        self._advance(link)

    def _advance(self, link: Link) -> None:
        self.links_checked += 1
        self.head = link
        if link.position in self._positions:
            self._positions[link.position] = link.digest
        if link.digest in self._digests:
            self._digests[link.digest] = True

    def check(self, checkpoint: Checkpoint | bytes) -> None:
        """After the log: does it still extend ``checkpoint``?"""
        if isinstance(checkpoint, bytes):
            if not self._digests.get(checkpoint):
                self.findings.append(
                    Finding(
                        self.last_position + 1,
                        "rewritten",
                        "no link of the log has the checkpoint's digest (truncated or rewritten)",
                    )
                )
            return
        if checkpoint.position > self.last_position:
            self.findings.append(
                Finding(
                    self.last_position + 1,
                    "truncated",
                    f"the log ends at position {self.last_position}, before the checkpoint's "
                    f"position {checkpoint.position}",
                )
            )
            return
        digest = self._positions.get(checkpoint.position, b"")
        if not digest:
            self.findings.append(
                Finding(checkpoint.position, "rewritten", "no link at the checkpoint's position")
            )
        elif not hmac.compare_digest(digest, checkpoint.digest):
            self.findings.append(
                Finding(
                    checkpoint.position,
                    "rewritten",
                    "the digest there differs from the checkpoint's (history rewritten, or "
                    "another audit key)",
                )
            )
