"""The goals of ``secondbox-scheduler bench``: each figure of a report against its
target, as met, not met, or not measured in this run."""

from __future__ import annotations

from typing import Any

GOAL_PLACEMENT = 0.5
GOAL_CONTENTION = 0.3
GOAL_SELECTION = 3.0
GOAL_LARGE_POOL_UNMATCHED_MS = 100.0  # create_sandbox refused over 50,000 runners
GOAL_FLAT_SNAPSHOT = 1.1  # a snapshot may grow by the digits of larger numbers only
GOAL_HISTORY = 2.0
GOAL_REPLAY = 0.5
GOAL_BATCHED = 1.5  # batched placements/s over raw one-aggregate transactions/s
STRETCH_BATCHED = 2.0
LINE_VERSUS_ROW_LOCK = 0.5  # batched placements/s over the row-lock peer's placements/s
MOONSHOT_VERSUS_ROW_LOCK = 1.0
GOAL_BATCHED_CONTENTION = 0.5  # contended batched goodput over uncontended batched
GOAL_BATCHED_P99_MS = 50.0
GOAL_WHATIF = 0.5  # x the audit verify rate, on the same history
GOAL_AUDIT_MEMORY = 2.0  # audit verify peak memory, longest steady log over shortest
GOAL_AUDIT_RESERVATIONS = 10_000.0  # audit verify events/s, one runner, 6,000 reservations
GOAL_MERKLE_SHARE = 0.10  # the tree's upkeep over the batched placement time
GOAL_SINCE_SPEEDUP = 20.0  # full audit verify over --since of 1% new events
GOAL_HTTP = 0.5  # placements/s over HTTP over in-process batched placements/s, same run
STRETCH_HTTP = 0.8
GOAL_HTTP_P99_MS = 100.0
GOAL_NEW_SANDBOX = 0.5  # create_sandbox + schedule per s over batched placements/s


def _goal(target: str, value: float | None, met: bool | None, detail: str) -> dict[str, Any]:
    return {"target": target, "value": value, "met": met, "detail": detail}


def _skipped(target: str) -> dict[str, Any]:
    return _goal(target, None, None, "not measured in this run")


def _open_loop(report: dict[str, Any]) -> str:
    """The open-loop run's latency, beside the closed-loop figures (not part of the goal)."""
    steady = report.get("batched_steady")
    if not steady:
        return ""
    return (
        f"; open loop at {steady['offered_per_second']:,.0f} requests/s: p99 "
        f"{steady['p99_ms']:.1f} ms"
    )


