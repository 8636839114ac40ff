"""``audit whatif``: the command (registered by :mod:`.audit`), its change flags, its report.

The flags build the same mapping a changes file holds (docs/audit.md, "audit whatif"):
lists from flags are added to the file's, single values from flags replace the file's.
The report is printed as a summary, tables (refusals by error and by reason code,
utilisation per pool before and after) and the first changed decisions with their
evidence in ``audit explain``'s manner; ``--json`` prints the report's dict instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.whatif.evidence import DecisionView
from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    format_time,
    open_store,
    print_json,
    reported_errors,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL

if TYPE_CHECKING:
    from secondbox_scheduler.infrastructure.audit.whatif_replay import WhatIfResult

WHATIF_HELP = (
    "Replay the recorded demand of the history in memory under changes, write nothing, "
    "and report what would have been decided otherwise: decisions changed by kind, "
    "refusals by reason code, utilisation per pool before and after, the first changed "
    "decisions with their evidence. With no change every decision must be reproduced "
    "(exit code 1 if not). Changes combine; TIME is an ISO time with a zone, and a change "
    "without @TIME holds from the start. See docs/audit.md.\n\n[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler audit whatif\n"
    "  secondbox-scheduler audit whatif --drain general-05@2026-01-05T09:02:00Z\n"
    "  secondbox-scheduler audit whatif --policy binpack --json\n"
    "  secondbox-scheduler audit whatif --add general-05=general-90,general-91 "
    "--allocatable edge-01@2026-01-05T09:05:00Z=vcpu_count:32,instances:12\n"
    "  secondbox-scheduler audit whatif --changes changes.yaml --until 2026-01-05T09:10:00Z"
)


def audit_whatif(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    drain: Annotated[
        list[str] | None,
        typer.Option("--drain", metavar="RUNNER[@TIME]", help="Drain a runner from TIME."),
    ] = None,
    remove: Annotated[
        list[str] | None,
        typer.Option(
            "--remove", metavar="RUNNER[@TIME]", help="Remove a runner from TIME (as deregistered)."
        ),
    ] = None,
    allocatable: Annotated[
        list[str] | None,
        typer.Option(
            "--allocatable",
            metavar="RUNNER[@TIME]=DIM:N,...",
            help="A runner's allocatable from TIME; dimensions not named keep their value.",
        ),
    ] = None,
    add: Annotated[
        list[str] | None,
        typer.Option(
            "--add",
            metavar="SOURCE[@TIME]=NEW_ID,...",
            help="Add runners from TIME, each a clone of SOURCE under a new id.",
        ),
    ] = None,
    heartbeat_timeout: Annotated[
        float | None,
        typer.Option("--heartbeat-timeout", metavar="SECONDS", help="Another heartbeat timeout."),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            metavar="NAME",
            help="Ranking policy: seed, binpack, spread, or package.module:attribute.",
        ),
    ] = None,
    start: Annotated[
        str | None,
        typer.Option(
            "--from",
            metavar="POSITION|TIME",
            help="Replay decisions from here (earlier ones are kept as recorded).",
        ),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", metavar="POSITION|TIME", help="Stop here."),
    ] = None,
    changes_file: Annotated[
        Path | None,
        typer.Option("--changes", metavar="FILE", help="Changes in a JSON or YAML file."),
    ] = None,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit.log_fold import parse_until
    from secondbox_scheduler.infrastructure.audit.whatif_replay import (
        changes_from,
        load_changes,
        whatif,
    )

    with reported_errors(), store_errors(database_url):
        data: dict[str, Any] = load_changes(changes_file) if changes_file else {}
        for name, values, parse in (
            ("drain", drain, _runner_from),
            ("remove", remove, _runner_from),
            ("allocatable", allocatable, _allocatable_from),
            ("add", add, _clones_from),
        ):
            if values:
                data[name] = [*_listed(data, name), *(parse(name, v) for v in values)]
        if heartbeat_timeout is not None:
            data["heartbeat_timeout_seconds"] = heartbeat_timeout
        if policy is not None:
            data["policy"] = policy
        if start is not None or until is not None:
            window = dict(data.get("window") or {})
            if start is not None:
                window["from"] = parse_until(start)
            if until is not None:
                window["until"] = parse_until(until)
            data["window"] = window
        changes = changes_from(data)
        app = open_store(database_url, read_models=False)
        total = app.event_count()
        with Progress(
            TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(stderr=True), disable=as_json, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("whatif", total=total)
            result = whatif(app, changes, progress=lambda n: bar.advance(task, n))
        app.close()
    report = result.report
    if as_json:
        print_json(result.to_dict())
    else:
        print_report(result, stdout())
    if (
        (changes.is_identity and not report.identical)
        or report.invariant_violations
        or report.unknown_events
    ):
        raise typer.Exit(1)


def _listed(data: dict[str, Any], name: str) -> list[Any]:
    found = data.get(name) or []
    if not isinstance(found, list):
        raise InvalidRequestError(name, "must be a list")
    return found


def _split_at(name: str, text: str) -> tuple[str, str | None]:
    runner, _, at = text.partition("@")
    if not runner:
        raise InvalidRequestError(name, "give RUNNER or RUNNER@TIME", text)
    return runner, at or None


def _runner_from(name: str, text: str) -> dict[str, Any]:
    runner, at = _split_at(name, text)
    return {"runner": runner, "at": at}


def _allocatable_from(name: str, text: str) -> dict[str, Any]:
    target, _, amounts = text.partition("=")
    runner, at = _split_at(name, target)
    capacity: dict[str, Any] = {}
    for part in filter(None, amounts.split(",")):
        dim, _, amount = part.partition(":")
        try:
            capacity[dim.strip()] = int(amount)
        except ValueError:
            raise InvalidRequestError(name, f"{part!r} is not DIM:N (N an integer)") from None
    return {"runner": runner, "at": at, "capacity": capacity}


def _clones_from(name: str, text: str) -> dict[str, Any]:
    source, _, ids = text.partition("=")
    runner, at = _split_at(name, source)
    return {"source": runner, "at": at, "ids": [i.strip() for i in ids.split(",") if i.strip()]}


# -- printing ---------------------------------------------------------------------------


def print_report(result: WhatIfResult, console: Console) -> None:
    report = result.report
    console.print("[bold]what-if[/bold] " + escape("; ".join(report.changes)))
    window = ", ".join(f"{k} {v}" for k, v in report.window.items() if v is not None)
    console.print(
        f"replayed {report.events:,} events up to position {report.position:,} in "
        f"{result.seconds:.2f}s ({result.events_per_second:,.0f} events/s)"
        + (f"; window {window}" if window else "")
    )
    by_operation = ", ".join(
        f"{op} {counts['reproduced']:,} of {counts['decisions']:,}"
        for op, counts in report.by_operation.items()
    )
    console.print(
        f"[bold]reproduced {report.reproduced:,} of {report.decisions:,} decisions[/bold] "
        f"({by_operation})"
    )
    if report.evidence_changed:
        console.print(f"same outcome on other evidence: {report.evidence_changed:,}")
    if report.changed:
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in report.by_kind.items())
        console.print(f"[bold]changed {report.changed:,}[/bold]: {kinds}")
    if report.kept:
        console.print(
            f"kept as recorded: {report.kept:,} create_sandbox refusals recorded without their "
            f"requirements ({report.kept_consistent:,} consistent with the replayed fleet)"
        )
    if report.first_difference is not None:
        first = report.first_difference
        console.print(
            f"first difference: #{first.position:,} {first.operation} {first.sandbox_id}"
            + (f" generation {first.generation}" if first.generation else "")
            + f": {first.kind}: {escape(first.detail)}"
        )
    console.print(
        f"lifecycle events skipped: {report.lifecycle_skipped:,}; placed only in the replay and "
        f"held to the end: {report.held_to_end:,}; allocatable changes that waited for room: "
        f"{report.allocatable_waits:,}"
    )
    for violation in report.invariant_violations:
        console.print(f"[red]invariant violated[/red] {escape(violation)}")
    if report.unknown_events:
        count = sum(report.unknown_events.values())
        console.print(
            f"[red]not reproduced[/red]: {count:,} events of unknown kinds were not replayed "
            + escape(str(report.unknown_events))
        )
    console.print(_refusal_table(report.refusals, "Refusals by error", "error"))
    console.print(_refusal_table(report.reasons, "Refused runners by reason code", "reason"))
    console.print(_utilisation_table(report.utilisation))
    if report.changed_decisions:
        console.print(f"[bold]First {len(report.changed_decisions)} changed decisions[/bold]")
    for change in report.changed_decisions:
        generation = f" generation {change.generation}" if change.generation else ""
        console.print(
            f"\n#{change.position:,} {format_time(change.time)} {change.operation} "
            f"{change.sandbox_id}{generation}: [bold]{change.kind}[/bold]"
        )
        _print_view(console, "before", change.before)
        _print_view(console, "after", change.after)


def _print_view(console: Console, label: str, view: DecisionView) -> None:
    summary = f" ({view.summary})" if view.summary else ""
    console.print(f"  {label}: {escape(view.headline)}{escape(summary)}")
    for line in view.candidates:
        reasons = "; ".join(
            r["code"] + (f" (short {r['shortfall']})" if r.get("shortfall") else "")
            for r in line["reasons"]
        )
        rank = ", ".join(f"{k} {v:,}" for k, v in (line.get("rank") or {}).items())
        console.print(
            f"    {line['runner_id']:<16} {line['verdict']:<26} {escape(reasons or rank)}"
        )


def _refusal_table(counts: dict[str, dict[str, dict[str, int]]], title: str, what: str) -> Table:
    table = Table(title=title, box=box.SIMPLE)
    table.add_column(what)
    operations = list(counts.get("before", {}))
    for operation in operations:
        table.add_column(f"{operation} before", justify="right")
        table.add_column("after", justify="right")
    names = sorted({name for side in counts.values() for op in side.values() for name in op})
    for name in names:
        row = [name]
        for operation in operations:
            for side in ("before", "after"):
                row.append(f"{counts[side][operation].get(name, 0):,}")
        table.add_row(*row)
    return table


_SHOWN = (("vcpu_count", "vCPU"), ("memory_bytes", "memory"), ("instances", "instances"))


def _utilisation_table(utilisation: dict[str, Any]) -> Table:
    table = Table(
        title="Utilisation per pool, peak and time-weighted mean (before -> after)", box=box.SIMPLE
    )
    table.add_column("pool")
    for _, label in _SHOWN:
        table.add_column(f"{label} peak", justify="right")
        table.add_column(f"{label} mean", justify="right")
    before, after = utilisation.get("before", {}), utilisation.get("after", {})
    for pool in sorted(set(before) | set(after)):
        row = [pool]
        for dim, _ in _SHOWN:
            for measure in ("peak", "mean"):
                was = before.get(pool, {}).get(dim, {}).get(measure, 0.0)
                now = after.get(pool, {}).get(dim, {}).get(measure, 0.0)
                row.append(f"{was:.0%} -> {now:.0%}")
        table.add_row(*row)
    return table
