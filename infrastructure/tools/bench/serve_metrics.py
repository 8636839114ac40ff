"""What the ``http`` section reads of its serve processes besides their CPU: the batches
they ran and their garbage collections (from each replica's ``/metrics``, before and
after the run), and how their CPU split between the event loop's thread and the rest
(the batch leader, the store's connections), from ``/proc/<pid>/task``.

serve's CPU per HTTP placement falls as its batches grow (a batch's commit, its wake-ups
and its loop iterations are shared by its requests), so a figure of CPU per placement is
read with the mean batch it came from.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from secondbox_scheduler.infrastructure.tools.bench.process_cpu import PROC

BATCHES = "secondbox_scheduler_placement_batch_size_count"
BATCHED = "secondbox_scheduler_placement_batch_size_sum"
GC_GENERATIONS = ("0", "1", "2")
PROBE_INTERVAL = 0.25  # seconds between two runs of the speed probe
PROBE_LOOPS = 20_000  # iterations of the probe's fixed work (about 1 ms)


def series(text: str, name: str) -> float:
    """A series' value in a Prometheus text scrape, ``name`` with its labels if any, as
    ``python_gc_collections_total{generation="2"}`` (0 if absent)."""
    prefix = name + " "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :].split()[0])
    return 0.0


def scrape_figures(text: str) -> dict[str, float]:
    """The batches and collections of one scrape (counters: read a difference)."""
    figures = {"batches": series(text, BATCHES), "batched": series(text, BATCHED)}
    for generation in GC_GENERATIONS:
        name = f'python_gc_collections_total{{generation="{generation}"}}'
        figures[f"gc{generation}"] = series(text, name)
    return figures


def difference(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}


def task_figures(pids: Iterable[int]) -> dict[str, tuple[float, int, int]]:
    """Of each thread of ``pids`` now alive (``/proc/<pid>/task``), by ``pid/tid``: its CPU
    seconds if it is a main thread (serve's event loop; the rest of a process's CPU is
    its other threads': the batch leader, the store's), and its voluntary and
    involuntary context switches (a thread that waits; one the kernel preempts for
    another process). :func:`task_difference` of two readings."""
    found: dict[str, tuple[float, int, int]] = {}
    hz = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            tids = os.listdir(f"{PROC}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                cpu = 0.0
                if tid == str(pid):
                    with open(f"{PROC}/{pid}/task/{tid}/stat", "rb") as stat:
                        fields = stat.read().rsplit(b")", 1)[-1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / hz
                voluntary = involuntary = 0
                with open(f"{PROC}/{pid}/task/{tid}/status", "rb") as status:
                    for line in status:
                        if line.startswith(b"voluntary_ctxt_switches:"):
                            voluntary = int(line.split()[1])
                        elif line.startswith(b"nonvoluntary_ctxt_switches:"):
                            involuntary = int(line.split()[1])
            except (OSError, IndexError, ValueError):
                continue
            found[f"{pid}/{tid}"] = (cpu, voluntary, involuntary)
    return found


def task_difference(
    before: Mapping[str, tuple[float, int, int]], after: Mapping[str, tuple[float, int, int]]
) -> dict[str, float]:
    """The main threads' CPU and every thread's switches between two :func:`task_figures`
    (a thread new since ``before``: all of its; one gone by ``after``: none)."""
    zero = (0.0, 0, 0)
    deltas = [
        tuple(a - b for a, b in zip(now, before.get(key, zero), strict=True))
        for key, now in after.items()
    ]
    return {
        "main_cpu": sum(d[0] for d in deltas),
        "voluntary": float(sum(d[1] for d in deltas)),
        "involuntary": float(sum(d[2] for d in deltas)),
    }


def _stat_ticks() -> list[int]:
    """The machine's CPU ticks from ``/proc/stat`` (user, nice, system, idle, iowait,
    irq, softirq, steal, ...); empty elsewhere."""
    try:
        with open(f"{PROC}/stat") as stat:
            return [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def _probe_once() -> float:
    """Thread CPU microseconds of a fixed piece of pure Python work."""
    started = time.thread_time()
    total = 0
    for i in range(PROBE_LOOPS):
        total += i * i % 7
    return (time.thread_time() - started) * 1e6


class SpeedProbe:
    """Times a fixed piece of Python work every :data:`PROBE_INTERVAL` in a thread of
    the bench's own process while a section runs: how much CPU time the same work took
    on the machine as it was (a slower or busier machine: more). Its cost: about 0.4 %
    of one CPU. Also the share of the machine's CPU time its hypervisor stole over the
    window (``/proc/stat``)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._ticks: list[int] = []
        self.steal_share: float | None = None  # of the machine's CPU time, over the window
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-speed-probe", daemon=True)

    def __enter__(self) -> SpeedProbe:
        self._ticks = _stat_ticks()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        after = _stat_ticks()
        used = [a - b for a, b in zip(after, self._ticks, strict=False)]
        total = sum(used[:8])  # guest time is counted in user time already
        self.steal_share = round(used[7] / total, 4) if len(used) > 7 and total > 0 else None

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL):
            self.samples.append(_probe_once())

    def median_us(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return round(ordered[len(ordered) // 2], 1)


def serve_summary(
    figures: list[dict[str, float]],
    placed: list[int],
    tasks: Mapping[str, float] | None,
    serve_cpu: float | None,
) -> dict[str, Any]:
    """The run's serve figures: batches and mean batch over every replica, the mean
    batch of each, collections by generation; of ``tasks`` (:func:`task_figures` over
    the run, with ``serve_cpu`` the processes' CPU seconds): the event loop's share of
    serve's CPU and the context switches per placement."""
    batches = sum(f.get("batches", 0.0) for f in figures)
    batched = sum(f.get("batched", 0.0) for f in figures)
    summary: dict[str, Any] = {
        "serve_batches": int(batches),
        "serve_batch_size_mean": round(batched / batches, 2) if batches else None,
        "serve_batch_size_mean_by_replica": [
            round(f["batched"] / f["batches"], 2) if f.get("batches") else None for f in figures
        ],
        "serve_placed_by_replica": placed,
        "serve_gc_collections": {
            generation: int(sum(f.get(f"gc{generation}", 0.0) for f in figures))
            for generation in GC_GENERATIONS
        },
    }
    done = sum(placed)
    if tasks is not None and serve_cpu and done:
        summary["serve_loop_cpu_share"] = round(min(1.0, tasks["main_cpu"] / serve_cpu), 3)
        for kind in ("voluntary", "involuntary"):
            summary[f"serve_{kind}_switches_per_placement"] = round(tasks[kind] / done, 2)
    return summary
