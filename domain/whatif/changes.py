"""What a what-if replay changes about a recorded history (docs/audit.md, "audit whatif").

:class:`WhatIfChanges` is one value: runners drained, removed, resized or added (cloned
from a recorded one) from a time, another heartbeat timeout, another ranking policy,
and a window of the history. Changes combine. The same shape is read from a JSON or
YAML file by the command line (``infrastructure/audit/whatif_replay.py``); bad input raises
:class:`InvalidRequestError` naming the field and the rule, like every value type.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictFloat,
    StrictInt,
    model_validator,
)

from secondbox_scheduler.domain.placement.ranking import POLICIES, SEED, RankingPolicy
from secondbox_scheduler.domain.values import Capacity, Count, Text, UTCDatetime, Value


def _required_text(value: object) -> object:
    if isinstance(value, str) and not value:
        raise ValueError("must not be empty")
    return value


RunnerId = Annotated[Text, BeforeValidator(_required_text)]


def _policy(value: object) -> RankingPolicy:
    """A built-in policy by name, or any object with ``name`` and ``key``."""
    if isinstance(value, str):
        policy = POLICIES.get(value)
        if policy is None:
            raise ValueError(f"unknown policy {value!r}; choose one of {sorted(POLICIES)}")
        return policy
    if isinstance(value, RankingPolicy) and isinstance(getattr(value, "name", None), str):
        return value
    raise ValueError("must be a policy name, or an object with `name` and `key()`")


Policy = Annotated[
    Any,
    BeforeValidator(_policy),
    PlainSerializer(lambda policy: policy.name, when_used="json"),
]


class RunnerFrom(Value):
    """One runner, from a time (none: from the start of the window)."""

    runner: RunnerId
    at: UTCDatetime | None = None


class AllocatableFrom(Value):
    """A runner's allocatable from a time; dimensions not named keep their value."""

    runner: RunnerId
    at: UTCDatetime | None = None
    capacity: dict[str, Count]

    @model_validator(mode="after")
    def _known_dimensions(self) -> AllocatableFrom:
        unknown = sorted(set(self.capacity) - set(Capacity.DIMENSIONS))
        if unknown:
            raise ValueError(f"unknown dimensions {unknown}; use {list(Capacity.DIMENSIONS)}")
        if not self.capacity:
            raise ValueError("name at least one dimension")
        return self

    def applied_to(self, allocatable: Mapping[str, int]) -> dict[str, int]:
        return {dim: self.capacity.get(dim, allocatable[dim]) for dim in Capacity.DIMENSIONS}


class RunnerClones(Value):
    """New runners under new ids, each a copy of ``source`` from a time: its
    registration (pool, backend, architecture, capabilities, protocol range, egress
    contexts), its allocatable then, and its heartbeats and evidence as recorded."""

    source: RunnerId
    ids: tuple[RunnerId, ...]
    at: UTCDatetime | None = None

    @model_validator(mode="after")
    def _distinct_ids(self) -> RunnerClones:
        if not self.ids:
            raise ValueError("name at least one new runner id")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("new runner ids must be distinct")
        if self.source in self.ids:
            raise ValueError("a clone needs an id other than its source's")
        return self


Bound = StrictInt | UTCDatetime  # a notification position or a time


class Window(Value):
    """The part of the history whose decisions are replayed: from a position or time
    (earlier decisions are kept as recorded) until one (later events are not read)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    start: Bound | None = Field(default=None, alias="from")
    until: Bound | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        for name in ("start", "until"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 0:
                raise ValueError(f"{'from' if name == 'start' else name} must not be negative")
        start, until = self.start, self.until
        if (
            type(start) is type(until) and start is not None and until < start  # type: ignore[operator]
        ):
            raise ValueError("until must not be before from")
        return self


Seconds = Annotated[StrictFloat | StrictInt, Field(gt=0, le=10**9)]


class WhatIfChanges(Value):
    """Everything a what-if replay changes; the default changes nothing (identity)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    drain: tuple[RunnerFrom, ...] = ()
    remove: tuple[RunnerFrom, ...] = ()
    allocatable: tuple[AllocatableFrom, ...] = ()
    add: tuple[RunnerClones, ...] = ()
    heartbeat_timeout_seconds: Seconds | None = None
    policy: Policy = SEED
    window: Window = Window()

    @model_validator(mode="after")
    def _consistent(self) -> WhatIfChanges:
        added = [runner_id for clones in self.add for runner_id in clones.ids]
        if len(set(added)) != len(added):
            raise ValueError("a new runner id is added twice")
        return self

    @property
    def heartbeat_timeout(self) -> timedelta | None:
        seconds = self.heartbeat_timeout_seconds
        return None if seconds is None else timedelta(seconds=seconds)

    @property
    def is_identity(self) -> bool:
        """No change at all: the replay must reproduce the record."""
        return (
            not (self.drain or self.remove or self.allocatable or self.add)
            and self.heartbeat_timeout_seconds is None
            and self.policy is SEED
        )

    def runners_named(self) -> set[str]:
        """The recorded runners the changes name (their existence is checked by the replay)."""
        named = {change.runner for change in self.drain}
        named |= {change.runner for change in self.remove}
        named |= {change.runner for change in self.allocatable}
        return named | {clones.source for clones in self.add}

    def describe(self) -> list[str]:
        """One line per change, for reports."""
        lines = [f"drain {c.runner} from {_when(c.at)}" for c in self.drain]
        lines += [f"remove {c.runner} from {_when(c.at)}" for c in self.remove]
        lines += [
            f"allocatable of {c.runner} from {_when(c.at)}: "
            + ", ".join(f"{dim}={amount:,}" for dim, amount in c.capacity.items())
            for c in self.allocatable
        ]
        lines += [
            f"add {', '.join(c.ids)} (clones of {c.source}) from {_when(c.at)}" for c in self.add
        ]
        if self.heartbeat_timeout_seconds is not None:
            lines.append(f"heartbeat timeout {self.heartbeat_timeout_seconds:g}s")
        if self.policy is not SEED:
            lines.append(f"ranking policy {self.policy.name}")
        return lines or ["none (identity: the replay must reproduce the record)"]


def _when(at: datetime | None) -> str:
    return "the start" if at is None else at.isoformat().replace("+00:00", "Z")
