"""That the streams and the log hold the same events (``audit verify``).

The audit, the checkpoints and the read models read the notification log (positions
1 and up); the aggregates load by stream. An event stored outside the log (found by the
red team: an explicit ``notification_id`` of 0 or below, before the schema refused one)
is acted on by the aggregates and seen by no audit. :func:`outside_log` compares, with
one query, the events table with what the log reading saw: how many events it holds at
positions 1 to the last position read (as many as were read), and which it holds below
position 1 (each one a violation ``stream-not-in-log``).
"""

from __future__ import annotations

from typing import Any

from eventsourcing.postgres import PostgresApplicationRecorder

from secondbox_scheduler.domain.audit.state import Violation

RULE = "stream-not-in-log"
NAMED = 20  # events named one by one; the others counted


def _statement(recorder: Any, after: int = 0) -> tuple[str, str]:
    """The query (with the last position read as its one parameter) and its placeholder;
    ``after``: only the positions after it, and those below 1 (a re-audit's)."""
    if isinstance(recorder, PostgresApplicationRecorder):
        table = f'"{recorder.datastore.schema}"."{recorder.events_table_name}"'
        position, placeholder = "notification_id", "%s"
        concat = "string_agg({}, E'\\n' ORDER BY notification_id)"
    else:  # SQLite: the position is the rowid
        table = f'"{recorder.events_table_name}"'
        position, placeholder, concat = "rowid", "?", "group_concat({}, char(10))"
    described = (
        f"CAST({position} AS TEXT) || ' ' || CAST(originator_id AS TEXT) || ' ' "
        "|| CAST(originator_version AS TEXT) || ' ' || topic"
    )
    outside = concat.format(described)
    where = "" if after < 1 else f" WHERE {position} < 1 OR {position} > {int(after)}"
    return (
        f"SELECT count(*) FILTER (WHERE {position} >= {max(1, int(after) + 1)} "
        f"AND {position} <= {placeholder}) "
        f"AS in_log, count(*) FILTER (WHERE {position} < 1) AS hidden, "
        f"{outside} FILTER (WHERE {position} < 1) AS outside FROM {table}{where}"
    ), placeholder


def outside_log(
    recorder: Any, read: int, last: int, after: int = 0, read_before: int = 0
) -> list[Violation]:
    """Violations for events of the streams that the log reading (``read`` events,
    positions up to ``last``) did not see. A re-audit from a fold state sealed at
    position ``after`` (``read_before`` events read then) counts only the positions
    after it: those before were counted when the state was sealed."""
    statement, _ = _statement(recorder, after)
    with recorder.datastore.transaction(commit=False) as cursor:
        cursor.execute(statement, (last,))
        row = cursor.fetchone()
    in_log, hidden, outside = int(row["in_log"]), int(row["hidden"]), row["outside"]
    violations = []
    for line in (outside or "").splitlines()[:NAMED]:
        position, originator_id, version, topic = line.split(" ", 3)
        violations.append(
            Violation(
                int(position),
                originator_id,
                topic.rpartition(":")[2],
                RULE,
                f"{originator_id} version {version} is stored at position {position}, "
                "outside the log that the audit, checkpoints and read models read; the "
                "aggregates load it by stream",
            )
        )
    if hidden > NAMED:
        violations.append(
            Violation(0, "-", "-", RULE, f"{hidden - NAMED} more events stored below position 1")
        )
    if in_log != read - read_before:
        violations.append(
            Violation(
                last,
                "-",
                "-",
                RULE,
                f"the events table holds {in_log + read_before} events at positions 1 to "
                f"{last}; the log reading saw {read}",
            )
        )
    return violations
