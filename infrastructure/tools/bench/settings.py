"""What one ``secondbox-scheduler bench`` run measures: its sections, the sizes and
durations of a full or ``--quick`` run, and where it reports progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

SECTIONS = (
    "raw",
    "placement",
    "contention",
    "batched",
    "row_lock",
    "http",
    "selection",
    "history",
    "replay",
    "audit",
    "merkle",
    "since",
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchSettings:
    """Sizes and durations of one run (``full`` or ``quick``)."""

    workers: int = 4
    runners: int = 1000
    quick: bool = False
    seed: int = 7
    raw_seconds: float = 10.0
    placement_seconds: float = 15.0
    contention_sandboxes: int = 3000  # a fixed amount of work, comparable across runs
    # the batched contention run's: it places about 1,300/s here, so 3,000 were done in
    # about 2 s, and one slow second of the shared machine decided its goal (0.477 and
    # 0.525 in two runs of the same code); 12,000 take about 9 s, as long as the
    # uncontended batched run it is compared with
    batched_contention_sandboxes: int = 12_000
    raw_batch: int = 32  # new aggregates per transaction of the batched raw baseline
    # concurrent schedule callers per worker of the batched runs: the knee of the
    # throughput curve (docs/performance.md: from 8-10 callers on, more add only queueing)
    callers: int = 10
    # callers per worker of the open-loop batched run (enough that arrivals never wait
    # for one while the scheduler keeps up; those that do are counted as late starts)
    open_loop_callers: int = 64
    # keep-alive connections per serve process of the http section (its client process
    # sends on each as the batched run's callers call: a closed loop): as many as the
    # batched run's callers per worker, so that both run at one concurrency (with the
    # direct schedule route a request spends little time outside the batcher: 10 gave
    # the rate of 16 and a lower p99 in four alternated pairs, docs/performance-log.md)
    http_connections: int = 10
    selection_sizes: tuple[int, ...] = (100, 1_000, 10_000)
    select_calls: tuple[int, ...] = (50, 20, 5)
    # medians of create_sandbox (and of a new sandbox end to end) per pool size: medians
    # of 10 and 5 calls moved the 10x ratio from 2.4 to 3.09 between two full runs of
    # the same code (docs/performance.md); 40 calls at 10,000 runners take about 2 s
    create_calls: tuple[int, ...] = (40, 40, 40)
    # create_sandbox over one pool this large: refused (a digest no runner has), homed
    large_pool: int = 50_000
    large_pool_calls: int = 10
    history_sizes: tuple[int, ...] = (10, 1_000, 100_000)
    history_repeat: int = 15
    generation_sizes: tuple[int, ...] = (100, 1_000, 10_000)
    # audit verify: a steady fleet's log at these lengths (peak memory), and one runner
    # with this many live reservations (events/s)
    audit_sizes: tuple[int, ...] = (100_000, 1_000_000)
    audit_reservations: int = 6_000
    sections: tuple[str, ...] = SECTIONS
    # the hash chain over the stored events (SECONDBOX_CHAIN); off only to measure its cost
    chain: bool = True

    @classmethod
    def make(
        cls,
        *,
        quick: bool = False,
        workers: int = 4,
        runners: int | None = None,
        seed: int = 7,
        seconds: float | None = None,
        sections: tuple[str, ...] = SECTIONS,
        chain: bool = True,
        callers: int | None = None,
        http_connections: int | None = None,
    ) -> BenchSettings:
        if quick:
            base = cls(
                workers=workers,
                runners=runners or 200,
                quick=True,
                seed=seed,
                raw_seconds=1.5,
                placement_seconds=2.0,
                contention_sandboxes=400,
                batched_contention_sandboxes=1_200,
                callers=8,
                http_connections=8,
                selection_sizes=(30, 300, 3_000),
                select_calls=(20, 10, 5),
                create_calls=(5, 5, 3),
                large_pool=5_000,
                large_pool_calls=3,
                history_sizes=(10, 1_000, 10_000),
                history_repeat=7,
                generation_sizes=(20, 100, 400),
                audit_sizes=(2_000, 10_000),
                audit_reservations=300,
                sections=sections,
                chain=chain,
            )
        else:
            base = cls(
                workers=workers, runners=runners or 1000, seed=seed, sections=sections, chain=chain
            )
        if callers is not None:
            base = replace(base, callers=callers)
        if http_connections is not None:
            base = replace(base, http_connections=http_connections)
        if seconds is not None:
            base = replace(base, raw_seconds=seconds, placement_seconds=seconds)
        return base

    def to_dict(self) -> dict[str, Any]:
        return {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(self).items()}
