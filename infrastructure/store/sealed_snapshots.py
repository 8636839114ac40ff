"""What the sealing snapshot recorders share (:class:`SealedSnapshots`).

:class:`~.sealed_sqlite.SealedSQLiteSnapshots` and
:class:`~.sealed_postgres.SealedPostgresSnapshots` store each snapshot with a seal
(``<snapshots table>_seal``) over the chain digest of the event at the snapshot's
version, and return from ``select_events`` only snapshots whose seal checks: a forged,
edited or mismatched snapshot is dropped with a warning, and the repository then loads
the aggregate from its events.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import StoredEvent

from secondbox_scheduler.domain.audit.chain import Chain

log = logging.getLogger("secondbox_scheduler.chain")

UNCHAINED = "no chain link at its version (written before the chain)"


class SealedSnapshots:
    """What the sealing snapshot recorders share."""

    chain: Chain = Chain()
    events_table_name: str
    chained_events_table: str = "stored_events"

    def configure(self, chain: Chain, events_table: str) -> None:
        self.chain = chain
        self.chained_events_table = events_table

    def seal_for(self, event: StoredEvent, chain_digest: bytes) -> bytes:
        return self.chain.seal(
            chain_digest, event.originator_id, event.originator_version, event.topic, event.state
        )

    def refusal(self, event: StoredEvent, seal: bytes | None, chain_digest: bytes | None) -> str:
        """Why this stored snapshot cannot be trusted ("" if its seal checks)."""
        if chain_digest is None:
            return UNCHAINED
        if seal is None:
            return "no seal"
        if not hmac.compare_digest(self.seal_for(event, chain_digest), seal):
            return "its seal does not match its state and the chain at its version"
        return ""

    def select_latest(self, originator_ids: Sequence[UUID]) -> dict[UUID, StoredEvent]:
        """The latest snapshot of each stream whose seal checks, with one query for all
        (a stream whose latest snapshot does not check is absent: load it from its
        events). A placement batch reads its cold aggregates this way."""
        raise NotImplementedError

    def select_latest_and_after(
        self, originator_ids: Sequence[UUID]
    ) -> tuple[dict[UUID, StoredEvent], list[StoredEvent], set[UUID]] | None:
        """With one query: the latest snapshot of each stream whose seal checks, the
        events after each stream's latest snapshot (all its events if it has none), and
        the streams whose latest snapshot was refused (their events up to it are still
        to read). None: this store reads them with :meth:`select_latest` and a second
        query."""
        return None

    def verified(self, rows: Sequence[tuple[StoredEvent, Any, Any]]) -> list[StoredEvent]:
        """The snapshots whose seal checks; each other one logged and dropped."""
        kept = []
        for event, seal, chain_digest in rows:
            reason = self.refusal(
                event,
                None if seal is None else bytes(seal),
                None if chain_digest is None else bytes(chain_digest),
            )
            if not reason:
                kept.append(event)
                continue
            (log.debug if reason == UNCHAINED else log.warning)(
                "snapshot of %s at version %s refused (%s): loading it from its events",
                event.originator_id,
                event.originator_version,
                reason,
            )
        return kept
