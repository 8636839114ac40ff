"""The RunnerLease aggregate: a runner's liveness and artifact evidence.

A runner's heartbeats are kept in a stream of their own, apart from the Runner's
capacity ledger (as Kubernetes keeps node Leases apart from Node objects): a
heartbeat never conflicts with a placement, and a placement never makes a heartbeat
retry. A placement reads the lease, records the lease version and the liveness it
relied on, and writes only the Runner and Sandbox streams.

Evidence changes (artifact digests, materializations) are always recorded. Plain
liveness renewals are coalesced: one is recorded only when at least
``renewal_interval`` has passed since the last recorded one, so the stream grows
by at most one event per interval however often the runner beats.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from eventsourcing.domain import Aggregate

from secondbox_scheduler.domain.actors import ActedEvent
from secondbox_scheduler.domain.ids import lease_uuid
from secondbox_scheduler.domain.records import MaterializationRecord
from secondbox_scheduler.domain.values import MaterializationSnapshot, trusted

OBSERVED_STALE = "stale"  # older than the last recorded heartbeat
OBSERVED_COALESCED = "coalesced"  # fresh, same evidence, within the renewal interval
OBSERVED_RENEWED = "renewed"  # liveness renewal recorded
OBSERVED_EVIDENCE = "evidence"  # evidence change recorded


class RunnerLease(Aggregate):
    """Latest recorded liveness and evidence of one runner."""

    class Event(ActedEvent):
        """Every event records its actor (domain/actors.py)."""

    class Opened(Aggregate.Created):
        runner_id: str

    def __init__(self, runner_id: str) -> None:
        self.runner_id = runner_id
        self.last_heartbeat_at: datetime | None = None
        self.artifact_digests: list[str] = []
        self.materializations: list[MaterializationRecord] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> RunnerLease:
        """The copy a command works on: events replace the lists, never change them in
        place, so the copy shares them."""
        clone = copy.copy(self)
        clone._pending_events = list(self._pending_events)
        memo[id(self)] = clone
        return clone

    @classmethod
    def open(cls, runner_id: str, at: datetime) -> RunnerLease:
        return cls._create(cls.Opened, id=lease_uuid(runner_id), timestamp=at, runner_id=runner_id)

    class LivenessRenewed(Aggregate.Event):
        at: datetime

        def apply(self, lease: RunnerLease) -> None:
            lease.last_heartbeat_at = self.at

    class EvidenceRecorded(Aggregate.Event):
        at: datetime
        artifact_digests: list[str]
        materializations: list[MaterializationRecord]

        def apply(self, lease: RunnerLease) -> None:
            lease.last_heartbeat_at = self.at
            lease.artifact_digests = list(self.artifact_digests)
            lease.materializations = [item.copy() for item in self.materializations]

    def observe(
        self,
        *,
        at: datetime,
        artifact_digests: Sequence[str],
        materializations: Sequence[MaterializationSnapshot],
        renewal_interval: timedelta,
        recorded_at: datetime,
    ) -> str:
        """Take one heartbeat; say whether it was stale, coalesced or recorded."""
        last = self.last_heartbeat_at
        if last is not None and at < last:
            return OBSERVED_STALE
        digests = list(artifact_digests)
        items: list[dict[str, Any]] = [item.to_record() for item in materializations]
        if digests != self.artifact_digests or items != self.materializations:
            self.trigger_event(
                self.EvidenceRecorded,
                timestamp=recorded_at,
                at=at,
                artifact_digests=digests,
                materializations=items,
            )
            return OBSERVED_EVIDENCE
        if last is not None and at - last < renewal_interval:
            return OBSERVED_COALESCED
        self.trigger_event(self.LivenessRenewed, timestamp=recorded_at, at=at)
        return OBSERVED_RENEWED


def materialization_snapshots(
    records: Sequence[MaterializationRecord | Mapping[str, str]],
) -> tuple[MaterializationSnapshot, ...]:
    """Recorded materializations as value objects (trusted: no validation)."""
    return tuple(
        trusted(  # every field, in the model's order (``model_construct``)
            MaterializationSnapshot,
            {
                "backend_kind": item["backend_kind"],
                "architecture": item["architecture"],
                "runtime_digest": item["runtime_digest"],
                "toolchain_digest": item["toolchain_digest"],
                "digest": item["digest"],
            },
        )
        for item in records
    )
