"""Tables of a ``secondbox-scheduler bench`` report (the dict :func:`run_bench` returns)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table


def _ms(value: float) -> str:
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def _deferred(run: dict[str, Any]) -> str:
    """The share of placements a batch handed back to the next (a rival held the runner)."""
    share = run.get("deferred_per_call")
    return f", {share:.1%} deferred" if share else ""


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def throughput_table(report: dict[str, Any]) -> Table | None:
    raw, placement = report.get("raw_baseline"), report.get("placement")
    contention, over_http = report.get("contention"), report.get("http")
    runs = ("batched", "batched_steady", "contention_batched", "row_lock")
    if not (raw or placement or contention or over_http or any(report.get(r) for r in runs)):
        return None  # (`--only batched` or `--only row_lock`: no raw run, a table still)
    workers = report["settings"]["workers"]
    table = Table(title=f"Throughput, {workers} worker processes", box=box.SIMPLE)
    columns = ("run", "per s", "p50 ms", "p95 ms", "p99 ms", "retries/call", "errors", "ratio")
    for column in (*columns, "CPU ms/call"):
        table.add_column(column, justify="left" if column == "run" else "right")

    def add(label: str, run: dict[str, Any], rate: float, ratio: str, **shown: str) -> None:
        """One run's row: ``rate`` its per-second figure, ``ratio`` against its baseline;
        ``shown`` overrides the retries and errors columns."""
        table.add_row(
            label,
            f"{rate:,.0f}",
            _ms(run["p50_ms"]),
            _ms(run["p95_ms"]),
            _ms(run["p99_ms"]),
            shown.get("retries", f"{run.get('retries_per_call', 0):.3f}"),
            shown.get("errors", str(run.get("contention_errors", 0))),
            ratio,
            _cpu(run),
        )

    def of(value: float, base: float | None, what: str) -> str:
        return _ratio(value / base if base else None) + what

    if raw:
        for key, label in (
            ("one_aggregate", "raw: 1 new aggregate/transaction"),
            ("two_aggregates", "raw: 2 new aggregates/transaction"),
            ("batched_aggregates", "raw: N new aggregates/transaction"),
        ):
            row = raw.get(key)
            if row is None:
                continue
            if key == "batched_aggregates":
                label = f"raw: {row['aggregates_per_transaction']} new aggregates/transaction"
            add(label, row, row["transactions_per_second"], "-", retries="-", errors="0")
    two = raw["two_aggregates"]["transactions_per_second"] if raw else None
    one = raw["one_aggregate"]["transactions_per_second"] if raw else None
    uncontended = placement["per_second"] if placement else None
    if placement:
        label = f"placement: schedule over {placement['runners']:,} runners"
        add(
            label, placement, placement["per_second"], of(placement["per_second"], two, " of raw 2")
        )
    if contention:
        rate = contention["goodput_per_second"]
        label = f"contention: goodput on {contention['hot_runners']} hot runners"
        add(label, contention, rate, of(rate, uncontended, " of placement"))
    batched, row_lock = report.get("batched"), report.get("row_lock")
    if batched:
        label = (
            f"batched: {batched['callers_per_worker']} callers/worker over "
            f"{batched['runners']:,} runners (mean batch {batched.get('batch_size_mean', 1)}"
            f"{_deferred(batched)}){_scheduler_cpu(batched)}"
        )
        add(label, batched, batched["per_second"], of(batched["per_second"], one, " of raw 1"))
    steady = report.get("batched_steady")
    if steady:
        label = (
            f"batched, open loop: {steady['offered_per_second']:,.0f} requests/s arriving "
            f"(mean batch {steady.get('batch_size_mean', 1)}{_deferred(steady)})"
        )
        add(label, steady, steady["per_second"], of(steady["per_second"], one, " of raw 1"))
    contended = report.get("contention_batched")
    if contended:
        rate = contended["goodput_per_second"]
        label = f"batched contention: goodput on {contended['hot_runners']} hot runners"
        base = batched["per_second"] if batched else None
        add(label, contended, rate, of(rate, base, " of batched"))
    if row_lock and "per_second" in row_lock:
        label = f"row-lock peer: SERIALIZABLE, row locked, over {row_lock['runners']:,} runners"
        ratio = _ratio(batched["per_second"] / row_lock["per_second"] if batched else None)
        errors = str(row_lock["outcomes"].get("contention_error", 0))
        add(label, row_lock, row_lock["per_second"], ratio + " batched/peer", errors=errors)
    batched_rate = batched["per_second"] if batched else None
    new = report.get("new_sandbox")
    if new:
        label = (
            f"new sandbox: create_sandbox + schedule, {new['callers_per_worker']} "
            f"callers/worker over {new['runners']:,} runners"
        )
        add(label, new, new["per_second"], of(new["per_second"], batched_rate, " of batched"))
    for key, what in (("http", "placement"), ("http_new_sandbox", "new sandbox")):
        run = report.get(key)
        if not run:
            continue
        label = (
            f"{what} over HTTP: {run['replicas']} serve processes x "
            f"{run.get('connections_per_replica', 1)} connections{_http_cpu(run)}"
        )
        add(label, run, run["per_second"], of(run["per_second"], batched_rate, " of batched"))
    table.caption = _throughput_caption(report)
    table.caption_justify = "left"
    return table


def _http_cpu(run: dict[str, Any]) -> str:
    """CPU per placement of the serve processes and of PostgreSQL's backends."""
    serve = run.get("serve_cpu_ms_per_placement")
    database = run.get("database_cpu_ms_per_placement")
    if serve is None:
        return ""
    shown = f" (serve {serve:.2f} ms"
    if database is not None:
        shown += f", PostgreSQL {database:.2f} ms"
    shown += "/placement"
    batch = run.get("serve_batch_size_mean")
    if batch is not None:
        shown += f", mean batch {batch}"
    rest = (run.get("machine_cpu_shares") or {}).get("rest")
    if rest is not None:  # what serve's CPU per placement moves with (docs/performance.md)
        shown += f", other processes {rest:.0%} of the machine"
    return shown + ")"


