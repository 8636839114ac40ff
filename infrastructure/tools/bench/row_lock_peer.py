"""The row-lock peer: the original implementation's state-based design, for comparison.

What a user might build instead of an event-sourced scheduler (and what the Go
original does): runner rows with reserved columns and an assignments table; one
SERIALIZABLE transaction per placement that locks the home runner's row, checks
capacity, inserts the assignment and adds to the reserved columns. No evidence, no
history: the bench runs it on the same server, with the same workers and the same
runners and requests, so that ``versus_row_lock`` compares like with like.
"""

from __future__ import annotations

from collections.abc import Iterable

import psycopg
from psycopg import errors, sql

from secondbox_scheduler.domain.values import Capacity

DIMENSIONS = Capacity.DIMENSIONS
RETRY_LIMIT = 8


def create_tables(conninfo: str, schema: str, runners: Iterable[tuple[str, Capacity]]) -> None:
    """The peer's two tables in ``schema``, with the runners' rows."""
    columns = ", ".join(
        f"allocatable_{d} BIGINT NOT NULL, reserved_{d} BIGINT NOT NULL DEFAULT 0"
        for d in DIMENSIONS
    )
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        conn.execute(f"CREATE TABLE rl_runners (id TEXT PRIMARY KEY, {columns})")
        conn.execute(
            "CREATE TABLE rl_assignments (sandbox_id TEXT, generation BIGINT, "
            "runner_id TEXT NOT NULL, assignment_id TEXT NOT NULL, "
            "created_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (sandbox_id, generation))"
        )
        with conn.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO rl_runners (id, {', '.join(f'allocatable_{d}' for d in DIMENSIONS)})"
                f" VALUES (%s, {', '.join('%s' for _ in DIMENSIONS)})",
                [(runner_id, *capacity.as_dict().values()) for runner_id, capacity in runners],
            )


class RowLockPeer:
    """One client of the peer: a connection, and the placement transaction."""

    def __init__(self, conninfo: str, schema: str, requested: Capacity) -> None:
        self.conn = psycopg.connect(conninfo)
        self.conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        self.conn.execute("SET default_transaction_isolation TO 'serializable'")
        self.conn.commit()
        self.requested = requested.as_dict()
        self.retries = 0
        checks = " AND ".join(f"allocatable_{d} - reserved_{d} >= %({d})s" for d in DIMENSIONS)
        self._lock = f"SELECT ({checks}) AS fits FROM rl_runners WHERE id = %(runner)s FOR UPDATE"
        self._reserve = (
            "UPDATE rl_runners SET "
            + ", ".join(f"reserved_{d} = reserved_{d} + %({d})s" for d in DIMENSIONS)
            + " WHERE id = %(runner)s"
        )

    def place(self, sandbox_id: str, runner_id: str) -> str:
        """Place generation 1 of ``sandbox_id`` on ``runner_id``: placed, replayed,
        refused, or contention_error after the retry limit."""
        params = {**self.requested, "runner": runner_id}
        for _ in range(RETRY_LIMIT + 1):
            try:
                with self.conn.transaction():
                    row = self.conn.execute(self._lock, params).fetchone()
                    if row is None or not row[0]:
                        return "refused"
                    inserted = self.conn.execute(
                        "INSERT INTO rl_assignments (sandbox_id, generation, runner_id, "
                        "assignment_id) VALUES (%s, 1, %s, %s) ON CONFLICT DO NOTHING",
                        (sandbox_id, runner_id, f"asg-{sandbox_id}"),
                    ).rowcount
                    if not inserted:
                        return "replayed"
                    self.conn.execute(self._reserve, params)
                return "placed"
            except (errors.SerializationFailure, errors.DeadlockDetected):
                self.retries += 1
        return "contention_error"

    def close(self) -> None:
        self.conn.close()
