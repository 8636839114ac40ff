"""The Merkle tree's cost and the incremental re-audit (sections ``merkle`` and ``since``
of ``secondbox-scheduler bench``; docs/audit.md, "Merkle tree").

``merkle``: a batched placement run (as section ``batched``: the batcher, several callers
per worker) on the bench's database, the tree brought up to date once the fleet is
written, then over exactly the events the placements wrote, twice: in one update (the
lazy design this release has: when a checkpoint or a proof is asked) and, for
comparison, in chunks of the events of one mean batch (the tree kept right after each
events transaction, the eager design). Each is timed against the placement run's wall
time: the share of the placement time that keeping the tree adds (goal: at most 10%,
for the design kept).

``since``: a steady fleet's log (SQLite, as section ``audit``) with 1% more events after
a checkpoint: ``audit verify`` of the whole log against ``audit verify --since`` that
checkpoint from the fold state sealed at it (goal: at least 20 times faster), and that
both find the same.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.merkle_checks import MerkleChecks
from secondbox_scheduler.infrastructure.audit.merkle_log import tree_head
from secondbox_scheduler.infrastructure.audit.signed_notes import Note, SignedCheckpoint
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.store.merkle_tree import MerkleTree
from secondbox_scheduler.infrastructure.tools.bench.audit_history import steady_history
from secondbox_scheduler.infrastructure.tools.bench.settings import BenchSettings, Progress
from secondbox_scheduler.infrastructure.tools.bench.throughput import measure_placement
from secondbox_scheduler.infrastructure.tools.bench.workers import WorkerPool

EVENTS_PER_PLACEMENT = 3  # a fence, its reservation, its token index


def measure_merkle(
    pool: WorkerPool,
    app: SchedulerApplication,
    env: dict[str, str],
    settings: BenchSettings,
    rate: float,
    progress: Progress,
) -> dict[str, Any]:
    tree = MerkleTree(app.recorder)
    sizes = []

    def caught_up() -> None:  # the fleet is written, its placements come next
        progress("merkle: the tree brought up to the log before the placements")
        sizes.append(tree.update())

    run = measure_placement(
        pool, app, env, settings, 3 * rate, progress,
        threads=settings.callers, pool_name="merkle", before_run=caught_up,
    )  # fmt: skip
    before = sizes[0]
    after = tree.log_size()
    events = after - before
    chunk = max(1, round(run.get("batch_size_mean", 1) * EVENTS_PER_PLACEMENT))
    progress(f"merkle: {events:,} events, the tree kept in chunks of {chunk} events")
    started = time.perf_counter()
    size = before
    updates = 0
    while size < after:
        size = tree.update(min(after, size + chunk))
        updates += 1
    eager = time.perf_counter() - started
    tree.truncate(before)
    progress(f"merkle: the same {events:,} events in one update")
    started = time.perf_counter()
    tree.update(after)
    lazy = time.perf_counter() - started
    wall = float(run["seconds"]) or 1.0
    return {
        "placement": {
            key: run[key] for key in ("placed", "per_second", "seconds", "batch_size_mean")
        },
        "events": events,
        "chunk_events": chunk,
        "eager_updates": updates,
        "eager_seconds": round(eager, 4),
        "lazy_seconds": round(lazy, 4),
        "eager_share": round(eager / wall, 4),
        "lazy_share": round(lazy / wall, 4),
        "tree_events_per_second": round(events / lazy, 1) if lazy else None,
        "ledger": run["ledger"],  # the placements' runners as stored (bench exits 1 on a fault)
    }


def measure_since(settings: BenchSettings, progress: Progress) -> dict[str, Any]:
    size = settings.audit_sizes[0]
    with tempfile.TemporaryDirectory(prefix="secondbox-since-bench-") as directory:
        url = f"sqlite:///{Path(directory) / 'since.db'}"
        app = SchedulerApplication(env={DATABASE_URL: url})
        try:
            progress(f"since: a steady fleet's log of {size:,} events")
            steady_history(app, size, progress=progress)
            cut, head = tree_head(app)
            checkpoint = SignedCheckpoint("bench", cut, head)
            note = Note(checkpoint.body())
            progress(f"since: the fold state sealed at tree size {cut:,}")
            sealed = verify(
                app, measure_raw=False, merkle=MerkleChecks(signed=[(note, checkpoint)]),
                save_state=True,
            )  # fmt: skip
            assert sealed.state is not None
            steady_history(
                app, max(1, cut // 100), runners=2, sandboxes=max(2, cut // 1000),
                progress=progress, prefix="since-later",
            )  # fmt: skip
            progress("since: audit verify of the whole log")
            started = time.perf_counter()
            full = verify(app, measure_raw=False, workers=1)  # as --since: one process
            full_seconds = time.perf_counter() - started
            progress(f"since: audit verify --since the checkpoint of tree size {cut:,}")
            started = time.perf_counter()  # the state read and restored included
            since = verify(
                app,
                measure_raw=False,
                merkle=MerkleChecks(since=(note, checkpoint), since_state=sealed.state),
            )
            since_seconds = time.perf_counter() - started
        finally:
            app.close()
    return {
        "checkpoint_size": cut,
        "events": full.events,
        "new_events": since.events,
        "full_seconds": round(full_seconds, 3),
        "since_seconds": round(since_seconds, 3),
        "speedup": round(full_seconds / since_seconds, 2) if since_seconds else None,
        "state_bytes": len(sealed.state),
        "same_findings": [v.to_dict() for v in full.violations]
        == [v.to_dict() for v in since.violations],
        "violations": len(full.violations),
    }