def evaluate_goals(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    goals: dict[str, dict[str, Any]] = {}
    raw, placement = report.get("raw_baseline"), report.get("placement")
    target = f">= {GOAL_PLACEMENT} x two-aggregate raw baseline"
    if raw and placement:
        baseline = raw["two_aggregates"]["transactions_per_second"]
        ratio = placement["per_second"] / baseline if baseline else 0.0
        goals["placement_throughput"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_PLACEMENT,
            f"{placement['per_second']:,.0f} schedules/s vs {baseline:,.0f} two-aggregate "
            "transactions/s",
        )
    else:
        goals["placement_throughput"] = _skipped(target)

    contention = report.get("contention")
    target = f">= {GOAL_CONTENTION} x uncontended throughput, no oversubscription"
    if contention and placement:
        ratio = (
            contention["goodput_per_second"] / placement["per_second"]
            if placement["per_second"]
            else 0.0
        )
        state = contention["hot_runner_state"]
        clean = state["oversubscribed_runners"] == 0 and state["reservations_match_placements"]
        goals["contention_goodput"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_CONTENTION and clean,
            f"{contention['goodput_per_second']:,.0f} placements/s vs "
            f"{placement['per_second']:,.0f}; {state['oversubscribed_runners']} hot runners "
            f"oversubscribed; {contention['contention_errors']} contention errors",
        )
    else:
        goals["contention_goodput"] = _skipped(target)

    batched = report.get("batched")
    target = (
        f">= {GOAL_BATCHED} x raw one-aggregate transactions/s (stretch {STRETCH_BATCHED}), "
        f"p99 <= {GOAL_BATCHED_P99_MS:g} ms, no contention error"
    )
    if raw and batched:
        baseline = raw["one_aggregate"]["transactions_per_second"]
        ratio = batched["per_second"] / baseline if baseline else 0.0
        goals["batched_placement"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_BATCHED
            and batched["p99_ms"] <= GOAL_BATCHED_P99_MS
            and batched["contention_errors"] == 0,
            f"{batched['per_second']:,.0f} placements/s vs {baseline:,.0f} one-aggregate "
            f"transactions/s; p99 {batched['p99_ms']:.1f} ms; mean batch "
            f"{batched.get('batch_size_mean', 1)}; stretch {STRETCH_BATCHED}: "
            f"{'met' if ratio >= STRETCH_BATCHED else 'not met'}" + _open_loop(report),
        )
    else:
        goals["batched_placement"] = _skipped(target)

    row_lock = report.get("row_lock")
    target = (
        f"batched placements/s over the row-lock peer's: line {LINE_VERSUS_ROW_LOCK}, "
        f"moonshot {MOONSHOT_VERSUS_ROW_LOCK}"
    )
    if batched and row_lock and row_lock.get("per_second"):
        ratio = batched["per_second"] / row_lock["per_second"]
        goals["versus_row_lock"] = _goal(
            target,
            round(ratio, 3),
            ratio >= LINE_VERSUS_ROW_LOCK,
            f"{batched['per_second']:,.0f} vs {row_lock['per_second']:,.0f} row-lock "
            f"placements/s; moonshot: {'met' if ratio >= MOONSHOT_VERSUS_ROW_LOCK else 'not met'}",
        )
    else:
        goals["versus_row_lock"] = _skipped(target)

    contended = report.get("contention_batched")
    target = f">= {GOAL_BATCHED_CONTENTION} x uncontended batched, no oversubscription"
    if contended and batched and batched["per_second"]:
        ratio = contended["goodput_per_second"] / batched["per_second"]
        state = contended["hot_runner_state"]
        clean = state["oversubscribed_runners"] == 0 and state["reservations_match_placements"]
        goals["batched_contention_goodput"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_BATCHED_CONTENTION and clean and contended["contention_errors"] == 0,
            f"{contended['goodput_per_second']:,.0f} vs {batched['per_second']:,.0f} "
            f"placements/s; {state['oversubscribed_runners']} hot runners oversubscribed; "
            f"{contended['contention_errors']} contention errors",
        )
    else:
        goals["batched_contention_goodput"] = _skipped(target)

    selection = report.get("selection")
    target = f"create_sandbox at 10x the runners <= {GOAL_SELECTION} x the cost"
    if selection and len(selection["rows"]) >= 2:
        small, large = selection["rows"][-2], selection["rows"][-1]
        ratio = large["create_sandbox_ms"] / small["create_sandbox_ms"]
        goals["selection_scaling"] = _goal(
            target,
            round(ratio, 2),
            ratio <= GOAL_SELECTION,
            f"{large['runners']:,} runners {large['create_sandbox_ms']:.1f} ms vs "
            f"{small['runners']:,} runners {small['create_sandbox_ms']:.1f} ms",
        )
    else:
        goals["selection_scaling"] = _skipped(target)

    large = (selection or {}).get("large_pool")
    target = f"create_sandbox refused over the large pool <= {GOAL_LARGE_POOL_UNMATCHED_MS:g} ms"
    if large:
        goals["large_pool_unmatched"] = _goal(
            target,
            large["unmatched_ms"],
            large["unmatched_ms"] <= GOAL_LARGE_POOL_UNMATCHED_MS,
            f"{large['runners']:,} runners: refused {large['unmatched_ms']:.1f} ms, "
            f"homed {large['matched_ms']:.1f} ms (a toolchain digest no runner has)",
        )
    else:
        goals["large_pool_unmatched"] = _skipped(target)

    history = report.get("history")
    target = f"largest history load <= {GOAL_HISTORY} x smallest (cold and warm)"
    if history and history["rows"]:
        first, last = history["rows"][0], history["rows"][-1]
        worst = max(last["cold_ratio"], last["warm_ratio"])
        goals["history_growth"] = _goal(
            target,
            round(worst, 2),
            worst <= GOAL_HISTORY,
            f"{last['events']:,} events: cold {last['cold_ms']:.2f} ms "
            f"({last['cold_ratio']:.2f}x), warm {last['warm_ms']:.3f} ms "
            f"({last['warm_ratio']:.2f}x) vs {first['events']:,} events",
        )
    else:
        goals["history_growth"] = _skipped(target)

    generations = (history or {}).get("generations")
    target = f"a sandbox's latest snapshot flat and its load <= {GOAL_HISTORY} x by generations"
    if generations:
        first, last = generations[0], generations[-1]
        snapshot_ratio = last["latest_snapshot_bytes"] / max(1, first["latest_snapshot_bytes"])
        load_ratio = last["cold_ms"] / first["cold_ms"]
        goals["generation_growth"] = _goal(
            target,
            round(max(snapshot_ratio, load_ratio), 2),
            snapshot_ratio <= GOAL_FLAT_SNAPSHOT and load_ratio <= GOAL_HISTORY,
            f"{last['generations']:,} generations: snapshot {last['latest_snapshot_bytes']:,} B "
            f"({snapshot_ratio:.2f}x), cold load {last['cold_ms']:.2f} ms ({load_ratio:.2f}x), "
            f"{last['bytes_per_generation']:,.0f} B stored per generation",
        )
    else:
        goals["generation_growth"] = _skipped(target)

    replay = report.get("replay")
    for key, name, label in (
        ("audit_replay", "audit_verify", "audit verify"),
        ("projection_rebuild", "rebuild", "projection rebuild"),
    ):
        target = f">= {GOAL_REPLAY} x raw notification read rate"
        if replay:
            figures = replay[name]
            ratio = figures["ratio_to_raw_read"] or 0.0
            goals[key] = _goal(
                target,
                round(ratio, 3),
                ratio >= GOAL_REPLAY,
                f"{label} {figures['events_per_second']:,.0f} events/s vs raw read "
                f"{figures['raw_read_events_per_second']:,.0f} events/s",
            )
        else:
            goals[key] = _skipped(target)
    target = f">= {GOAL_WHATIF} x audit verify rate (events/s, same history)"
    whatif = replay.get("audit_whatif") if replay else None
    if replay and whatif:
        ratio = whatif["ratio_to_audit_verify"] or 0.0
        goals["whatif_replay"] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_WHATIF,
            f"audit whatif {whatif['events_per_second']:,.0f} events/s vs audit verify "
            f"{replay['audit_verify']['events_per_second']:,.0f} events/s",
        )
    else:
        goals["whatif_replay"] = _skipped(target)

    scale = report.get("audit_scale")
    target = f"audit verify peak memory, longest log over shortest <= {GOAL_AUDIT_MEMORY}"
    if scale:
        first, last = scale["steady"][0], scale["steady"][-1]
        goals["audit_memory"] = _goal(
            target,
            scale["memory_ratio"],
            scale["memory_ratio"] <= GOAL_AUDIT_MEMORY,
            f"{last['events']:,} events {last['peak_rss_mb']:,.0f} MB vs {first['events']:,} "
            f"events {first['peak_rss_mb']:,.0f} MB",
        )
    else:
        goals["audit_memory"] = _skipped(target)
    target = f"audit verify >= {GOAL_AUDIT_RESERVATIONS:,.0f} events/s on one busy runner"
    if scale:
        one = scale["one_runner"]
        goals["audit_reservations"] = _goal(
            target,
            one["events_per_second"],
            one["events_per_second"] >= GOAL_AUDIT_RESERVATIONS and one["violations"] == 0,
            f"{one['reservations']:,} live reservations on one runner: {one['events']:,} "
            f"events at {one['events_per_second']:,.0f}/s, {one['peak_rss_mb']:,.0f} MB",
        )
    else:
        goals["audit_reservations"] = _skipped(target)
    _merkle_goals(report, goals)
    goals.update(http_goals(report))
    goals.update(new_sandbox_goals(report))
    return goals


