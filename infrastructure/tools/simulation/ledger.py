"""The simulation's own ledger of reservations, checked against the store at the end."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot


@dataclass
class Ledger:
    """Reservations as the simulation saw them placed and released, with peaks."""

    pool_of: dict[str, str]
    reserved: dict[str, Counter[str]] = field(default_factory=dict)
    peak: dict[str, Counter[str]] = field(default_factory=dict)
    pool_reserved: dict[str, Counter[str]] = field(default_factory=dict)
    pool_peak: dict[str, Counter[str]] = field(default_factory=dict)

    def change(self, runner_id: str, capacity: Capacity, sign: int) -> None:
        pool = self.pool_of[runner_id]
        for dim, amount in capacity.as_dict().items():
            for used, peak, key in (
                (self.reserved, self.peak, runner_id),
                (self.pool_reserved, self.pool_peak, pool),
            ):
                now = used.setdefault(key, Counter())
                now[dim] += sign * amount
                top = peak.setdefault(key, Counter())
                top[dim] = max(top[dim], now[dim])

    def matches(self, snapshots: Iterable[RunnerSnapshot]) -> bool:
        for snapshot in snapshots:
            held = self.reserved.get(snapshot.id, Counter())
            if any(held[dim] != amount for dim, amount in snapshot.reserved.as_dict().items()):
                return False
        return True
