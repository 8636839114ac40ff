"""Refused placements recorded as evidence, on each sandbox's refusal log.

Best effort: recording never changes a refusal's answer. Several refusals (a batch's)
are recorded with one read of their sandboxes' logs and one save (one by one, with a
round trip and a commit each, they held up a batch's callers when a full fleet refused
most of it); when another replica recorded one of them first, each is recorded alone,
retried a few times, then dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.ids import refusal_log_uuid
from secondbox_scheduler.domain.refusals import Refusal, RefusalLog
from secondbox_scheduler.infrastructure.acting import stamp
from secondbox_scheduler.infrastructure.counters import SchedulerMetrics
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication


class RefusalRecorder:
    """Records refusals on the store, counting them in ``metrics``."""

    def __init__(self, store: StoredApplication, metrics: SchedulerMetrics) -> None:
        self.store = store
        self.metrics = metrics

    def record(self, refusals: Sequence[Refusal]) -> None:
        """Record refused placements as evidence: several (a batch's) with one read of
        their sandboxes' logs and one save (one by one, with a round trip and a commit
        each, they held up a batch's callers when a full fleet refused most of it); a
        lost race, or a single one: each alone, as best effort."""
        for refusal in refusals:
            self.metrics.refusal(refusal.operation, refusal.error)
        if len(refusals) > 1:
            loaded = self.store.load_many([refusal_log_uuid(r.sandbox_id) for r in refusals])
            logs: dict[str, RefusalLog] = {}
            recorded = 0
            for refusal in refusals:
                log = logs.get(refusal.sandbox_id) or loaded.get(
                    refusal_log_uuid(refusal.sandbox_id)
                )
                if not isinstance(log, RefusalLog):
                    log = RefusalLog.open(refusal.sandbox_id, refusal.decided_at)
                logs[refusal.sandbox_id] = log
                recorded += refusal.add_to(log)
                stamp(log.pending_events, refusal.actor)  # its own caller's, in a batch
            changed = [log for log in logs.values() if log.pending_events]
            try:
                if changed:  # all repeats of the last: nothing to save
                    self.store.save(*changed)
                    self.metrics.add("refusals_recorded", recorded)
                return
            except IntegrityError:
                pass  # another replica recorded one of them first: each alone
        for refusal in refusals:
            self._store_one(refusal)

    def _store_one(self, refusal: Refusal) -> None:
        for _ in range(4):
            log = self.store.load(refusal_log_uuid(refusal.sandbox_id), RefusalLog) or (
                RefusalLog.open(refusal.sandbox_id, refusal.decided_at)
            )
            if not refusal.add_to(log):
                return
            stamp(log.pending_events, refusal.actor)
            try:
                self.store.save(log)
                self.metrics.add("refusals_recorded")
                return
            except IntegrityError:
                continue
