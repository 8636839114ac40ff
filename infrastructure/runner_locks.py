"""Advisory locks on the home runners of a placement batch (PostgreSQL).

Correctness never depends on them: every placement is still an optimistic save that
fails on a stream version a rival moved (:mod:`.placement_batch`). They are for
liveness. Replicas whose batches keep meeting on the same few runners would otherwise
lose race after race (each rival's commit invalidates the others' decisions), and a
request could exhaust its retry budget while the runner still had room: a contention
error where a serial execution would have placed it. So a batch, once it knows its
sandboxes' home runners, takes a transaction-level advisory lock per runner (in one
order, so two batches never wait for each other in a cycle) on a connection of its own,
decides and commits while holding them, and ends that transaction. Batches on disjoint
runners never wait; batches on the same runner take turns, as a plan applier would
commit them, and the second one decides against the first one's commit.

A lock wait is bounded (``LOCK_WAIT``): past it the batch goes on without the locks, as
before them. A killed process's locks end with its session. The keys are 64-bit digests
of the events table's schema and name and the runner id, so two stores in one database
never share a lock. SQLite, the in-memory store, and a pool of one connection (the batch
needs a second one to load and save while it holds the first): no locks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psycopg
from eventsourcing.postgres import PostgresAggregateRecorder
from psycopg import errors
from psycopg.sql import SQL, Literal

log = logging.getLogger(__name__)

LOCK_WAIT_MS = 2000  # longest wait for a rival batch's locks before going on without


def lock_key(namespace: str, runner_id: str) -> int:
    """The advisory lock key of a runner: a signed 64-bit digest."""
    digest = hashlib.sha256(f"{namespace}\x00{runner_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class RunnerLocks:
    """Holds the advisory locks of a batch's home runners while it decides and commits."""

    def __init__(self, recorder: object) -> None:
        self.recorder = recorder if isinstance(recorder, PostgresAggregateRecorder) else None
        if self.recorder is not None:
            datastore = self.recorder.datastore
            if datastore.pool.max_size < 2:
                self.recorder = None
            else:
                self.namespace = f"{datastore.schema}.{self.recorder.events_table_name}"

    @contextmanager
    def hold(self, runner_ids: Iterable[str]) -> Iterator[bool]:
        """Hold the runners' locks for the block; yields whether they are held."""
        keys = sorted({lock_key(self.namespace, r) for r in runner_ids}) if self.recorder else []
        if not keys:
            yield False
            return
        assert self.recorder is not None
        datastore = self.recorder.datastore
        with datastore.get_connection() as connection:
            # session-level locks, taken in key order with a bounded wait by one
            # statement (one round trip), released with another; a session that breaks
            # takes its locks with it
            take = SQL(
                "DO $$ DECLARE k bigint; BEGIN "
                "PERFORM set_config('lock_timeout', {wait}, true); "
                "FOREACH k IN ARRAY {keys}::bigint[] LOOP PERFORM pg_advisory_lock(k); "
                "END LOOP; END $$"
            ).format(wait=Literal(f"{LOCK_WAIT_MS}ms"), keys=Literal(keys))
            try:
                try:
                    connection.execute(take)
                    held = True
                except errors.LockNotAvailable:
                    held = False
                    log.info("runner locks not granted in %s ms: deciding without", LOCK_WAIT_MS)
                yield held
            finally:
                try:
                    connection.execute("SELECT pg_advisory_unlock_all()")
                except psycopg.Error:  # a broken session: it ends, and its locks with it
                    connection.close()  # the pool drops a closed connection
