"""What a placement batch needs of the service, and nothing more: the port it depends on.

The batch (:mod:`.batch`) decides with the domain (``domain/placement/deciding.py``)
and reaches the store only through :class:`PlacementStore`; the application service
provides it (``infrastructure/application.py``), and a test can provide another (for
example one that commits a rival's events between the decision and the save). The
batch never sees the application itself, so the dependency points one way: application
-> batch -> port.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.domain.refusals import Refusal
from secondbox_scheduler.domain.values import DurableAssignment
from secondbox_scheduler.infrastructure.placing.runner_locks import RunnerLocks

# A request's answer: its assignment and whether this call created it, or the refusal.
Outcome = tuple[DurableAssignment, bool] | SchedulerError


class PlacementCounters(Protocol):
    """The counters a batch moves (``infrastructure/counters.py``)."""

    def add(self, name: str, amount: int = 1) -> None: ...

    def batch(self, size: int) -> None: ...


class PlacementStore(Protocol):
    """Loads, ordered saves and refusal records, for one placement batch."""

    @property
    def runner_locks(self) -> RunnerLocks:
        """The runner locks (:mod:`.runner_locks`): liveness only, never correctness."""

    @property
    def metrics(self) -> PlacementCounters:
        """The service's counters."""

    def now(self) -> datetime:
        """The scheduler's clock."""

    def backoff(self, retry: int) -> None:
        """Wait before retry number ``retry`` (full jitter)."""

    def load_many(
        self, aggregate_ids: Sequence[UUID], *, cache_new: bool = True
    ) -> dict[UUID, Any]:
        """Up-to-date copies of the aggregates that exist, by id."""

    def load_stored(self, aggregate_id: UUID) -> Any | None:
        """The aggregate as stored now, to read a few fields (never to command)."""

    def save_in_order(self, events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None:
        """Save the events in one transaction in this order (IntegrityError when a stream
        moved), with the snapshots of ``aggregates`` a save of them would take."""

    def cache_committed(self, aggregates: Sequence[Any]) -> None:
        """The committed aggregates replace their cached copies."""

    def stream_versions(self, stream_ids: Sequence[UUID]) -> dict[UUID, int]:
        """The last stored version of each stream (absent: no such stream)."""

    def record_refusals(self, refusals: Sequence[Refusal]) -> None:
        """Record placement refusals as evidence (best effort)."""
