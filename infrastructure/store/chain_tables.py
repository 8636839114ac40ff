"""The chain's tables and functions by name, a stored link read back, and what the
chained recorders share (the chain they write; domain/audit/chain.py).

Every stored event is covered by one row of ``<events table>_chain`` (position, previous
position, digest), written in the same transaction as the events
(:mod:`.chained_sqlite`, :mod:`.chained_postgres`); every snapshot by one row of
``<snapshots table>_seal`` (:mod:`.sealed_snapshots`). On PostgreSQL the events table's
lock is taken by ``<events table>_lock()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from secondbox_scheduler.domain.audit.chain import Chain, Link


def chain_table(events_table: str) -> str:
    return f"{events_table}_chain"


def seal_table(snapshots_table: str) -> str:
    return f"{snapshots_table}_seal"


def lock_function(events_table: str) -> str:
    return f"{events_table}_lock"


def as_link(row: Sequence[Any] | None) -> Link | None:
    """A row (position, previous, digest) of the chain table as a :class:`Link`."""
    return None if row is None else Link(int(row[0]), int(row[1]), bytes(row[2]))


class ChainedRecorder:
    """What the chained recorders share: the chain (keyed or not) they write."""

    chain: Chain = Chain()
    events_table_name: str

    def configure(self, chain: Chain) -> None:
        self.chain = chain

    @property
    def chain_table_name(self) -> str:
        return chain_table(self.events_table_name)