def _scheduler_cpu(run: dict[str, Any]) -> str:
    """CPU per placement of the worker processes and of PostgreSQL's backends (in
    process), apart from the rest of the machine."""
    scheduler = run.get("scheduler_cpu_ms_per_placement")
    database = run.get("database_cpu_ms_per_placement")
    if scheduler is None:
        return ""
    shown = f" (scheduler {scheduler:.2f} ms"
    if database is not None:
        shown += f", PostgreSQL {database:.2f} ms"
    return shown + "/placement)"


def _cpu(row: dict[str, Any]) -> str:
    value = row.get("machine_cpu_ms_per_call")
    busy = row.get("machine_cpu_busy")
    return "-" if value is None or busy is None else f"{value:.2f} ({busy:.0%} busy)"


def _throughput_caption(report: dict[str, Any]) -> str:
    notes = [
        "per s: transactions (raw), placements (placement, contention: goodput); "
        "latency of successful calls; CPU: whole machine (workers and database) per call"
    ]
    if report.get("http"):
        notes.append(
            "over HTTP: one client process per serve process, its keep-alive connections each "
            "sending its next request when answered; latency measured by the client (request "
            "sent to answer parsed: loopback HTTP, uvicorn, FastAPI, JSON); serve and "
            "PostgreSQL CPU: the serve processes' and the bench database's backends' own"
        )
    steady = report.get("batched_steady")
    if steady:
        notes.append(
            "batched, open loop: requests arrive at the goal's rate (1.5 x raw 1, a Poisson "
            "stream) whether or not earlier ones were answered, each timed from its "
            f"arrival (queueing included); {steady['late_starts']:,} of {steady['calls']:,} "
            "found every caller busy"
        )
    contention = report.get("contention")
    if contention:
        state = contention["hot_runner_state"]
        room = contention["room_per_runner"]
        notes.append(
            f"contention: {contention['sandboxes']:,} sandboxes on {contention['hot_runners']} "
            f"runners with room for {room:,} each: {contention['placed']:,} placed, "
            f"{contention['outcomes'].get('refused', 0):,} refused (runner full); reserved <= "
            f"allocatable on every hot runner: "
            f"{'yes' if state['oversubscribed_runners'] == 0 else 'NO'}; reservations = "
            f"placements: {'yes' if state['reservations_match_placements'] else 'NO'}"
        )
    return "\n".join(notes)


