"""How loading a Runner costs as its history grows (``secondbox-scheduler bench history``,
and the history section of ``secondbox-scheduler bench``).

For each history size it builds one runner whose stream holds that many events
(reservation/release pairs made by the Runner aggregate itself, saved in batches),
then times loading it three ways on the same store:

- ``cold``: a new application, no aggregate cache: latest snapshot plus the events
  after it (what a freshly started replica pays once per runner);
- ``warm``: the aggregate cache with fast-forward: one query for events after the
  cached version (what every placement pays);
- ``replay``: snapshots off and no cache: every event of the stream (the cost that
  snapshots avoid), shown for comparison.

Each figure is the median of several loads; ratios are against the smallest size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import Capacity
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.tools.bench.generations import measure_generations
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.timing import median_ms

BATCH = 1000
ONE = Capacity(vcpu_count=1, memory_bytes=1, disk_bytes=1, instances=1, operations=1)
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class HistoryRow:
    events: int
    snapshot_version: int | None
    tail_events: int
    cold_ms: float
    warm_ms: float
    replay_ms: float
    cold_ratio: float = 1.0
    warm_ratio: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_history(app: SchedulerApplication, runner_id: str, events: int) -> None:
    """Register ``runner_id`` and grow its stream to exactly ``events`` events."""
    app.register_runner(
        runner_id=runner_id,
        pool_name="bench",
        backend_kind="firecracker",
        architecture="x86_64",
        capabilities=["compute"],
        allocatable=Capacity(
            vcpu_count=10**6,
            memory_bytes=10**6,
            disk_bytes=10**6,
            instances=10**6,
            operations=10**6,
        ),
        guest_protocol_minimum=1,
        guest_protocol_maximum=1,
    )
    remaining = events - 1
    pair = 0
    while remaining > 0:
        runner: object = app.repository.get(runner_uuid(runner_id))
        assert isinstance(runner, Runner)
        at = T0 + timedelta(seconds=pair)
        for _ in range(min(BATCH, remaining)):
            key = f"bench-{pair // 2}"
            if pair % 2 == 0:
                runner.reserve(assignment_id=key, sandbox_id=key, generation=1, capacity=ONE, at=at)
            else:
                runner.release(sandbox_id=key, generation=1, release_proof={"bench": "1"}, at=at)
            pair += 1
            remaining -= 1
        app.save(runner)


def measure_history(
    env: Mapping[str, str],
    sizes: Sequence[int] = (10, 1_000, 100_000),
    repeat: int = 15,
    progress: Callable[[str], None] = lambda _: None,
) -> list[HistoryRow]:
    """Build one runner per size on the store named by ``env`` and time its loads."""
    writer = SchedulerApplication(env=dict(env))
    stamp = time.strftime("%Y%m%d%H%M%S")
    rows: list[HistoryRow] = []
    try:
        for size in sizes:
            runner_id = f"history-{stamp}-{size}"
            progress(f"building a runner with {size:,} events")
            build_history(writer, runner_id, size)
            aggregate_id = runner_uuid(runner_id)
            snapshot_version = None
            if writer.snapshots is not None:
                latest = list(writer.snapshots.get(aggregate_id, desc=True, limit=1))
                snapshot_version = latest[0].originator_version if latest else None
            progress(f"timing loads of the runner with {size:,} events")
            cold_app = SchedulerApplication(env={**env, "AGGREGATE_CACHE_MAXSIZE": ""})
            warm_app = SchedulerApplication(env=dict(env))
            replay_app = SchedulerApplication(
                env={**env, "AGGREGATE_CACHE_MAXSIZE": "", "IS_SNAPSHOTTING_ENABLED": "n"}
            )
            try:
                warm_app.repository.get(aggregate_id)
                cold = median_ms(partial(cold_app.repository.get, aggregate_id), repeat)
                warm = median_ms(partial(warm_app.repository.get, aggregate_id), repeat)
                replay = median_ms(
                    partial(replay_app.repository.get, aggregate_id), max(3, repeat // 5)
                )
            finally:
                for app in (cold_app, warm_app, replay_app):
                    app.close()
            rows.append(
                HistoryRow(
                    events=size,
                    snapshot_version=snapshot_version,
                    tail_events=size - (snapshot_version or 0),
                    cold_ms=cold,
                    warm_ms=warm,
                    replay_ms=replay,
                )
            )
    finally:
        writer.close()
    base = rows[0]
    return [
        HistoryRow(
            **{
                **row.to_dict(),
                "cold_ratio": row.cold_ms / base.cold_ms,
                "warm_ratio": row.warm_ms / base.warm_ms,
            }
        )
        for row in rows
    ]


def measure_history_section(
    env: dict[str, str], settings: BenchSettings, progress: Progress
) -> dict[str, Any]:
    """The history section of a bench run: :func:`measure_history` at the run's sizes,
    and a sandbox's growth by generations (:mod:`.generations`)."""
    rows = measure_history(env, settings.history_sizes, settings.history_repeat, progress)
    generations = measure_generations(
        env, settings.generation_sizes, settings.history_repeat, progress
    )
    return {
        "rows": [row.to_dict() for row in rows],
        "generations": [row.to_dict() for row in generations],
    }
