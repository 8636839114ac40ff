"""The Merkle tree over the notification log (RFC 9162, section 2.1), pure.

Hashing is RFC 9162's: a leaf's hash is ``SHA-256(0x00 || leaf data)``, an interior
node's ``SHA-256(0x01 || left || right)``, the tree of ``n`` leaves is split at the
largest power of two below ``n``. Leaf ``i`` is the notification at position ``i + 1``;
its leaf data (:func:`leaf_data`) is a canonical byte string of the stored row
(docs/audit.md, "Merkle tree"):

=====================  ======================================================
bytes                  what
=====================  ======================================================
17                     ``secondbox-leaf-v1`` (ASCII)
8                      the position, unsigned big-endian
1                      ``0x01``: an event is stored there; ``0x00``: none (a
                       position the database's sequence skipped; nothing follows)
16                     the originator id (the UUID's 16 bytes, RFC 4122 order)
8                      the originator version, unsigned big-endian
8 + t                  the topic's length in bytes (big-endian), then its UTF-8
8 + s                  the stored state's length in bytes, then the state as
                       stored (the row's ``state`` column, byte for byte)
=====================  ======================================================

The tree is stored as its complete subtrees (``Node``: a level and an index; level 0
holds the leaf hashes; node ``(l, j)`` covers leaves ``j * 2**l`` to
``(j + 1) * 2**l - 1``). Every range the algorithms need is split into complete
subtrees (:func:`subtrees`), so a tree head of any size and any proof read
O(log² n) stored hashes, never the log. :func:`inclusion_path` and
:func:`consistency_path` are RFC 9162's ``PATH`` and ``SUBPROOF`` (sections 2.1.3.1 and
2.1.4.1) over such a store; :func:`verify_inclusion` and :func:`verify_consistency`
its verification algorithms (sections 2.1.3.2 and 2.1.4.2). :func:`extend` computes the
new complete subtrees when leaves are appended, from the old tree's frontier alone.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping, Sequence
from uuid import UUID

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
LEAF_FORMAT = b"secondbox-leaf-v1"
EVENT = b"\x01"
NO_EVENT = b"\x00"
HASH_SIZE = 32

Node = tuple[int, int]  # (level, index): a complete subtree
NodeReader = Callable[[Iterable[Node]], Mapping[Node, bytes]]


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def leaf_data(
    position: int, originator_id: UUID | str, version: int, topic: str, state: bytes
) -> bytes:
    """The canonical leaf data of the event stored at ``position`` (module docstring)."""
    identity = originator_id if isinstance(originator_id, UUID) else UUID(str(originator_id))
    encoded = topic.encode("utf-8")
    return b"".join(
        (
            LEAF_FORMAT,
            _u64(position),
            EVENT,
            identity.bytes,
            _u64(version),
            _u64(len(encoded)),
            encoded,
            _u64(len(state)),
            bytes(state),
        )
    )


def gap_leaf_data(position: int) -> bytes:
    """The leaf data of a position that holds no event."""
    return LEAF_FORMAT + _u64(position) + NO_EVENT


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


EMPTY_ROOT = hashlib.sha256(b"").digest()  # the tree of no leaf


def _split(n: int) -> int:
    """The largest power of two smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def subtrees(start: int, end: int) -> list[Node]:
    """The complete subtrees whose hashes make ``MTH(D[start:end])``, left to right, for a
    range the algorithms ask for (``start`` a multiple of a power of two at least as
    large as the range's left part: as RFC 9162's recursion splits)."""
    found: list[Node] = []
    while end - start > 0:
        size = end - start
        part = size if size & (size - 1) == 0 else _split(size)
        level = part.bit_length() - 1
        assert start % part == 0, (start, end)
        found.append((level, start >> level))
        start += part
    return found


def _fold(hashes: Sequence[bytes]) -> bytes:
    """The hash of a range from its complete subtrees' hashes (left to right, each at
    most as large as the one before it): the right edge of the tree folds first."""
    result = hashes[-1]
    for left in reversed(hashes[:-1]):
        result = node_hash(left, result)
    return result


class Hasher:
    """``MTH`` of any range over a store of complete subtrees, with every hash a
    computation will need read in one call of ``read`` (:meth:`prefetch`)."""

    def __init__(self, read: NodeReader) -> None:
        self.read = read
        self.known: dict[Node, bytes] = {}

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        wanted = {node for start, end in ranges for node in subtrees(start, end)}
        wanted -= self.known.keys()
        if wanted:
            found = self.read(sorted(wanted))
            missing = wanted - found.keys()
            if missing:
                raise LookupError(f"the tree holds no hash for {sorted(missing)[:3]}")
            self.known.update(found)

    def mth(self, start: int, end: int) -> bytes:
        if end == start:
            return EMPTY_ROOT
        nodes = subtrees(start, end)
        missing = [n for n in nodes if n not in self.known]
        if missing:
            self.prefetch([(start, end)])
        return _fold([self.known[n] for n in nodes])


def _path_ranges(index: int, start: int, end: int) -> list[tuple[int, int]]:
    """The ranges whose hashes make ``PATH(index, D[start:end])``, leaf to root."""
    ranges: list[tuple[int, int]] = []
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
    ranges.reverse()
    return ranges