def http_goals(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``http_placement``: placements/s over HTTP (concurrent keep-alive clients per
    serve process) over in-process batched placements/s of the same run, with the
    client's p99 under its line and no contention error."""
    batched, over_http = report.get("batched"), report.get("http")
    target = (
        f">= {GOAL_HTTP} x in-process batched placements/s (stretch {STRETCH_HTTP}), "
        f"p99 <= {GOAL_HTTP_P99_MS:g} ms, no contention error"
    )
    if not (batched and over_http and batched.get("per_second")):
        return {"http_placement": _skipped(target)}
    ratio = over_http["per_second"] / batched["per_second"]
    met = (
        ratio >= GOAL_HTTP
        and over_http["p99_ms"] <= GOAL_HTTP_P99_MS
        and over_http["contention_errors"] == 0
    )
    detail = (
        f"{over_http['per_second']:,.0f} placements/s over HTTP vs {batched['per_second']:,.0f} "
        f"batched; p99 {over_http['p99_ms']:.1f} ms; {over_http['contention_errors']} "
        f"contention errors; stretch {STRETCH_HTTP}: "
        f"{'met' if ratio >= STRETCH_HTTP else 'not met'}"
    )
    return {"http_placement": _goal(target, round(ratio, 3), met, detail)}


def new_sandbox_goals(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``new_sandbox_placement`` and ``http_new_sandbox``: new sandboxes placed per second
    (``create_sandbox`` then ``schedule``), in process and over HTTP, over in-process
    batched placements/s of the same run."""
    batched = report.get("batched")
    goals: dict[str, dict[str, Any]] = {}
    for name, key, how in (
        ("new_sandbox_placement", "new_sandbox", "in process"),
        ("http_new_sandbox", "http_new_sandbox", "over HTTP"),
    ):
        target = (
            f"create_sandbox + schedule {how} >= {GOAL_NEW_SANDBOX} x batched placements/s, "
            "no contention error"
        )
        run = report.get(key)
        if not (batched and run and batched.get("per_second")):
            goals[name] = _skipped(target)
            continue
        ratio = run["per_second"] / batched["per_second"]
        goals[name] = _goal(
            target,
            round(ratio, 3),
            ratio >= GOAL_NEW_SANDBOX and run["contention_errors"] == 0,
            f"{run['per_second']:,.0f} new sandboxes placed/s {how} vs "
            f"{batched['per_second']:,.0f} batched placements/s; p99 {run['p99_ms']:.1f} ms; "
            f"{run['contention_errors']} contention errors",
        )
    return goals


def _merkle_goals(report: dict[str, Any], goals: dict[str, dict[str, Any]]) -> None:
    merkle = report.get("merkle")
    target = f"the Merkle tree's upkeep <= {GOAL_MERKLE_SHARE:.0%} of batched placement time"
    if merkle:
        goals["merkle_upkeep"] = _goal(
            target,
            merkle["lazy_share"],
            merkle["lazy_share"] <= GOAL_MERKLE_SHARE,
            f"{merkle['events']:,} events of {merkle['placement']['placed']:,} placements in "
            f"{merkle['placement']['seconds']:.1f}s: the tree over them in one update (as "
            f"kept: lazily) {merkle['lazy_seconds']:.3f}s ({merkle['lazy_share']:.1%}); kept "
            f"every {merkle['chunk_events']} events it would take "
            f"{merkle['eager_seconds']:.3f}s ({merkle['eager_share']:.1%})",
        )
    else:
        goals["merkle_upkeep"] = _skipped(target)
    since = report.get("since")
    target = f"audit verify --since of 1% new events >= {GOAL_SINCE_SPEEDUP:g} x a full verify"
    if since and since["speedup"] is not None:
        goals["since_reaudit"] = _goal(
            target,
            since["speedup"],
            since["speedup"] >= GOAL_SINCE_SPEEDUP and since["same_findings"],
            f"{since['new_events']:,} new events after tree size {since['checkpoint_size']:,}: "
            f"{since['since_seconds']:.3f}s vs {since['full_seconds']:.3f}s for all "
            f"{since['events']:,}; same findings: {since['same_findings']}",
        )
    else:
        goals["since_reaudit"] = _skipped(target)