def selection_table(report: dict[str, Any]) -> Table | None:
    selection = report.get("selection")
    if not selection:
        return None
    table = Table(title="Selection over one pool (median per call)", box=box.SIMPLE)
    columns = ("runners", "select_runner ms", "ratio", "create_sandbox ms", "ratio",
               "create + schedule ms", "ratio", "new sandboxes/s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for row in selection["rows"]:
        table.add_row(
            f"{row['runners']:,}",
            _ms(row["select_runner_ms"]),
            _ratio(row.get("select_runner_ratio")),
            _ms(row["create_sandbox_ms"]),
            _ratio(row.get("create_sandbox_ratio")),
            _ms(row["new_sandbox_ms"]),
            _ratio(row.get("new_sandbox_ratio")),
            f"{row['new_sandboxes_per_second']:,.0f}",
        )
    return table


def large_pool_table(report: dict[str, Any]) -> Table | None:
    large = (report.get("selection") or {}).get("large_pool")
    if not large:
        return None
    table = Table(title="create_sandbox over one large pool (median per call)", box=box.SIMPLE)
    columns = ("runners", "registered", "calls", "refused ms", "homed ms")
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(
        f"{large['runners']:,}",
        f"{large['registered']:,}",
        f"{large['calls']:,}",
        _ms(large["unmatched_ms"]),
        _ms(large["matched_ms"]),
    )
    table.caption = f"refused (a toolchain digest no runner has): {large['refusal']}"
    table.caption_justify = "left"
    return table


def history_table(report: dict[str, Any]) -> Table | None:
    history = report.get("history")
    if not history:
        return None
    table = Table(title="Loading a runner by history (median per load)", box=box.SIMPLE)
    for column in ("events", "snapshot at", "cold ms", "ratio", "warm ms", "ratio", "replay ms"):
        table.add_column(column, justify="right")
    for row in history["rows"]:
        table.add_row(
            f"{row['events']:,}",
            "-" if row["snapshot_version"] is None else f"{row['snapshot_version']:,}",
            f"{row['cold_ms']:.2f}",
            f"{row['cold_ratio']:.2f}",
            f"{row['warm_ms']:.3f}",
            f"{row['warm_ratio']:.2f}",
            f"{row['replay_ms']:,.1f}",
        )
    return table


def generations_table(report: dict[str, Any]) -> Table | None:
    rows = (report.get("history") or {}).get("generations")
    if not rows:
        return None
    table = Table(title="One sandbox by generations (stored and loaded)", box=box.SIMPLE)
    for column in ("generations", "sandbox events", "stored MB", "bytes per generation",
                   "latest snapshot bytes", "cold load ms"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['generations']:,}",
            f"{row['sandbox_events']:,}",
            f"{row['stored_bytes'] / 1e6:,.2f}",
            f"{row['bytes_per_generation']:,.0f}",
            f"{row['latest_snapshot_bytes']:,}",
            f"{row['cold_ms']:.2f}",
        )
    return table


def replay_table(report: dict[str, Any]) -> Table | None:
    replay = report.get("replay")
    if not replay:
        return None
    table = Table(title="Replay of the whole log", box=box.SIMPLE)
    columns = ("replay", "events", "seconds", "events/s", "raw read events/s", "ratio",
               "CPU us/event")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "replay" else "right")
    rows: list[tuple[dict[str, Any], str]] = [(replay["rebuild"], "projection rebuild")]
    audit = replay["audit_verify"]
    if "serial" in audit:
        rows.append((audit["serial"], "audit verify, 1 process"))
    rows.append((audit, f"audit verify, {audit.get('workers', 1)} processes"))
    if "audit_whatif" in replay:
        rows.append((replay["audit_whatif"], "audit whatif (no change)"))
    for row, label in rows:
        events = row.get("events", row.get("events_checked", 0))
        cpu = row.get("cpu_us_per_event")
        table.add_row(
            label,
            f"{events:,}",
            f"{row['seconds']:.2f}",
            f"{row['events_per_second']:,.0f}",
            f"{row['raw_read_events_per_second']:,.0f}",
            _ratio(row["ratio_to_raw_read"]),
            "-" if cpu is None else f"{cpu:,.1f}",
        )
    whatif = replay.get("audit_whatif")
    if whatif:
        table.caption = (
            f"audit whatif: {_ratio(whatif['ratio_to_audit_verify'])} x the audit verify rate; "
            f"{whatif['reproduced']:,} of {whatif['decisions']:,} decisions reproduced (the "
            "bench homes its sandboxes over one candidate each, fleet.py: a replay over the "
            "whole pool homes them elsewhere; only its rate is measured here)"
        )
        table.caption_justify = "left"
    return table


