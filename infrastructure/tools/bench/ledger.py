"""What a throughput run of ``secondbox-scheduler bench`` left in the store, checked:
no runner oversubscribed, and no acknowledged placement lost.

After a run, a new application (no cache shared with the workers or the serve
processes) loads every runner the run placed on and checks, on each, reserved <=
allocatable in every dimension, and that every placement the run's callers were
answered (created, or a replay of one) is held there. A violation makes the whole
``bench`` exit 1 (:func:`failures`), whatever its figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure.application import SchedulerApplication

SHOWN = 5  # lost placements named in a report (the count is always whole)


def acknowledged_homes(
    results: Iterable[Any], homes: Mapping[str, str] | None
) -> dict[str, str | None]:
    """Each sandbox a run's callers were answered for, with its home runner when the run
    chose it (None: the scheduler chose it, ``create_sandbox``)."""
    found: dict[str, str | None] = {}
    for result in results:
        for sandbox_id in result.acknowledged:
            found[sandbox_id] = homes.get(sandbox_id) if homes is not None else None
    return found


def check_ledger(
    env: dict[str, str], acknowledged: Mapping[str, str | None], runner_ids: Sequence[str] = ()
) -> dict[str, Any]:
    """The run's runners as stored: ``runner_ids`` and every known home of an
    acknowledged placement. Placements of unknown home are looked for on every runner
    checked (pass the pool's runners)."""
    checked = sorted({*runner_ids, *(home for home in acknowledged.values() if home)})
    checker = SchedulerApplication(env=env)
    held: dict[str, str] = {}  # sandbox id -> the runner holding its generation 1
    oversubscribed: list[str] = []
    try:
        for runner_id in checked:
            runner = checker.load(runner_uuid(runner_id), Runner, copy=False)
            if runner is None:
                continue
            if any(runner.reserved[dim] > runner.allocatable[dim] for dim in runner.reserved):
                oversubscribed.append(runner_id)
            for record in runner.reservations.values():
                if record["generation"] == 1:
                    held[record["sandbox_id"]] = runner_id
    finally:
        checker.close()
    lost = sorted(
        sandbox_id
        for sandbox_id, home in acknowledged.items()
        if sandbox_id not in held or (home is not None and held[sandbox_id] != home)
    )
    return {
        "runners_checked": len(checked),
        "acknowledged": len(acknowledged),
        "oversubscribed_runners": len(oversubscribed),
        "lost_placements": len(lost),
        "lost_examples": lost[:SHOWN],
    }


def failures(report: Mapping[str, Any]) -> list[str]:
    """What in a report must fail the bench (exit 1): a runner oversubscribed, an
    acknowledged placement lost, an audit of a bench's log failed (or, from a checkpoint,
    disagreed with the full audit). Empty: none."""
    found: list[str] = []
    for name, section in report.items():
        if not isinstance(section, Mapping):
            continue
        ledger = section.get("ledger")
        if isinstance(ledger, Mapping):
            if ledger.get("oversubscribed_runners"):
                found.append(f"{name}: {ledger['oversubscribed_runners']} runner(s) oversubscribed")
            if ledger.get("lost_placements"):
                examples = ", ".join(ledger.get("lost_examples", ()))
                found.append(
                    f"{name}: {ledger['lost_placements']} acknowledged placement(s) lost "
                    f"({examples})"
                )
        state = section.get("hot_runner_state")
        if isinstance(state, Mapping):
            if state.get("oversubscribed_runners"):
                found.append(
                    f"{name}: {state['oversubscribed_runners']} hot runner(s) oversubscribed"
                )
            if state.get("reservations_match_placements") is False:
                found.append(f"{name}: reservations on the hot runners differ from placements")
    replay = report.get("replay")
    audit = replay.get("audit_verify") if isinstance(replay, Mapping) else None
    if isinstance(audit, Mapping) and (not audit.get("ok", True) or audit.get("violations")):
        found.append(f"replay: audit verify found {audit.get('violations', 0)} violation(s)")
    scale = report.get("audit_scale")
    one = scale.get("one_runner") if isinstance(scale, Mapping) else None
    if isinstance(one, Mapping) and one.get("violations"):
        found.append(f"audit_scale: audit verify found {one['violations']} violation(s)")
    since = report.get("since")
    if isinstance(since, Mapping):
        if since.get("violations"):
            found.append(f"since: audit verify found {since['violations']} violation(s)")
        if since.get("same_findings") is False:
            found.append("since: audit verify --since found other violations than a full verify")
    return found
