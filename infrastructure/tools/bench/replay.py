"""Replay figures of ``secondbox-scheduler bench``: projection rebuild and ``audit
verify`` over the whole log, beside the raw rate of reading the same notifications, and
the what-if replay with no change (``audit whatif``) beside ``audit verify``'s rate.

``audit verify`` runs twice: in one process (``--workers 1``, as before the parallel
verify), then with its default processes (the figure of the goal), each with the CPU
it used per event (this process and its children, the raw read included)."""

from __future__ import annotations

import resource
from collections.abc import Callable
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
    from secondbox_scheduler.infrastructure.audit.parallel_verify import default_workers

    progress("replay: audit verify in one process")
    serial, serial_cpu = _cpu(lambda: verify(app, workers=1))
    workers = default_workers()
    progress(f"replay: audit verify, {workers} processes")
    audit, cpu = _cpu(lambda: verify(app, workers=workers))
    audited = _audited(audit, cpu, workers)
    audited["serial"] = _audited(serial, serial_cpu, 1)
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


def _cpu(run: Callable[[], Any]) -> tuple[Any, float]:
    """What ``run`` returns, and the CPU seconds it took in this process and the
    children it waited for."""

    def used() -> float:
        own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))  # fmt: skip
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    before = used()
    result = run()
    return result, used() - before


def _audited(audit: Any, cpu: float, workers: int) -> dict[str, Any]:
    audited: dict[str, Any] = audit.to_dict()
    violations = audited.pop("violations")
    audited["violations"] = len(violations)
    audited["workers"] = workers
    audited["cpu_us_per_event"] = round(cpu / audit.events * 1e6, 1) if audit.events else None
    if "ratio_to_raw_read" not in audited:
        audited["ratio_to_raw_read"] = (
            round(audit.events_per_second / audit.raw_events_per_second, 3)
            if audit.raw_events_per_second
            else None
        )
    return audited
