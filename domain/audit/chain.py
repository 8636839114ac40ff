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
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple
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


class Link(NamedTuple):
    """A stored link: its position, the position of the link before it, its digest.
    (Named tuples, this and :class:`ChainedEvent`: one of each is made per event of
    an audit, and a tuple is made in a fifth of a frozen dataclass's time.)"""

    position: int
    previous: int
    digest: bytes


class ChainedEvent(NamedTuple):
    """The stored fields of an event that the chain covers."""

    position: int
    originator_id: UUID | str
    originator_version: int
    topic: str
    state: bytes


_POSITIONS = struct.Struct(">QQQ").pack  # previous position, position, identity length
_VERSION = struct.Struct(">q").pack
_LENGTH = struct.Struct(">Q").pack
_TOPICS_CACHED = 256


class Chain:
    """Computes digests (with or without a key)."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key or None
        self._hash = hasher(self.key)
        self._topics: dict[str, bytes] = {}  # a topic, length-prefixed

    @property
    def keyed(self) -> bool:
        return self.key is not None

    def digest(self, previous: Link | None, event: ChainedEvent) -> bytes:
        before, prior = (0, GENESIS) if previous is None else (previous.position, previous.digest)
        identity = _identity(event.originator_id)
        topic = self._topics.get(event.topic)
        if topic is None:
            topic = _length(event.topic.encode())
            if len(self._topics) < _TOPICS_CACHED:
                self._topics[event.topic] = topic
        state = event.state
        try:
            fixed = _POSITIONS(before, event.position, len(identity))
            version = _VERSION(event.originator_version)
        except struct.error as error:  # as int.to_bytes refuses it
            raise OverflowError(str(error)) from None
        return self._hash(
            b"".join((
                _LINK_TAG, prior, fixed, identity, version, topic, _LENGTH(len(state)), state,
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
    kind: str  # edited, unchained, deleted, stray-link, truncated, rewritten, snapshot
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
    """Feed it every position of the log in order (:meth:`feed`), then :meth:`finish`.

    It never stops checking: after a bad, missing or extra link it resynchronises on the
    next stored link and checks every later event's digest against it, against the
    link that link names as its previous (``lookup`` finds one that is not the last
    link fed: a link planted ahead of the log, which every later save then follows).
    A link at a position with no event is judged by the link after it: followed, it
    is the link of a deleted event (``deleted``); passed over, or past the log's end
    and not continuing the chain, it is a link of its own (``stray-link``), named once.
    """

    chain: Chain
    lookup: Callable[[int], Link | None] = lambda _: None  # the stored link at a position
    findings: list[Finding] = field(default_factory=list)
    unchained_until: int = 0  # the last position of the unchained prefix (0: none)
    head: Link | None = None  # the last link of the chain (a stray link is not one)
    last_position: int = 0  # the last position with an event or a link
    links_checked: int = 0
    _positions: dict[int, bytes] = field(default_factory=dict)
    _digests: dict[bytes, bool] = field(default_factory=dict)
    _orphan: Link | None = None  # a link without its event, judged by the next link
    _looked_up: dict[int, Link | None] = field(default_factory=dict)
    _strays: set[int] = field(default_factory=set)  # stray links already named

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
            if self.head is None and self._orphan is None:
                self.unchained_until = position
            else:
                self.findings.append(
                    Finding(position, "unchained", "an event without a chain link (inserted?)")
                )
            return
        if self._orphan is not None:
            self._judge_orphan(link)
        if event is None:
            self._orphan = link
            return
        expected_previous = 0 if self.head is None else self.head.position
        if link.previous == expected_previous:
            prior: Link | None = self.head
        elif link.previous == 0:
            prior = None  # it claims to be the first link
        else:
            prior = self._link_at(link.previous)
            if prior is None:
                self._missing(position, link, expected_previous)
                self._advance(link)  # resynchronised: the next link is checked against it
                return
            if link.previous > position:
                self._stray(prior, f"the link of the event at position {position} follows it")
        expected = self.chain.digest(prior, event)
        if not hmac.compare_digest(expected, link.digest):
            what = "its stored fields or its link were changed"
            if link.previous != expected_previous:
                what += f"; checked against the link it names, at position {link.previous}"
            self.findings.append(
                Finding(position, "edited", f"digest mismatch: the event differs ({what})")
            )
        elif link.previous < expected_previous:
            self.findings.append(
                Finding(
                    position,
                    "edited",
                    f"its link follows position {link.previous}, not the link before it at "
                    f"position {expected_previous} (links reordered or forked)",
                )
            )
        self._advance(link)

    def finish(self) -> None:
        """After the log: judge a link without its event at the end."""
        if self._orphan is not None:
            self._judge_orphan(None)

    def _judge_orphan(self, following: Link | None) -> None:
        """A link without its event, judged by the link that follows it (None: none)."""
        orphan, self._orphan = self._orphan, None
        assert orphan is not None
        continues = orphan.previous == (0 if self.head is None else self.head.position)
        if (following is not None and following.previous == orphan.position) or (
            following is None and continues and orphan.position not in self._strays
        ):
            detail = "a chain link without its event (event deleted)"
            if following is None:
                detail = "a chain link without its event at the end of the log (event deleted)"
            self.findings.append(Finding(orphan.position, "deleted", detail))
            self._advance(orphan)
            return
        self._stray(orphan, "no later link follows it")

    def _stray(self, link: Link, why: str) -> None:
        if link.position in self._strays:
            return
        self._strays.add(link.position)
        self._seen(link)
        self.findings.append(
            Finding(
                link.position,
                "stray-link",
                f"a chain link at position {link.position} (following position "
                f"{link.previous}) with no event at that position: {why} (a link inserted; "
                "every later event is still checked against its own link)",
            )
        )

    def _missing(self, position: int, link: Link, expected_previous: int) -> None:
        if self.head is None:
            detail = (
                f"the first link follows position {link.previous}, which is missing "
                "(the start of the chain was deleted)"
            )
        else:
            detail = (
                f"the link at position {position} follows position {link.previous}, "
                f"which is missing (events deleted after position {expected_previous})"
            )
        self.findings.append(Finding(link.previous, "deleted", detail))

    def _link_at(self, position: int) -> Link | None:
        if position not in self._looked_up:
            if len(self._looked_up) > 1024:  # a few planted links, or a rewritten chain
                self._looked_up.clear()
            self._looked_up[position] = self.lookup(position)
        return self._looked_up[position]

    def _advance(self, link: Link) -> None:
        self.links_checked += 1
        self.head = link
        self._seen(link)

    def _seen(self, link: Link) -> None:
        """A stored link, for :meth:`check` (a checkpoint may name any stored link)."""
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
