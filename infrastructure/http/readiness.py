"""What ``/readyz`` judges of the read models (:mod:`.health` calls
:func:`read_model_readiness`).

A read model is not ready when it lags the log by more than the bound
(``SECONDBOX_READY_MAX_LAG``, or ``serve --max-read-model-lag``), or when its tracking
position lies beyond the log's head: a position no catch-up can reach, which only a
tampered tracking table (or the tables of another log) gives, and which would otherwise
stop the read model silently while it counts no lag
(:class:`~secondbox_scheduler.projections.read_models.ReadModelAheadError`).
"""

from __future__ import annotations

from contextlib import suppress

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.projections.read_models import ProjectionStatus, ReadModelAheadError


def read_model_readiness(
    app: SchedulerApplication, max_lag: int
) -> tuple[list[ProjectionStatus], list[str]]:
    """Each read model's status and the reasons they are not ready (none: ready).
    Where queries catch the read models up themselves, they are caught up first, as
    the next query would; a position beyond the head is then reported, not raised."""
    read_models = app.read_models
    if read_models is None:
        return [], []
    if app.catch_up_inline:
        with suppress(ReadModelAheadError):  # the status says it
            app.current_read_models()
    statuses = read_models.status()
    reasons = []
    for status in statuses:
        if status.error:
            reasons.append(f"read model {status.name}: {status.error}")
        elif status.lag_events > max_lag:
            reasons.append(
                f"read model {status.name}: {status.lag_events:,} events behind the log "
                f"(more than {max_lag:,})"
            )
    return statuses, reasons
