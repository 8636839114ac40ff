"""The audit fold's plain state, and the violations it reports.

What the fold (:mod:`secondbox_scheduler.domain.audit.fold`) keeps of each aggregate
(:class:`RunnerState`, :class:`LeaseState`, :class:`SandboxState`, one :class:`Stream`
per originator id), the first part of a transaction waiting for the next
(:class:`Pending`), and :class:`FoldState`: all of it together, with the means every
check shares (the current event's stream, a violation reported there, the capacity each
runner is owed). Dictionaries and dataclasses written event by event: no aggregate, no
cache, no projection.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.limits import MAX_CLOCK_TOLERANCE
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    Capacity,
    MaterializationSnapshot,
    Requirements,
)

DIMENSIONS = Capacity.DIMENSIONS
SNAPSHOTS_CACHED = 4  # lease versions whose materializations are kept as value objects
# A lease version is kept while it is among the last LEASE_VERSIONS_KEPT, or for
# LEASE_WINDOW after the lease left it (its next version's recording time): what a
# placement's evidence may name (docs/audit.md, "What verify holds").
LEASE_VERSIONS_KEPT = 8
LEASE_WINDOW = 3 * MAX_CLOCK_TOLERANCE
TOKEN_DIGEST = 16  # bytes of a fencing token's SHA-256 kept per generation
REQUIREMENTS_KEPT = 1024  # distinct requirement records whose validation the fold keeps


@dataclass(frozen=True)
class Violation:
    position: int
    aggregate: str
    event: str
    rule: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "aggregate": self.aggregate,
            "event": self.event,
            "rule": self.rule,
            "detail": self.detail,
        }

    def __str__(self) -> str:
        return f"#{self.position} {self.aggregate} {self.event}: {self.rule}: {self.detail}"


@dataclass
class RunnerState:
    runner_id: str
    pool_name: str
    backend_kind: str
    architecture: str
    capabilities: list[str]
    allocatable: dict[str, int]
    supported_egress_contexts: list[str]
    guest_protocol_minimum: int
    guest_protocol_maximum: int
    reserved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMENSIONS, 0))
    reservations: dict[str, dict[str, int]] = field(default_factory=dict)
    drain_phase: str = DRAIN_PHASE_ACTIVE
    deregistered: bool = False
    version: int = 1
    checked: tuple[str, ...] = ()  # checked_dimensions(capabilities), set at registration
    # the capabilities as a placement's evidence records them (sorted, each once), when
    # each is a name a RunnerSnapshot takes as it is (else None: evidence is validated)
    listed: list[str] | None = None


@dataclass
class LeaseState:
    runner_id: str
    last_heartbeat_at: datetime | None = None
    artifact_digests: list[str] = field(default_factory=list)
    materializations: list[dict[str, str]] = field(default_factory=list)
    version: int = 1
    # by version: (heartbeat, digests, materializations, recorded at, plain lists), the
    # recent ones
    history: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    snapshots: dict[int, tuple[MaterializationSnapshot, ...]] = field(default_factory=dict)
    forgotten: int = 0  # the versions up to this one are no longer kept
    plain_lists: bool = True  # the lists are as a trusted record keeps them (evidence.py)
    heartbeat_text: tuple[int, Any] | None = None  # the last evidence heartbeat taken as is

    def at_version(self, version: int) -> tuple[Any, ...]:
        entry = self.history.get(version)
        return (None, [], []) if entry is None else entry[:3]

    def record(self, version: int, recorded_at: datetime, window: timedelta) -> None:
        """Keep the lease as it is at ``version`` (recorded at ``recorded_at``), and
        forget the versions it left more than ``window`` before then (the last
        ``LEASE_VERSIONS_KEPT`` stay): the history held is bounded by the heartbeat
        rate, not by the length of the log."""
        history = self.history
        # The lists are shared, not copied: the fold replaces them, never mutates them.
        history[version] = (
            self.last_heartbeat_at, self.artifact_digests, self.materializations, recorded_at,
            self.plain_lists,
        )  # fmt: skip
        self.snapshots.pop(version, None)
        if self.heartbeat_text is not None and self.heartbeat_text[0] == version:
            self.heartbeat_text = None  # a version recorded again (a tampered stream)
        horizon = recorded_at - window
        while len(history) > LEASE_VERSIONS_KEPT:
            oldest = next(iter(history))
            after = history.get(oldest + 1)
            if after is not None and after[3] >= horizon:
                break
            del history[oldest]
            self.snapshots.pop(oldest, None)
            self.forgotten = max(self.forgotten, oldest)

    def materializations_at(self, version: int) -> tuple[MaterializationSnapshot, ...]:
        """The lease's materializations at ``version`` as value objects (cached: the
        fold replaces a lease's lists on each event and never changes them in place)."""
        items = self.snapshots.get(version)
        if items is None:
            _, _, materializations = self.at_version(version)
            items = tuple(MaterializationSnapshot.from_record(m) for m in materializations)
            if len(self.snapshots) >= SNAPSHOTS_CACHED:  # the oldest out: a placement's
                del self.snapshots[next(iter(self.snapshots))]  # evidence names a recent one
            self.snapshots[version] = items
        return items


