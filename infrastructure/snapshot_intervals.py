"""How often each aggregate is snapshotted (docs/spec.md, section 4; docs/architecture.md
"Snapshots").

A snapshot holds an aggregate's whole state; a Runner's holds one record per active
reservation. Snapshotted every ``base`` events whatever its size, a runner holding
thousands of reservations wrote a snapshot of all of them every tenth placement on it:
on one runner at 2,500 to 3,000 reservations about 85 KB of JSON encoded, hashed,
compressed and logged per placement, three times the rest of a batch's cost (the
contended bench: the goodput fell as the hot runners filled). So a Runner's interval
doubles with each doubling of its active reservations past
``RESERVATIONS_AT_BASE_INTERVAL``: the snapshot work per placement stays bounded (about
``RESERVATIONS_AT_BASE_INTERVAL / base`` to twice that many records per event), and a
cold load replays at most the interval's events after the latest snapshot, about a
tenth of the reservations the snapshot holds. Every interval is ``base`` times a power
of two, so a version at a multiple of a longer interval is one of every shorter one:
a runner whose reservations fall back snapshots on the shorter grid at once.
"""

from __future__ import annotations

from typing import Any

from secondbox_scheduler.domain.runner import Runner

RESERVATIONS_AT_BASE_INTERVAL = 128  # up to this many: the base interval


def snapshotting_interval(aggregate: Any, base: int) -> int:
    """The interval for ``aggregate`` as it is now (``base``: its class's)."""
    if isinstance(aggregate, Runner):
        return base * reservations_factor(len(aggregate.reservations))
    return base


def reservations_factor(reservations: int) -> int:
    """1 up to ``RESERVATIONS_AT_BASE_INTERVAL`` active reservations, then 2, 4, 8, ...
    for each doubling past it."""
    if reservations <= RESERVATIONS_AT_BASE_INTERVAL:
        return 1
    return 1 << ((reservations - 1) // RESERVATIONS_AT_BASE_INTERVAL).bit_length()