def audit_scale_table(report: dict[str, Any]) -> Table | None:
    scale = report.get("audit_scale")
    if not scale:
        return None
    table = Table(title="audit verify at scale (a child process each)", box=box.SIMPLE)
    for column in ("history", "events", "written in s", "verify s", "events/s",
                   "peak MB", "violations"):  # fmt: skip
        table.add_column(column, justify="left" if column == "history" else "right")
    one = scale["one_runner"]
    rows = [(f"steady fleet, {row['target_events']:,} events", row) for row in scale["steady"]]
    rows.append((f"one runner, {one['reservations']:,} live reservations", one))
    for label, row in rows:
        table.add_row(
            label,
            f"{row['events']:,}",
            f"{row.get('write_seconds', 0):,.1f}",
            f"{row['wall_seconds']:,.1f}",
            f"{row['events_per_second']:,.0f}",
            f"{row['peak_rss_mb']:,.1f}",
            f"{row['violations']:,}",
        )
    return table


def merkle_table(report: dict[str, Any]) -> Table | None:
    """The Merkle tree's upkeep over a batched run's events, and the --since re-audit."""
    merkle, since = report.get("merkle"), report.get("since")
    if not merkle and not since:
        return None
    table = Table(title="Merkle tree and incremental re-audit", box=box.SIMPLE)
    for column in ("measurement", "events", "seconds", "share or speedup"):
        table.add_column(column, justify="left" if column == "measurement" else "right")
    if merkle:
        table.add_row(
            f"batched placement ({merkle['placement']['placed']:,} placements)",
            f"{merkle['events']:,}",
            f"{merkle['placement']['seconds']:.2f}",
            "",
        )
        table.add_row(
            f"tree kept every {merkle['chunk_events']} events",
            f"{merkle['events']:,}",
            f"{merkle['eager_seconds']:.3f}",
            f"{merkle['eager_share']:.1%}",
        )
        table.add_row(
            "tree in one update (lazy)",
            f"{merkle['events']:,}",
            f"{merkle['lazy_seconds']:.3f}",
            f"{merkle['lazy_share']:.1%}",
        )
    if since:
        table.add_row("audit verify (whole log)", f"{since['events']:,}",
                      f"{since['full_seconds']:.3f}", "")  # fmt: skip
        speedup = "-" if since["speedup"] is None else f"{since['speedup']:g}x"
        table.add_row(
            f"audit verify --since tree size {since['checkpoint_size']:,}",
            f"{since['new_events']:,}",
            f"{since['since_seconds']:.3f}",
            speedup,
        )
    return table


def goals_table(report: dict[str, Any]) -> Table:
    table = Table(title="Goals", box=box.SIMPLE)
    for column in ("goal", "target", "measured", "verdict", "figures"):
        table.add_column(column)
    for name, goal in report["goals"].items():
        if goal["met"] is None:
            verdict = "[dim]not measured[/dim]"
        else:
            verdict = "[green]met[/green]" if goal["met"] else "[red]not met[/red]"
        value = "-" if goal["value"] is None else f"{goal['value']:g}"
        table.add_row(name, goal["target"], value, verdict, goal["detail"])
    return table


def print_report(report: dict[str, Any], console: Console) -> None:
    machine = report["machine"]
    settings = report["settings"]
    console.print(
        f"[bold]secondbox-scheduler bench[/bold]{' --quick' if settings['quick'] else ''}: "
        f"{report['database']}{' (kept)' if report['kept'] else ' (dropped)'}; "
        f"{machine['nproc']} CPUs ({machine['cpu']}), {machine['memory_gib']} GiB, "
        f"Python {machine['python']}, eventsourcing {machine['eventsourcing']}, "
        f"{machine['database']}; seed {settings['seed']}; "
        f"chain {'on' if settings.get('chain', True) else 'off'}; {report['wall_seconds']:.0f}s"
    )
    for table in (
        throughput_table(report),
        selection_table(report),
        large_pool_table(report),
        history_table(report),
        generations_table(report),
        replay_table(report),
        audit_scale_table(report),
        merkle_table(report),
        goals_table(report),
    ):
        if table is not None:
            console.print(table)