def _subproof_ranges(m: int, start: int, end: int, whole: bool) -> list[tuple[int, int]]:
    """The ranges whose hashes make ``SUBPROOF(m, D[start:end], whole)`` (RFC 9162
    2.1.4.1), in the order the proof lists them."""
    ranges: list[tuple[int, int]] = []
    while True:
        n = end - start
        if m == n:
            if not whole:
                ranges.append((start, end))
            break
        k = _split(n)
        if m <= k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
            m -= k
            whole = False
    ranges.reverse()
    return ranges


def inclusion_path(index: int, size: int, read: NodeReader) -> list[bytes]:
    """RFC 9162's inclusion proof of leaf ``index`` in the tree of ``size`` leaves."""
    if not 0 <= index < size:
        raise ValueError(f"leaf index {index} is not in a tree of {size} leaves")
    ranges = _path_ranges(index, 0, size)
    hasher = Hasher(read)
    hasher.prefetch(ranges)
    return [hasher.mth(a, b) for a, b in ranges]


def consistency_path(old_size: int, new_size: int, read: NodeReader) -> list[bytes]:
    """RFC 9162's consistency proof between the trees of ``old_size`` and ``new_size``
    leaves (empty when they are equal or the old tree is empty)."""
    if not 0 <= old_size <= new_size:
        raise ValueError(f"no consistency proof from size {old_size} to size {new_size}")
    if old_size in (0, new_size):
        return []
    ranges = _subproof_ranges(old_size, 0, new_size, True)
    hasher = Hasher(read)
    hasher.prefetch(ranges)
    return [hasher.mth(a, b) for a, b in ranges]


def root(size: int, read: NodeReader) -> bytes:
    """The tree head of the first ``size`` leaves."""
    return Hasher(read).mth(0, size)


def frontier(size: int) -> list[Node]:
    """The complete subtrees of the tree of ``size`` leaves that new leaves can join: one
    per set bit of ``size`` (the largest first)."""
    return subtrees(0, size)


def extend(
    size: int, old_frontier: Mapping[Node, bytes], leaves: Sequence[bytes]
) -> dict[Node, bytes]:
    """Every complete subtree that appending ``leaves`` (leaf hashes) to the tree of
    ``size`` leaves makes, from the old tree's :func:`frontier` alone."""
    new: dict[Node, bytes] = {(0, size + i): h for i, h in enumerate(leaves)}
    end = size + len(leaves)
    level = 1
    while (end >> level) > (size >> level):
        for j in range(size >> level, end >> level):
            left = (level - 1, 2 * j)
            right = (level - 1, 2 * j + 1)
            new[(level, j)] = node_hash(
                new[left] if left in new else old_frontier[left], new[right]
            )
        level += 1
    return new


def verify_inclusion(
    index: int, size: int, leaf: bytes, path: Sequence[bytes], root_hash: bytes
) -> bool:
    """RFC 9162 section 2.1.3.2: does ``path`` prove that ``leaf`` (its leaf hash) is
    leaf ``index`` of the tree of ``size`` leaves whose head is ``root_hash``?"""
    if not 0 <= index < size:
        return False
    fn, sn = index, size - 1
    r = leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and hmac.compare_digest(r, root_hash)


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, path: Sequence[bytes]
) -> bool:
    """RFC 9162 section 2.1.4.2: does ``path`` prove that the tree of ``new_size`` leaves
    (head ``new_root``) extends the tree of ``old_size`` leaves (head ``old_root``)?"""
    if not 0 <= old_size <= new_size:
        return False
    if old_size == new_size:
        return not path and hmac.compare_digest(old_root, new_root)
    if old_size == 0:
        return not path  # every tree extends the empty one
    if not path:
        return False
    items = list(path)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root starts the path
        items.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = items[0]
    for c in items[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and hmac.compare_digest(fr, old_root) and hmac.compare_digest(sr, new_root)


class MerkleRefold:
    """The tree head refolded leaf by leaf from the log in order (``audit verify``): the
    compact range of the tree so far (one complete subtree per set bit of its size, the
    largest first), so it holds O(log n) hashes. Positions it skips are gaps' leaves.
    ``watch``: tree sizes whose heads it keeps as it passes them (checkpoints)."""

    def __init__(self, watch: Iterable[int] = ()) -> None:
        self.size = 0
        self.stack: list[tuple[int, bytes]] = []  # (level, hash), the largest first
        self.watched: dict[int, bytes | None] = dict.fromkeys(watch)
        if 0 in self.watched:
            self.watched[0] = EMPTY_ROOT

    def _append(self, leaf: bytes) -> None:
        level, value = 0, leaf
        stack = self.stack
        while stack and stack[-1][0] == level:
            value = node_hash(stack.pop()[1], value)
            level += 1
        stack.append((level, value))
        self.size += 1
        if self.size in self.watched:
            self.watched[self.size] = self.root()

    def add(self, position: int, data: bytes) -> None:
        """The leaf of ``position`` (after the gaps before it)."""
        self.fill(position - 1)
        if position == self.size + 1:
            self._append(leaf_hash(data))

    def fill(self, size: int) -> None:
        """Gaps' leaves up to tree size ``size``."""
        while self.size < size:
            self._append(leaf_hash(gap_leaf_data(self.size + 1)))

    def root(self) -> bytes:
        if not self.stack:
            return EMPTY_ROOT
        return _fold([value for _, value in self.stack])
