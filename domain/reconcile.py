"""The reconciler's policy: what to do with one due assignment (pure; no I/O, no clock).

- An assignment still ``assigned`` (never reported running) after its operation
  deadline fails with the transient class ``deadline_exceeded``: redelivered (with a
  fresh operation window) while retries remain, terminally failed past retry_limit.
- An ``assigned`` or ``running`` assignment whose home runner's heartbeat has expired
  becomes ``uncertain``: its compute may still run, so it keeps its reservation until
  release proof arrives. No relocation and no replacement.
- Otherwise nothing changes. In every case the next reconcile is one interval later
  (released assignments are never due again).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from secondbox_scheduler.domain.assignment import STATE_ASSIGNED, STATE_RELEASED, STATE_RUNNING
from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot

ACTION_NONE = "none"
ACTION_DEADLINE_EXCEEDED = "deadline_exceeded"
ACTION_UNCERTAIN = "uncertain"
ACTIONS = (ACTION_NONE, ACTION_DEADLINE_EXCEEDED, ACTION_UNCERTAIN)


@dataclass(frozen=True)
class ReconcileDecision:
    action: str
    reason: str
    next_reconcile_at: datetime | None


def decide_reconcile(
    assignment: DurableAssignment,
    home: RunnerSnapshot | None,
    now: datetime,
    heartbeat_timeout: timedelta,
    interval: timedelta,
) -> ReconcileDecision:
    """The reconcile action for ``assignment`` at ``now``, and when to look again."""
    if assignment.state == STATE_RELEASED:
        return ReconcileDecision(ACTION_NONE, "released", None)
    later = now + interval
    deadline = assignment.operation_deadline
    if assignment.state == STATE_ASSIGNED and deadline is not None and deadline <= now:
        return ReconcileDecision(
            ACTION_DEADLINE_EXCEEDED, f"operation deadline {deadline.isoformat()} passed", later
        )
    if assignment.state in (STATE_ASSIGNED, STATE_RUNNING):
        seen = None if home is None else home.last_heartbeat_at
        if seen is None or seen < now - heartbeat_timeout:
            last = "never" if seen is None else seen.isoformat()
            return ReconcileDecision(
                ACTION_UNCERTAIN, f"home runner heartbeat expired (last {last})", later
            )
    return ReconcileDecision(ACTION_NONE, "nothing to do", later)
