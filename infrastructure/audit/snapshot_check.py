"""Every stored snapshot checked against the events it covers, for ``audit verify``.

:class:`SnapshotCheck` is fed the decoded events in log order by the verification
(:mod:`.verify`): it refolds each stream that has snapshots up to their versions and
compares each snapshot's seal (the chain digest at its version) and state with what the
events make of the aggregate there.
"""

from __future__ import annotations

from typing import Any

from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.store.chain_reads import stored_snapshots
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots


class SnapshotCheck:
    """Every stored snapshot against the events it covers: its seal (the chain digest at
    its version) and its state (the aggregate refolded from the events up to there)."""

    def __init__(self, app: SchedulerApplication) -> None:
        self.app = app
        self.checked = 0
        self.violations: list[Violation] = []
        recorder = app.snapshots.recorder if app.snapshots is not None else None
        self.sealed = isinstance(recorder, SealedSnapshots)
        rows = stored_snapshots(recorder)
        self.pending: dict[tuple[Any, int], tuple[Any, bytes | None, bytes | None, int]] = {}
        self.last: dict[Any, int] = {}
        for stored, seal, digest, position in rows:
            key = (stored.originator_id, stored.originator_version)
            self.pending[key] = (stored, seal, digest, position or 0)
            self.last[stored.originator_id] = max(
                self.last.get(stored.originator_id, 0), stored.originator_version
            )
        self.aggregates: dict[Any, Any] = {}
        self.broken: set[Any] = set()

    def apply(self, event: Any) -> None:
        stream = event.originator_id
        if stream not in self.last:
            return
        try:
            self.aggregates[stream] = event.mutate(self.aggregates.get(stream))
        except Exception:  # a tampered history; the chain names it
            self.aggregates.pop(stream, None)
            self.last.pop(stream, None)
            self.broken.add(stream)
            return
        version = event.originator_version
        found = self.pending.pop((stream, version), None)
        if found is not None:
            self._compare(found, self.aggregates[stream])
        if version >= self.last[stream]:
            self.aggregates.pop(stream, None)
            self.last.pop(stream, None)

    def _violation(self, stored: Any, position: int, detail: str) -> None:
        self.violations.append(
            Violation(
                position,
                str(stored.originator_id),
                f"snapshot v{stored.originator_version}",
                "snapshot",
                detail,
            )
        )

    def _compare(self, found: tuple[Any, bytes | None, bytes | None, int], aggregate: Any) -> None:
        stored, seal, digest, position = found
        self.checked += 1
        if self.sealed and digest is not None:
            reason = self.app.snapshots.recorder.refusal(stored, seal, digest)  # type: ignore[union-attr]
            if reason:
                self._violation(stored, position, reason)
                return
        mapper = self.app.mapper
        try:
            taken: Any = mapper.to_domain_event(stored)
            snapshot_class = type(taken)
            # both through the aggregate (a snapshot of an older class version is upcast
            # there), then taken and transcoded alike
            kept: Any = mapper.to_domain_event(
                mapper.to_stored_event(snapshot_class.take(taken.mutate(None)))
            )
            fresh: Any = mapper.to_domain_event(
                mapper.to_stored_event(snapshot_class.take(aggregate))
            )
        except Exception as error:
            self._violation(stored, position, f"cannot be read ({type(error).__name__})")
            return
        if kept.state != fresh.state:
            differ = sorted(
                k for k in kept.state.keys() | fresh.state.keys()
                if kept.state.get(k) != fresh.state.get(k)
            )  # fmt: skip
            self._violation(
                stored,
                position,
                f"its state differs from the events up to its version ({', '.join(differ)})",
            )

    def finish(self, stop: int | None, end: int) -> None:
        orphans = [s for s, _, _, position in self.pending.values() if not position]
        if len(orphans) > 3:  # the log was cut short under its snapshots
            self.checked += len(orphans)
            self.violations.append(
                Violation(end + 1, "-", "snapshots", "snapshot",
                          f"{len(orphans)} snapshots have no event at their version "
                          "(events deleted or the log truncated)")
            )  # fmt: skip
            self.pending = {k: v for k, v in self.pending.items() if v[3]}
        for stored, _, _, position in self.pending.values():
            if stop is None or position <= stop:
                self.checked += 1
                broken = stored.originator_id in self.broken
                self._violation(
                    stored,
                    position,
                    "cannot be checked: the events of its stream do not fold up to its version"
                    if broken
                    else "no event at its version",
                )
