"""Every stored snapshot checked against the events it covers, for ``audit verify``.

:class:`SnapshotCheck` is fed the decoded events in log order by the verification
(:mod:`.verify`): it refolds each stream that has snapshots up to their versions and
compares each snapshot's seal (the chain digest at its version) and state with what the
events make of the aggregate there.

It streams: it reads every snapshot's key once (stream, version, the position of its
event, the size of its state: a few numbers each, in arrays), and before each page of
the log (:meth:`SnapshotCheck.page`) takes the keys of the snapshots at that page's
events; their states are read as the events reach them, a chunk of at most
``STATE_CHUNK_BYTES`` at a time (on PostgreSQL the next chunk is read meanwhile, in a
thread). It holds one chunk of states (two on PostgreSQL) and the aggregates being
refolded, never the whole snapshots table (which grows faster than the log: a runner
snapshotted every tenth event stores all its live reservations each time). A snapshot
whose state is byte for byte the encoding of the refolded aggregate (its timestamp
aside) is equal without being decoded; any other is decoded and compared as before.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from uuid import UUID

from eventsourcing.persistence import StoredEvent
from eventsourcing.utils import resolve_topic

from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.store.chain_reads import (
    SnapshotRow,
    snapshot_index,
    snapshot_rows,
)
from secondbox_scheduler.infrastructure.store.sealed_postgres import SealedPostgresSnapshots
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots

STATE_CHUNK_BYTES = 8 << 20  # snapshot states read (and held) at once, about at most
STATE_CHUNK_ROWS = 256
_TIMESTAMP = b'{"timestamp":'
_AFTER_TIMESTAMP = b',"topic":'  # a snapshot's state: its timestamp, then its topic


class SnapshotCheck:
    """Every stored snapshot against the events it covers: its seal (the chain digest at
    its version) and its state (the aggregate refolded from the events up to there)."""

    def __init__(self, app: SchedulerApplication) -> None:
        self.app = app
        self.checked = 0
        self.violations: list[Violation] = []
        recorder = app.snapshots.recorder if app.snapshots is not None else None
        self.recorder = recorder
        self.sealed = isinstance(recorder, SealedSnapshots)
        self.last: dict[Any, int] = {}  # the last snapshot version of each stream
        self.streams: list[UUID] = []  # the streams with snapshots, by number
        numbers: dict[UUID, int] = {}
        # in order of stream and version: those whose event is at no position of the log
        self.outside: list[tuple[UUID, int, int]] = []
        positions, numbers_of, versions, sizes = (array("q") for _ in range(4))
        for stream, version, position, size in snapshot_index(recorder):
            self.last[stream] = max(self.last.get(stream, 0), version)
            if not position or position < 1:
                self.outside.append((stream, version, position or 0))
                continue
            number = numbers.get(stream)
            if number is None:
                number = numbers[stream] = len(self.streams)
                self.streams.append(stream)
            positions.append(position)
            numbers_of.append(number)
            versions.append(version)
            sizes.append(size)
        # the others, in log order: four numbers each (no row kept: the index grows with
        # the log, a snapshot every tenth event of a stream)
        order = sorted(range(len(positions)), key=positions.__getitem__)
        self.positions = array("q", (positions[i] for i in order))
        self.numbers = array("q", (numbers_of[i] for i in order))
        self.versions = array("q", (versions[i] for i in order))
        self.sizes = array("q", (sizes[i] for i in order))
        del order, positions, numbers_of, versions, sizes
        self.window = range(0)  # the current page's snapshots (indexes of the arrays)
        self.pending: dict[tuple[Any, int], int] = {}  # theirs not reached yet: index
        self.rows: dict[tuple[Any, int], SnapshotRow] = {}  # the chunk read
        self.left: list[tuple[UUID, int, int]] = []  # pages' snapshots never reached
        self.read_until = 0
        self.aggregates: dict[Any, Any] = {}
        self.broken: set[Any] = set()
        self.decoded = 0  # snapshots compared by decoding them (not equal byte for byte)
        # PostgreSQL: the chunk after the one just read, read meanwhile in a thread (the
        # query waits on the server: a fifth of a verify's time there); two chunks held
        self.prefetch = isinstance(recorder, SealedPostgresSnapshots)
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future[dict[tuple[Any, int], SnapshotRow]]] | None = None
        mapper = app.mapper
        self._bytes_equal = mapper.compressor is None and mapper.cipher is None

    def _key(self, index: int) -> tuple[UUID, int]:
        return self.streams[self.numbers[index]], self.versions[index]

    def page(self, after: int, upto: int) -> None:
        """Before the events of positions ``after`` (exclusive) to ``upto``: the
        snapshots taken at them."""
        self._leave()
        self.read_until = max(self.read_until, upto)
        positions = self.positions
        self.window = range(bisect_right(positions, after), bisect_right(positions, upto))
        self.pending = {self._key(index): index for index in self.window}

    def _leave(self) -> None:
        """The snapshots of the page just passed whose event was not folded (its stream
        broken, the event unreadable): reported by :meth:`finish`."""
        self.left += [(*key, self.positions[index]) for key, index in self.pending.items()]
        self.pending, self.rows = {}, {}
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].result()  # not used: the next chunk read starts elsewhere

    def apply(self, event: Any) -> None:
        stream = event.originator_id
        if stream not in self.last:
            return
        try:
            self.aggregates[stream] = event.mutate(self.aggregates.get(stream))
        except Exception:  # a tampered history; the chain names it
            self.aggregates.pop(stream, None)
            self.last.pop(stream, None)
            self.broken.add(stream)
            return
        version = event.originator_version
        index = self.pending.pop((stream, version), None)
        if index is not None:
            row = self._row((stream, version), index)
            if row is None:  # gone since the keys were read
                self.left.append((stream, version, self.positions[index]))
            else:
                self._compare(row, self.positions[index], self.aggregates[stream])
        if version >= self.last[stream]:
            self.aggregates.pop(stream, None)
            self.last.pop(stream, None)

    def _row(self, key: tuple[UUID, int], index: int) -> SnapshotRow | None:
        """The snapshot at ``key``, reading the chunk of this page's snapshots that
        starts there when it is not read yet."""
        row = self.rows.pop(key, None)
        if row is not None:
            return row
        keys = self._chunk(index)
        ahead = self._ahead
        if ahead is not None and ahead[0] == index:  # the chunk read ahead: this one
            self._ahead = None
            self.rows = ahead[1].result()
        else:
            self._drop_ahead()
            self.rows = snapshot_rows(self.recorder, keys)
        following = index + len(keys)
        if self.prefetch and following < self.window.stop:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="snapshot-read-ahead")
            chunk = self._chunk(following)
            self._ahead = (following, self._reader.submit(snapshot_rows, self.recorder, chunk))
        return self.rows.pop(key, None)

    def _chunk(self, index: int) -> list[tuple[UUID, int]]:
        """The keys of the chunk of this page's snapshots that starts at ``index``."""
        keys, size = [self._key(index)], self.sizes[index]
        for later in range(index + 1, self.window.stop):
            if size >= STATE_CHUNK_BYTES or len(keys) >= STATE_CHUNK_ROWS:
                break
            keys.append(self._key(later))
            size += self.sizes[later]
        return keys

    def _violation(self, stored: Any, position: int, detail: str) -> None:
        self.violations.append(
            Violation(
                position,
                str(stored.originator_id),
                f"snapshot v{stored.originator_version}",
                "snapshot",
                detail,
            )
        )

    def _compare(self, row: SnapshotRow, position: int, aggregate: Any) -> None:
        stored, seal, digest = row
        self.checked += 1
        if self.sealed and digest is not None:
            reason = self.app.snapshots.recorder.refusal(stored, seal, digest)  # type: ignore[union-attr]
            if reason:
                self._violation(stored, position, reason)
                return
        if self._equal_bytes(stored, aggregate):
            return
        self.decoded += 1
        mapper = self.app.mapper
        try:
            taken: Any = mapper.to_domain_event(stored)
            snapshot_class = type(taken)
            # both through the aggregate (a snapshot of an older class version is upcast
            # there), then taken and transcoded alike
            kept: Any = mapper.to_domain_event(
                mapper.to_stored_event(snapshot_class.take(taken.mutate(None)))
            )
            fresh: Any = mapper.to_domain_event(
                mapper.to_stored_event(snapshot_class.take(aggregate))
            )
        except Exception as error:
            self._violation(stored, position, f"cannot be read ({type(error).__name__})")
            return
        if kept.state != fresh.state:
            differ = sorted(
                k for k in kept.state.keys() | fresh.state.keys()
                if kept.state.get(k) != fresh.state.get(k)
            )  # fmt: skip
            self._violation(
                stored,
                position,
                f"its state differs from the events up to its version ({', '.join(differ)})",
            )

    def _equal_bytes(self, stored: StoredEvent, aggregate: Any) -> bool:
        """Whether the stored state is the encoding of the refolded aggregate taken as a
        snapshot of the stored class, byte for byte after its timestamp (the time it
        was taken, which the comparison leaves out). Equal bytes decode to equal
        states; anything else (another spelling, an older class version, a compressor
        or a cipher) is left to the decoding comparison."""
        if not self._bytes_equal or not stored.state.startswith(_TIMESTAMP):
            return False
        try:
            snapshot_class: Any = resolve_topic(stored.topic)
            fresh = self.app.mapper.to_stored_event(snapshot_class.take(aggregate))
        except Exception:
            return False
        if fresh.topic != stored.topic or not fresh.state.startswith(_TIMESTAMP):
            return False
        mine, theirs = fresh.state, stored.state
        here, there = mine.find(_AFTER_TIMESTAMP), theirs.find(_AFTER_TIMESTAMP)
        return (
            here > 0
            and there > 0
            and len(mine) - here == len(theirs) - there
            and mine[here:] == theirs[there:]
        )

    def finish(self, stop: int | None, end: int) -> None:
        self._leave()
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None
        beyond = bisect_right(self.positions, self.read_until)  # pages never read
        never = [(*self._key(i), self.positions[i]) for i in range(beyond, len(self.positions))]
        # as the index orders them (stream, version); the violations are sorted by
        # position, and only those outside the log can share one
        unchecked = sorted(self.left + never) + self.outside
        self.left = []
        orphans = [s for s in unchecked if not s[2]]
        if len(orphans) > 3:  # the log was cut short under its snapshots
            self.checked += len(orphans)
            self.violations.append(
                Violation(end + 1, "-", "snapshots", "snapshot",
                          f"{len(orphans)} snapshots have no event at their version "
                          "(events deleted or the log truncated)")
            )  # fmt: skip
            unchecked = [s for s in unchecked if s[2]]
        for originator_id, version, position in unchecked:
            if stop is None or position <= stop:
                self.checked += 1
                stored = StoredEvent(originator_id, version, "", b"")
                broken = originator_id in self.broken
                self._violation(
                    stored,
                    position,
                    "cannot be checked: the events of its stream do not fold up to its version"
                    if broken
                    else "no event at its version",
                )
