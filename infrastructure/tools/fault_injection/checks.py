"""The final checks of a fault-injection run, over its database and the workers' journals.

- ``audit verify`` over the whole log finds nothing (which includes: no runner over its
  allocatable at any position);
- every acknowledged schedule is in the store with the same assignment (id, token);
- every request a kill interrupted, retried by the restarted worker, got the same
  assignment back;
- the read models caught up from the log equal a rebuild from zero;
- adversarial profile: every misbehaviour was refused as documented and wrote nothing,
  every guard probe of the Runner aggregate held (the workers journaled both), and the
  audit fold of the final log reports each forged breach at its position with its rule
  (:func:`.probes.audit_probes`).

Along the way it counts, into the report, what the workers' journals say they did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import fold as audit_fold
from secondbox_scheduler.infrastructure.audit.verify import verify as audit_verify
from secondbox_scheduler.infrastructure.tools.fault_injection.actors import ranking_check
from secondbox_scheduler.infrastructure.tools.fault_injection.config import FaultRunReport
from secondbox_scheduler.infrastructure.tools.fault_injection.probes import audit_probes
from secondbox_scheduler.projections.read_models import rebuild


def count_probe(record: dict[str, Any], report: FaultRunReport) -> None:
    """A journaled misbehaviour or guard probe: counted when it held, else a violation."""
    counter = report.misbehaviours if record["kind"] == "misbehaviour" else report.probes
    if record["ok"]:
        counter[record["name"]] += 1
    else:
        report.violations.append(f"{record['kind']} {record['name']}: {record['detail']}")


def add_stats(report: FaultRunReport, stats: dict[str, Any]) -> None:
    """A worker process's last stats (its counters die with it: one per process)."""
    report.contention_retries += stats.get("contention_retries", 0)
    report.contention_errors += stats.get("contention_errors", 0)
    for size, batches in stats.get("batch_sizes", {}).items():
        report.batch_sizes[int(size)] += batches


def check_audit_probes(app: SchedulerApplication, report: FaultRunReport) -> None:
    audit = audit_fold(app)
    versions = {
        runner_id: next(iter(app.events.get(stream, desc=True, limit=1))).originator_version
        for runner_id, stream in audit.runner_streams.items()
    }
    for probe in audit_probes(audit, versions, app.now()):
        count_probe(probe.to_record(), report)


def check(
    url: str, configs: list[dict[str, Any]], report: FaultRunReport, adversarial: bool = False
) -> None:
    app = SchedulerApplication(
        env={"SECONDBOX_DATABASE_URL": url, "SECONDBOX_READ_MODELS": "external"}
    )
    try:
        audit = audit_verify(app, measure_raw=False)
        report.events = audit.events
        report.audit_events_per_second = audit.events_per_second
        report.violations += [f"audit: {violation}" for violation in audit.violations]
        for worker in configs:
            records = [
                json.loads(line)
                for line in Path(worker["journal"]).read_text().splitlines()
                if line.strip()
            ]
            last_stats: dict[str, int] = {}
            for record in records:
                kind = record["kind"]
                if kind == "ack":
                    report.operations[record["op"]] += 1
                elif kind == "refused":
                    report.refusals[record["error"]] += 1
                elif kind == "fault":
                    report.faults += 1
                elif kind == "unexpected":
                    report.violations.append(
                        f"worker {worker['index']}: unexpected exception {record['error']}"
                    )
                elif kind == "start":
                    add_stats(report, last_stats)
                    last_stats = {}
                elif kind == "stats":
                    last_stats = record
                elif kind in ("misbehaviour", "probe"):
                    count_probe(record, report)
                if kind == "ack" and record["op"] == "schedule":
                    report.acknowledged_schedules += 1
                    stored = app.get_assignment(record["sandbox"], record["generation"])
                    if stored is None or (stored.id, stored.fencing_token.hex()) != (
                        record["assignment"],
                        record["token"],
                    ):
                        report.violations.append(f"acknowledged schedule lost or changed: {record}")
                    if record["retried"]:
                        report.retried_in_flight += 1
                        if record["assignment"] != record["request"]:
                            report.violations.append(
                                f"retried request got another assignment: {record}"
                            )
            add_stats(report, last_stats)
        if adversarial:
            check_audit_probes(app, report)
            for probe in ranking_check(app):
                count_probe(probe.to_record(), report)
        read_models = app.read_models
        assert read_models is not None
        read_models.catch_up()
        live = [view.rows() for view in read_models.views.values()]  # type: ignore[attr-defined]
        rebuild(read_models)
        rebuilt = [view.rows() for view in read_models.views.values()]  # type: ignore[attr-defined]
        if live != rebuilt:
            report.violations.append("read models caught up from the log differ from a rebuild")
    finally:
        app.close()