class TokenDigests:
    """The fencing tokens a sandbox has used, 16 bytes of each token's SHA-256 in one
    byte string: what the check of a reused token needs, 16 bytes per generation."""

    __slots__ = ("_digests",)

    def __init__(self) -> None:
        self._digests = bytearray()

    @staticmethod
    def digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()[:TOKEN_DIGEST]

    def __contains__(self, token: str) -> bool:
        return self.holds(self.digest(token))

    def holds(self, wanted: bytes) -> bool:
        """Whether a token of this digest (:meth:`digest`) was used."""
        digests = self._digests
        at = digests.find(wanted)
        while at >= 0 and at % TOKEN_DIGEST:  # only whole digests count
            at = digests.find(wanted, at + 1)
        return at >= 0

    def add(self, token: str) -> None:
        self.add_digest(self.digest(token))

    def add_digest(self, digest: bytes) -> None:
        self._digests += digest

    def __len__(self) -> int:
        return len(self._digests) // TOKEN_DIGEST


@dataclass
class SandboxState:
    sandbox_id: str
    workspace_id: str
    profile_revision_id: str
    requirements: dict[str, Any]
    home_runner_id: str
    generation: int = 1
    # by generation; a compact fold drops a past generation released as it should be
    # (on its home runner, its pinned capacity: see SandboxChecks._past)
    assignments: dict[int, dict[str, Any]] = field(default_factory=dict)
    tokens: TokenDigests = field(default_factory=TokenDigests)
    pinned: Requirements | None = None  # Requirements.from_record(requirements), cached
    # a compact fold's past generations it holds no record of (released as they should
    # be): ranges, one for generations left one after another
    dropped: list[range] = field(default_factory=list)

    def drop(self, generation: int) -> None:
        last = self.dropped[-1] if self.dropped else None
        if last is not None and last.stop == generation:
            self.dropped[-1] = range(last.start, generation + 1)
        else:
            self.dropped.append(range(generation, generation + 1))

    def was_dropped(self, generation: int) -> bool:
        return any(generation in part for part in self.dropped)


class Stream:
    """What the fold holds for one originator id (looked up once per event)."""

    __slots__ = ("lease", "runner", "sandbox")

    def __init__(self) -> None:
        self.runner: RunnerState | None = None
        self.lease: LeaseState | None = None
        self.sandbox: SandboxState | None = None


NO_STREAM = Stream()  # never written: what FoldState._of returns for an unknown stream
ZERO: dict[str, int] = dict.fromkeys(DIMENSIONS, 0)  # never mutated


@dataclass
class Pending:
    """The first part of a transaction of several aggregates, waiting for the next part:
    a fence's reservation ("reserve"), then its token index ("token"); a release's
    capacity release ("release")."""

    kind: str  # "reserve", "token" or "release"
    position: int
    sandbox_id: str
    generation: int
    runner_id: str
    capacity: dict[str, int]
    token_sha256: str | None = None  # of a fence that saved a token index


