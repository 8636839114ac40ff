"""The fleet changes of a what-if replay, applied when they fall due.

The changes of :class:`~.changes.WhatIfChanges` to runners (drained, removed, resized,
added as clones) apply to the counterfactual fleet from their time: those without one
from the start of the window, the others in time order (ties in the order given) at the
first event stamped at or after it. A change of a runner the history has not registered
yet waits for its registration. :class:`ScheduledChanges` holds them; the engine
(:mod:`.engine`) fires the due ones before each event and tells it of registrations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.whatif.changes import (
    AllocatableFrom,
    RunnerClones,
    RunnerFrom,
    WhatIfChanges,
)
from secondbox_scheduler.domain.whatif.fleet import Fleet


@dataclass(frozen=True)
class ScheduledChange:
    """One change of the fleet, from ``at``."""

    at: datetime | None  # None: from the start of the window
    order: int
    runner: str  # the recorded runner it waits for
    apply: Callable[[], bool]  # False: that runner is not registered yet


class ScheduledChanges:
    """The runner changes of ``changes``, applied to ``fleet`` as they fall due."""

    def __init__(self, changes: WhatIfChanges, fleet: Fleet) -> None:
        self.fleet = fleet
        self.due = self._in_order(changes)  # the changes not applied yet, first due first
        self.waiting: dict[str, list[ScheduledChange]] = {}  # by the runner they wait for
        self.clone_ids = {runner_id for c in changes.add for runner_id in c.ids}

    def _in_order(self, changes: WhatIfChanges) -> list[ScheduledChange]:
        found: list[tuple[datetime | None, str, Callable[[], bool]]] = []
        for drain in changes.drain:
            found.append((drain.at, drain.runner, functools.partial(self._drain, drain)))
        for removal in changes.remove:
            found.append((removal.at, removal.runner, functools.partial(self._remove, removal)))
        for resize in changes.allocatable:
            apply = functools.partial(self._allocatable, resize)
            found.append((resize.at, resize.runner, apply))
        for clones in changes.add:
            found.append((clones.at, clones.source, functools.partial(self._add, clones)))
        scheduled = [ScheduledChange(at, order, runner, apply) for order, (at, runner, apply) in
                     enumerate(found)]  # fmt: skip
        untimed = [change for change in scheduled if change.at is None]
        timed = sorted((c for c in scheduled if c.at is not None), key=lambda c: (c.at, c.order))
        return untimed + timed

    def fire(self, moment: datetime) -> None:
        """Apply every change due at ``moment``; those of runners not registered yet
        wait for their registration."""
        due = self.due
        while due and (due[0].at is None or moment >= due[0].at):
            change = due.pop(0)
            if not change.apply():
                self.waiting.setdefault(change.runner, []).append(change)

    def registered(self, runner_id: str) -> None:
        """The history registered ``runner_id``: apply the changes waiting for it."""
        for change in self.waiting.pop(runner_id, []):
            change.apply()

    def _drain(self, change: RunnerFrom) -> bool:
        runner = self.fleet.runners.get(change.runner)
        if runner is None:
            return False
        runner.drained = True
        self.fleet.drain(runner, True)
        return True

    def _remove(self, change: RunnerFrom) -> bool:
        runner = self.fleet.runners.get(change.runner)
        if runner is None:
            return False
        runner.removed = True
        self.fleet.leave(runner)
        return True

    def _allocatable(self, change: AllocatableFrom) -> bool:
        runner = self.fleet.runners.get(change.runner)
        if runner is None:
            return False
        runner.fixed = True
        if not runner.removed:
            self.fleet.resize(runner, change.applied_to(runner.pending or runner.allocatable))
        return True

    def _add(self, change: RunnerClones) -> bool:
        source = self.fleet.runners.get(change.source)
        if source is None:
            return False
        for runner_id in change.ids:
            if runner_id in self.fleet.runners:
                raise InvalidRequestError(
                    "add", f"runner {runner_id!r} is already registered in the history"
                )
            self.fleet.clone(source, runner_id)
        return True
