"""The forged writes of the insider phase (:mod:`.insider`): events and snapshots encoded
as the application encodes them (its mapper), sent as the application role through the
owner's save functions, and one snapshot row planted with the owner's write access."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
from eventsourcing.domain import Snapshot
from eventsourcing.persistence import StoredEvent
from psycopg.sql import SQL, Identifier

from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import DRAIN_PHASE_DRAINING, Capacity
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.store.roles import PREFIX

WRITER = "insider-writer"  # a runner of the phase's own, written while the lock is held
APPEND = SQL("SELECT appended FROM {}(%s::uuid[], %s::bigint[], %s::text[], %s::bytea[], %s)")
APPEND_WITH_SNAPSHOTS = SQL(
    "SELECT appended FROM {}(%s::uuid[], %s::bigint[], %s::text[], %s::bytea[], %s, "
    "%s::uuid[], %s::bigint[], %s::text[], %s::bytea[])"
)


def arrays(stored: list[StoredEvent]) -> list[Any]:
    return [
        [s.originator_id for s in stored],
        [s.originator_version for s in stored],
        [s.topic for s in stored],
        [s.state for s in stored],
    ]


def folded(app: SchedulerApplication, stream: UUID) -> Any:
    """The aggregate of ``stream`` folded from its events alone (no snapshot, no cache)."""
    aggregate: Any = None
    for event in app.events.get(stream):
        aggregate = event.mutate(aggregate)  # type: ignore[attr-defined]
    return aggregate


def forged_state(runner: Runner) -> Any:
    """A copy of ``runner`` with nothing reserved and a thousand times the room."""
    forged: Any = copy.deepcopy(runner)
    forged.reserved = dict.fromkeys(Capacity.DIMENSIONS, 0)
    forged.reservations = {}
    forged.allocatable = {dim: amount * 1000 + 1 for dim, amount in runner.allocatable.items()}
    return forged


class Forger:
    """Writes as the application role on ``conn`` (autocommit), encoded by ``app``."""

    def __init__(
        self, app: SchedulerApplication, conn: psycopg.Connection[Any], runner_ids: list[str]
    ) -> None:
        self.app = app
        self.conn = conn
        self.runner_ids = runner_ids
        self.append_sql = APPEND.format(Identifier(PREFIX + "events_append"))
        self.with_snapshots_sql = APPEND_WITH_SNAPSHOTS.format(
            Identifier(PREFIX + "events_append_with_snapshots")
        )

    def _version(self, stream: UUID) -> int:
        latest = list(self.app.events.get(stream, desc=True, limit=1))
        return latest[0].originator_version if latest else 0

    def stored_heartbeat(
        self, runner_id: str, ahead: timedelta, event_time_ahead: bool = False
    ) -> StoredEvent:
        stream = lease_uuid(runner_id)
        now = self.app.now()
        event = RunnerLease.LivenessRenewed(  # type: ignore[call-arg]
            originator_id=stream, originator_version=self._version(stream) + 1,
            timestamp=now + ahead if event_time_ahead else now, at=now + ahead,
        )  # fmt: skip
        return self.app.mapper.to_stored_event(event)

    def append(
        self, stored: list[StoredEvent], connection: psycopg.Connection[Any] | None = None
    ) -> list[int]:
        rows = (
            (connection or self.conn)
            .execute(self.append_sql, [*arrays(stored), "2000ms"])
            .fetchall()
        )
        return [int(row[0]) for row in rows]

    def append_heartbeat(
        self,
        runner_id: str,
        ahead: timedelta,
        event_time_ahead: bool,
        connection: psycopg.Connection[Any] | None = None,
    ) -> int:
        """A heartbeat ``ahead`` of the clock appended through ``<events>_append``."""
        return self.append([self.stored_heartbeat(runner_id, ahead, event_time_ahead)], connection)[
            0
        ]

    def forged_runner_snapshot(self, runner_id: str, version: int | None = None) -> StoredEvent:
        """A snapshot of ``runner_id`` as it stands, with nothing reserved (at ``version``)."""
        runner: Any = folded(self.app, runner_uuid(runner_id))
        forged = forged_state(runner)
        if version is not None:
            forged._version = version
        return self.app.mapper.to_stored_event(Snapshot.take(forged))

    def append_drain_round_trip(self, runner_id: str, snapshot_at_event: bool) -> list[int]:
        """A drain started and cancelled (or cancelled and started again: the runner ends
        as it was) through ``<events>_append_with_snapshots``, with a snapshot of a
        forged state at the last event of the call, or at a version past the call's."""
        runner: Any = folded(self.app, runner_uuid(runner_id))
        now = self.app.now()
        if runner.drain_phase == DRAIN_PHASE_DRAINING:
            runner.cancel_drain(now)
            runner.start_drain(now)
        else:
            runner.start_drain(now)
            runner.cancel_drain(now)
        stored = [self.app.mapper.to_stored_event(e) for e in runner.collect_events()]
        forged = forged_state(runner)
        if not snapshot_at_event:
            forged._version = runner.version + 5
        snapshot = self.app.mapper.to_stored_event(Snapshot.take(forged))
        rows = self.conn.execute(
            self.with_snapshots_sql, [*arrays(stored), "2000ms", *arrays([snapshot])]
        ).fetchall()
        return [int(row[0]) for row in rows]


class OwnerForgery:
    """With the owner's INSERT on the snapshots table: a forged snapshot row (no seal) at
    a runner's latest event. A fresh application must load the runner as the fold of its
    events (the snapshot refused on load), and ``audit verify`` must report it."""

    def __init__(self, url: str, app: SchedulerApplication, runner_ids: list[str]) -> None:
        self.url = url
        self.app = app
        self.runner_ids = runner_ids

    def plant(self) -> tuple[int, bool, str]:
        """(position of the event at the snapshot's version, loaded honestly, runner)."""
        forger = Forger(self.app, None, self.runner_ids)  # type: ignore[arg-type]
        with psycopg.connect(self.url, autocommit=True) as owner:
            for runner_id in self.runner_ids:
                stream = runner_uuid(runner_id)
                snapshot = forger.forged_runner_snapshot(runner_id)
                inserted = owner.execute(
                    SQL("INSERT INTO {} (originator_id, originator_version, topic, state) "
                        "VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING").format(
                        Identifier(PREFIX + "snapshots")),
                    (stream, snapshot.originator_version, snapshot.topic, snapshot.state),
                ).rowcount  # fmt: skip
                if inserted != 1:
                    continue
                row = owner.execute(
                    SQL("SELECT notification_id FROM {} WHERE originator_id = %s AND "
                        "originator_version = %s").format(Identifier(PREFIX + "events")),
                    (stream, snapshot.originator_version),
                ).fetchone()  # fmt: skip
                assert row is not None
                return int(row[0]), self.loads_honestly(runner_id), runner_id
        raise LookupError("every runner has a snapshot at its latest version")

    def loads_honestly(self, runner_id: str) -> bool:
        fresh = SchedulerApplication(
            env={"SECONDBOX_DATABASE_URL": self.url, "SECONDBOX_READ_MODELS": "external"}
        )
        try:
            loaded: Any = fresh.repository.get(runner_uuid(runner_id))
            honest: Any = folded(fresh, runner_uuid(runner_id))
            return bool(
                loaded.reserved == honest.reserved and loaded.allocatable == honest.allocatable
            )
        finally:
            fresh.close()