WANTED = {"reserve": "CapacityReserved", "release": "CapacityReleased", "token": "Used"}


class FoldState:
    """Everything the audit fold holds, and the means its checks share: the base of the
    runner side (:mod:`~secondbox_scheduler.domain.audit.runner_checks`) and the sandbox
    side (:mod:`~secondbox_scheduler.domain.audit.sandbox_checks`) of the fold."""

    # A recorded caller time (a heartbeat's ``at``, a placement's ``decided_at``) may
    # differ from the scheduler's clock by at most the largest tolerance it accepts.
    MAX_CLOCK_SKEW = MAX_CLOCK_TOLERANCE

    def __init__(self) -> None:
        self.runner_streams: dict[str, UUID] = {}
        self.lease_of: dict[str, UUID] = {}
        self.sandbox_streams: dict[str, UUID] = {}
        self.refusals: dict[str, list[dict[str, Any]]] = {}
        self.owed: dict[str, dict[str, int]] = {}  # unreleased assignments' capacity by runner
        self.violations: list[Violation] = []
        self._current: Any = None
        self._streams: dict[UUID, Stream] = {}  # every aggregate's state, by stream id
        # the same entries by the id's number (a UUID's hash and equality are Python
        # calls, an int's are not), filled as they are looked up: not part of a saved
        # fold state (rebuilt from _streams after a restore)
        self._numbered: dict[int, Stream] = {}
        self._stream: Stream | None = None  # the current event's
        self._names: dict[type[Any], tuple[str, str]] = {}
        self.pending: Pending | None = None
        self.compact = False  # see AuditFold
        self._capacities: dict[tuple[Any, ...], dict[str, int]] = {}  # compact records'
        # requirement records validated, by their marshal bytes (SandboxChecks._pinned)
        self._requirements_seen: dict[bytes, Requirements] = {}
        self.position = 0
        self.events = 0

    def _violate(self, rule: str, detail: str) -> None:
        self._violate_at(self.position, self._current, self._stream, rule, detail)

    def _violate_at(
        self, position: int, event: Any, stream: Stream | None, rule: str, detail: str
    ) -> None:
        """A violation at ``position``, named by its event and the stream it is in."""
        names = self._names.get(type(event))
        if names is None:
            name = type(event).__qualname__
            names = self._names[type(event)] = (name, name.split(".")[0])
        runner = stream.runner if stream else None
        lease = stream.lease if stream else None
        sandbox = stream.sandbox if stream else None
        label = (
            runner.runner_id if runner else lease.runner_id if lease
            else sandbox.sandbox_id if sandbox else str(event.originator_id)
        )  # fmt: skip
        self.violations.append(Violation(position, f"{names[1]} {label}", names[0], rule, detail))

    def _entry(self, stream_id: Any) -> Stream | None:
        """The state of stream ``stream_id`` (None: none yet), looked up by the id's
        number when it is a UUID (:attr:`_numbered`, filled from :attr:`_streams`)."""
        if type(stream_id) is not UUID:
            return self._streams.get(stream_id)
        number = stream_id.int
        stream = self._numbered.get(number)
        if stream is None:
            stream = self._streams.get(stream_id)
            if stream is not None:
                self._numbered[number] = stream
        return stream

    def _of(self, stream_id: UUID | None) -> Stream:
        """The state of a stream named by an index (empty when there is none)."""
        stream = self._entry(stream_id) if stream_id is not None else None
        return stream if stream is not None else NO_STREAM

    def _enter(self, stream_id: UUID) -> Stream:
        """The current event's stream entry (``stream_id`` its originator id, whose entry
        ``AuditFold.apply`` looked up), created for an aggregate's first event."""
        stream = self._stream
        if stream is None:
            stream = self._stream = self._streams[stream_id] = Stream()
        return stream

    def _owe(self, runner_id: str, capacity: dict[str, int], sign: int) -> None:
        owed = self.owed.get(runner_id)
        if owed is None:
            owed = self.owed[runner_id] = dict(ZERO)
        for dim in DIMENSIONS:
            owed[dim] += sign * capacity[dim]
