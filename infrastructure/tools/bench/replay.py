"""Replay figures of ``secondbox-scheduler bench``: projection rebuild and ``audit
verify`` over the whole log, beside the raw rate of reading the same notifications, and
the what-if replay with no change (``audit whatif``) beside ``audit verify``'s rate."""

from __future__ import annotations

from typing import Any

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.bench.errors import BenchError
from secondbox_scheduler.infrastructure.tools.bench.settings import Progress


def measure_replay(app: SchedulerApplication, progress: Progress) -> dict[str, Any]:
    from secondbox_scheduler.infrastructure.audit.verify import verify
    from secondbox_scheduler.infrastructure.audit.whatif_replay import whatif
    from secondbox_scheduler.projections.read_models import rebuild

    if app.read_models is None:
        raise BenchError("replay needs read models (SQLite or PostgreSQL)")
    progress("replay: projection rebuild")
    rebuilt = rebuild(app.read_models).to_dict()
    progress("replay: audit verify")
    audit = verify(app)
    audited = audit.to_dict()
    violations = audited.pop("violations")
    audited["violations"] = len(violations)
    if "ratio_to_raw_read" not in audited:
        audited["ratio_to_raw_read"] = (
            round(audit.events_per_second / audit.raw_events_per_second, 3)
            if audit.raw_events_per_second
            else None
        )
    progress("replay: audit whatif (no change)")
    replayed = whatif(app)
    report = replayed.report
    whatif_figures = {
        "events": report.events,
        "seconds": round(replayed.seconds, 3),
        "events_per_second": round(replayed.events_per_second, 1),
        "raw_read_events_per_second": round(audit.raw_events_per_second, 1),
        "ratio_to_raw_read": (
            round(replayed.events_per_second / audit.raw_events_per_second, 3)
            if audit.raw_events_per_second
            else None
        ),
        "ratio_to_audit_verify": (
            round(replayed.events_per_second / audit.events_per_second, 3)
            if audit.events_per_second
            else None
        ),
        "decisions": report.decisions,
        "reproduced": report.reproduced,
        "changed": report.changed,
    }
    return {"rebuild": rebuilt, "audit_verify": audited, "audit_whatif": whatif_figures}
