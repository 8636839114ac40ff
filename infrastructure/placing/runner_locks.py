"""Advisory locks on the home runners of a placement batch (PostgreSQL).

Correctness never depends on them: every placement is still an optimistic save that
fails on a stream version a rival moved (:mod:`.placement_batch`). They are for
liveness. Replicas whose batches keep meeting on the same few runners would otherwise
lose race after race (each rival's commit invalidates the others' decisions), and a
request could exhaust its retry budget while the runner still had room: a contention
error where a serial execution would have placed it. So a batch, once it knows its
sandboxes' home runners, takes a **session-level** advisory lock per runner (in key
order, so two batches never wait for each other in a cycle) with one statement, reads
the runners, decides and commits while holding them, and releases them all with a
second statement. Batches on disjoint runners never wait; batches on the same runner
take turns, as a plan applier would commit them, and the second one decides against
the first one's commit.

A batch of the batcher does not wait for a runner another batch holds when only a few
of its requests need it: it **tries** those locks (``pg_try_advisory_lock``, one
statement for all), and the requests on a runner it did not get are deferred to the
next batch, where they go first and wait for the lock (deferred once at most). The
rest of the batch goes on at once: requests on different runners touch different
streams, so the answers stay those of a serial execution. When the busy runners hold
more than a quarter of the batch's requests (hot runners every batch needs), the batch
releases what it got and waits for all its locks in key order instead, so that
batches taking turns stay whole. A session only ever waits for locks in key order and
never while holding one it took out of order: no deadlock.

The locks live on connections of their own (a pool of at most ``LOCK_CONNECTIONS`` per
application), never on the store's pool: a batch that held one of the store's
connections while it waited for a second one to load and save would starve that pool
when as many batches ran at once as it has connections. Every failure of the locking
step is a reason to go on without the locks, never an error of the batch: no lock
connection within ``CONNECTION_WAIT``, a rival's lock not granted within ``LOCK_WAIT_MS``
per key (the locks already taken are then released before the batch goes on), a broken
session. A lock connection whose release fails or is interrupted is closed, so no
connection goes back to the pool holding a lock; a killed process's locks end with its
session. The keys are 64-bit digests of the events table's schema and name and the
runner id, so two stores in one database never share a lock. SQLite and the in-memory
store: no locks.

A batch reads its runners and leases **before** the locks (with its sandboxes' home
runners known), so that the window in which it holds them is the decision and the
commit only. What a rival committed on a runner before it released the lock is found
by the locking step itself: the statement that takes the locks is followed, in the same
round trip (one simple query of several statements: each statement its own snapshot,
taken after the previous one ended, so after every lock was granted), by a check of
the streams the batch read: those with an event past the version it read come back as
``changed``, and the batch reads them again before it decides. A locking step that
failed (no locks held) reports ``changed=None``: the time it waited may have let
anything change, and the batch reads again all it read before. A runner found changed
is read after its locks only, with nothing to check, by the next :data:`LATE_BATCHES`
batches on it (:meth:`RunnerLocks.read_late`): a hot runner, which a rival's batch
changes under nearly every early read, is read once per batch rather than twice.

A limitation: a batch reads its sandboxes before it takes the locks (it needs them to
know the runners), so two replicas placing the same sandbox at once still race on the
sandbox's stream, and the loser decides again (within its retry budget).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
from eventsourcing.postgres import PostgresAggregateRecorder
from psycopg import errors
from psycopg.sql import SQL, Identifier
from psycopg_pool import ConnectionPool, PoolTimeout

from secondbox_scheduler.projections.catch_up_gate import pool_connection_kwargs

log = logging.getLogger(__name__)

LOCK_WAIT_MS = 2000  # longest wait for each rival lock before going on without
# a runner the locking step found changed is read after its locks by this many of the
# batches on it that follow (a hot runner changes under nearly every batch's read)
LATE_BATCHES = 8
LATE_KEPT = 4096  # runners remembered so (past this many, forgotten all at once)
LOCK_CONNECTIONS = 4  # lock connections per application (batches holding locks at once)
CONNECTION_WAIT = 1.0  # seconds a batch waits for a free lock connection
UNLOCK = "SELECT pg_advisory_unlock_all()"
# The locking step's statements, sent together as one simple query (text, no
# parameters: every value in them is an integer or a UUID's canonical text). WAIT: the
# keys' locks in key order, each within the lock timeout; TRY: the keys not granted at
# once (each key tried once, whatever the plan: every row of the array is read, and
# the aggregate needs them all); CHECK: the streams with an event past a version, each
# probed through the primary key (a subquery with a LIMIT is never flattened into a
# join that the planner might run as a scan of the whole table, as an EXISTS may be:
# see ``select_after_statement`` of the store's fast-forward; cheaper to plan, too).
WAIT = (
    "DO $$ DECLARE k bigint; BEGIN "
    "PERFORM set_config('lock_timeout', '{wait}ms', true); "
    "FOREACH k IN ARRAY '{{{keys}}}'::bigint[] LOOP PERFORM pg_advisory_lock(k); "
    "END LOOP; END $$"
)
TRY = (
    "SELECT coalesce(array_agg(k), '{{}}') FROM unnest('{{{keys}}}'::bigint[]) AS k "
    "WHERE NOT pg_try_advisory_lock(k)"
)
CHECK = (
    "SELECT v.id FROM unnest('{{{ids}}}'::uuid[], '{{{versions}}}'::bigint[]) AS v(id, version) "
    "CROSS JOIN LATERAL (SELECT FROM {events} WHERE originator_id = v.id "
    "AND originator_version > v.version LIMIT 1) AS e"
)


@dataclass(frozen=True)
class Held:
    """What :meth:`RunnerLocks.hold` got: whether the batch holds its runners' locks,
    the runners it tried without waiting that another session holds, and which of the
    streams it was asked to check have an event past the version given, read once every
    lock was held (None: no lock held after a failed locking step, read them all again;
    nothing to check or no locks to take: empty)."""

    locked: bool
    busy: frozenset[str] = frozenset()
    changed: frozenset[UUID] | None = frozenset()


def lock_key(namespace: str, runner_id: str) -> int:
    """The advisory lock key of a runner: a signed 64-bit digest."""
    digest = hashlib.sha256(f"{namespace}\x00{runner_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class RunnerLocks:
    """Holds the advisory locks of a batch's home runners while it decides and commits."""

    def __init__(self, recorder: object) -> None:
        self.recorder = recorder if isinstance(recorder, PostgresAggregateRecorder) else None
        self.namespace = ""
        self._pool: ConnectionPool[Any] | None = None
        self._pool_lock = threading.Lock()
        self._events = ""  # the events table, quoted (CHECK)
        self._late: dict[str, int] = {}  # runner: batches left that read it after the locks
        if self.recorder is not None:
            datastore = self.recorder.datastore
            self.namespace = f"{datastore.schema}.{self.recorder.events_table_name}"
            self._events = (
                SQL("{}.{}")
                .format(Identifier(datastore.schema), Identifier(self.recorder.events_table_name))
                .as_string(None)
            )

    def read_late(self, runner_ids: Iterable[str]) -> set[str]:
        """Of ``runner_ids``, those a batch reads after their locks rather than before:
        the locking step found them changed under one of the last batches on them
        (:data:`LATE_BATCHES`), as a rival's batch changes a hot runner under nearly
        every read made before its lock. Each call counts a batch for them."""
        late = self._late
        found = set()
        for runner_id in runner_ids:
            left = late.get(runner_id)
            if left:
                found.add(runner_id)
                if left > 1:
                    late[runner_id] = left - 1
                else:
                    del late[runner_id]
        return found

    def found_changed(self, runner_ids: Iterable[str]) -> None:
        """These runners changed between a batch's read and its locks."""
        late = self._late
        for runner_id in runner_ids:
            if len(late) >= LATE_KEPT:
                late.clear()
            late[runner_id] = LATE_BATCHES

    @contextmanager
    def hold(
        self,
        runner_ids: Iterable[str],
        *,
        wait_for: Iterable[str] | None = None,
        worth_deferring: Callable[[frozenset[str]], bool] = lambda busy: True,
        check: Iterable[tuple[UUID, int]] = (),
    ) -> Iterator[Held]:
        """Hold the runners' locks for the block. ``wait_for=None``: wait for every one
        (up to LOCK_WAIT_MS each); otherwise wait for those runners only and try the
        others without waiting: the ones another session holds come back as ``busy``
        (the batch defers their requests instead of waiting), unless
        ``worth_deferring(busy)`` says no: then every lock is released and all of them
        taken again in key order, waiting (so no session ever waits for a lock while it
        holds one it took out of order). ``check``: streams read before the locks, each
        with the version read; those with a later event once the locks are held come
        back as ``changed``, found in the same round trip as the locks."""
        runners = set(runner_ids) if self.recorder else set()
        connection = self._connection() if runners else None
        if connection is None:
            yield Held(False, changed=None if runners else frozenset())
            return
        patient = runners if wait_for is None else runners & set(wait_for)
        keys = {lock_key(self.namespace, runner): runner for runner in runners}
        streams = list(check)
        try:
            taken = self._take(
                connection,
                sorted(k for k, r in keys.items() if r in patient),
                sorted(k for k, r in keys.items() if r not in patient),
                streams,
            )
            if taken and taken[0] and not worth_deferring(frozenset(keys[k] for k in taken[0])):
                taken = self._take_again(connection, sorted(keys), streams)
            if taken is None:
                yield Held(False, changed=None)
            else:
                busy, changed = taken
                yield Held(True, frozenset(keys[k] for k in busy), frozenset(changed))
        finally:
            self._release(connection)

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def reset(self) -> None:
        """A new lock pool on next use (the store reconnected to another server: the
        old sessions, and their locks, are gone); the old one closes in the background."""
        with self._pool_lock:
            old, self._pool = self._pool, None
        if old is not None:
            threading.Thread(target=old.close, kwargs={"timeout": 1.0}, daemon=True).start()

    def _release(self, connection: psycopg.Connection[Any]) -> None:
        """Release every lock of the session and return its connection to the lock pool;
        a release that fails or is interrupted ends the session (and its locks): the
        pool drops a closed connection."""
        pool = self._pool
        assert pool is not None
        try:
            if not connection.closed:
                connection.execute(UNLOCK)
        except psycopg.Error:
            connection.close()
        except BaseException:
            connection.close()
            pool.putconn(connection)
            raise
        pool.putconn(connection)

    def _connection(self) -> psycopg.Connection[Any] | None:
        """A free lock connection, or None (go on without the locks)."""
        try:
            connection: psycopg.Connection[Any] = self._lock_pool().getconn(timeout=CONNECTION_WAIT)
            return connection
        except (PoolTimeout, psycopg.Error) as error:
            log.info("no runner-lock connection (%s): deciding without the locks", error)
            return None

    def _lock_pool(self) -> ConnectionPool[Any]:
        with self._pool_lock:
            if self._pool is None:
                assert self.recorder is not None
                kwargs = pool_connection_kwargs(self.recorder.datastore.pool)
                self._pool = ConnectionPool(
                    kwargs={**kwargs, "autocommit": True, "connect_timeout": 5},
                    min_size=0,
                    max_size=LOCK_CONNECTIONS,
                    timeout=CONNECTION_WAIT,
                    name="secondbox-runner-locks",
                    open=True,
                )
            return self._pool

    def _take_again(
        self, connection: psycopg.Connection[Any], keys: list[int], check: list[tuple[UUID, int]]
    ) -> tuple[set[int], set[UUID]] | None:
        """Release the locks held and take all of ``keys`` again in key order, waiting;
        None (nothing held) when the session fails or a lock is not granted in time."""
        try:
            connection.execute(UNLOCK)
        except psycopg.Error as error:
            log.info("runner locks not released (%s): deciding without", error)
            connection.close()
            return None
        return self._take(connection, keys, [], check)

    def _take(
        self,
        connection: psycopg.Connection[Any],
        wait: list[int],
        attempt: list[int],
        check: list[tuple[UUID, int]],
    ) -> tuple[set[int], set[UUID]] | None:
        """Take the locks of ``wait`` in key order, each within LOCK_WAIT_MS, then try
        those of ``attempt`` without waiting, then check the streams of ``check``: one
        round trip, a statement each (each statement's snapshot is taken when the one
        before it has ended). The keys of ``attempt`` another session holds and the
        streams of ``check`` with an event past the version given; or None (and none of
        the keys held) when a lock of ``wait`` is not granted in time or the session
        fails."""
        statements = []
        if wait:
            statements.append(WAIT.format(wait=int(LOCK_WAIT_MS), keys=_ints(wait)))
        if attempt:
            statements.append(TRY.format(keys=_ints(attempt)))
        if check:
            ids = ",".join(stream.hex for stream, _ in check)
            versions = _ints([version for _, version in check])
            statements.append(CHECK.format(ids=ids, versions=versions, events=self._events))
        try:
            cursor = connection.execute("; ".join(statements))
            if wait:  # the DO block returns no rows, and no result set after the first
                cursor.nextset()
            busy: set[int] = set()
            if attempt:
                row = cursor.fetchone()
                busy = set(row[0]) if row is not None else set(attempt)
                cursor.nextset()
            changed = {row[0] for row in cursor.fetchall()} if check else set()
            return busy, changed
        except errors.LockNotAvailable:
            log.info("runner locks not granted in %s ms: deciding without", LOCK_WAIT_MS)
        except psycopg.Error as error:
            log.info("runner locks not taken (%s): deciding without", error)
        # the locks taken before the one refused are session locks: release them now
        try:
            connection.execute(UNLOCK)
        except psycopg.Error:
            connection.close()
        return None


def _ints(values: Iterable[int]) -> str:
    """Integers as the text of an array literal's elements."""
    return ",".join(str(int(value)) for value in values)
