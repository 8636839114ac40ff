"""``projections verify``: every read model compared, row by row, with a fold of the log.

Invariant 7 (docs/spec.md, section 7) says a read model equals what the aggregates
fold to. This module checks it on a live store, independently of the projections' own
code: the expected values are the aggregates' (``Runner`` with its ``RunnerLease`` for
``runner_snapshots``; each ``Sandbox``'s event history, every generation, for
``assignments``), the runners and sandboxes being those the log registered and created
(read from the notification log, never from the read models). Each difference names
the read model, the row (runner id; ``sandbox/generation``), the field, and both values:

- a field that differs (nested ones dotted: ``reserved.instances``; on SQLite also
  ``materialization_digests``, the runner's pairs in the side table of
  ``projections.runner_snapshots``, and such pairs of a runner with no row at all);
- ``row``: a row missing from the read model, or one no aggregate accounts for;
- ``position``: a tracking position beyond the log's head (``ReadModelAheadError``).

The read models are caught up first (as ``projections run --once`` does), so a read
model that merely lags is no difference. A difference seen once is looked at again
after another catch-up (:data:`ROUNDS` in all), so that events written meanwhile by a
replica do not count as differences; a row rewritten behind the application's back
differs every time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from secondbox_scheduler.domain.assignment import to_durable_assignment
from secondbox_scheduler.domain.assignment_history import assignment_history
from secondbox_scheduler.domain.ids import lease_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication
from secondbox_scheduler.projections.assignments import row_to_assignment
from secondbox_scheduler.projections.notification_reader import read_pages
from secondbox_scheduler.projections.read_models import ReadModelAheadError, ReadModels
from secondbox_scheduler.projections.runner_snapshots import row_to_snapshot
from secondbox_scheduler.projections.unknown_events import topics_of_classes

RUNNERS = "runner_snapshots"
ASSIGNMENTS = "assignments"
ROW = "row"  # the field of a missing or unaccounted row
PRESENT = "present"
DIGESTS = "materialization_digests"  # SQLite's side table's (runtime, toolchain) pairs
ROUNDS = 2  # comparisons, each after a catch-up, before a difference is reported


@dataclass(frozen=True)
class Difference:
    """One field of one row where a read model and the fold of the log disagree."""

    read_model: str
    key: str
    field: str
    read_model_value: Any
    folded_value: Any

    def to_dict(self) -> dict[str, Any]:
        return {
            "read_model": self.read_model,
            "key": self.key,
            "field": self.field,
            "read_model_value": self.read_model_value,
            "folded_value": self.folded_value,
        }


@dataclass
class VerifyReport:
    """What ``projections verify`` compared and the differences it found."""

    head: int
    runners: int  # runners the log registered (deregistered ones included)
    assignments: int  # assignments the log fenced (every generation)
    differences: list[Difference] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def to_dict(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "head": self.head,
            "runners": self.runners,
            "assignments": self.assignments,
            "differences": [difference.to_dict() for difference in self.differences],
        }


def verify_read_models(store: StoredApplication, read_models: ReadModels) -> VerifyReport:
    """Catch the read models up, compare them with the fold of the log, and repeat
    while differences remain (at most :data:`ROUNDS` times)."""
    report = _compare(store, read_models)
    for _ in range(ROUNDS - 1):
        if report.equal:
            break
        report = _compare(store, read_models)
    return report


def _compare(store: StoredApplication, read_models: ReadModels) -> VerifyReport:
    with suppress(ReadModelAheadError):  # reported below; the rows compared all the same
        read_models.catch_up()
    differences = [
        Difference(status.name, status.name, "position", status.position, status.head)
        for status in read_models.status()
        if status.error
    ]
    head = store.recorder.max_notification_id() or 0
    runners = _compare_runners(store, read_models, differences)
    assignments = _compare_assignments(store, read_models, differences)
    return VerifyReport(head, runners, assignments, differences)


def _streams(store: StoredApplication, event_class: type[Any]) -> Iterator[UUID]:
    """The streams whose first event is of ``event_class``, from the notification log."""
    topics = sorted(topics_of_classes((event_class,)))
    for page in read_pages(store.recorder, topics=topics):
        for notification in page:
            yield UUID(str(notification.originator_id))


def _compare_runners(
    store: StoredApplication, read_models: ReadModels, differences: list[Difference]
) -> int:
    rows = {row["runner_id"]: row for row in read_models.runners.rows()}
    # SQLite's side table of materialization digests (runner_snapshots.py), if any
    digests = read_models.runners.materialization_digests()
    count = 0
    for stream in _streams(store, Runner.Registered):
        runner = store.load_stored(stream)
        if not isinstance(runner, Runner):
            continue
        count += 1
        lease = store.load_stored(lease_uuid(runner.runner_id))
        assert isinstance(lease, RunnerLease)
        expected = _runner_fields(runner, lease)
        row = rows.pop(runner.runner_id, None)
        if row is None:
            differences.append(Difference(RUNNERS, runner.runner_id, ROW, None, PRESENT))
            continue
        found = _read(_runner_row_fields, row)
        if digests is not None and ROW not in found:
            found[DIGESTS] = [list(pair) for pair in digests.pop(runner.runner_id, [])]
            expected[DIGESTS] = sorted(
                [item.runtime_digest, item.toolchain_digest]
                for item in runner.snapshot(lease).materializations
            )
        _diff(RUNNERS, runner.runner_id, found, expected, differences)
    for runner_id in sorted(rows):
        differences.append(Difference(RUNNERS, runner_id, ROW, PRESENT, None))
    for runner_id in sorted(set(digests or ()) - set(rows)):  # of no row at all
        pairs = [list(pair) for pair in (digests or {})[runner_id]]
        differences.append(Difference(RUNNERS, runner_id, DIGESTS, pairs, None))
    return count


def _runner_fields(runner: Runner, lease: RunnerLease) -> dict[str, Any]:
    """What the runner's row must hold: the snapshot of its aggregates, whether it is
    deregistered, and the versions of its streams the row was last changed at (the
    lease's opening changes no row: 0 until its first heartbeat)."""
    return {
        **flat(plain(runner.snapshot(lease))),
        "deregistered": int(runner.deregistered),
        "version": runner.version,
        "lease_version": lease.version if lease.version > 1 else 0,
        "stream_id": runner.id.hex,
        "lease_id": lease.id.hex,
    }


def _runner_row_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **flat(plain(row_to_snapshot(dict(row)))),
        **{name: row[name] for name in ("deregistered", "version", "lease_version")},
        **{name: row[name] for name in ("stream_id", "lease_id")},
    }


def _compare_assignments(
    store: StoredApplication, read_models: ReadModels, differences: list[Difference]
) -> int:
    rows = {(row["sandbox_id"], row["generation"]): row for row in read_models.assignments.rows()}
    count = 0
    for stream in _streams(store, Sandbox.Created):
        for generation, record in sorted(assignment_history(store.events.get(stream)).items()):
            count += 1
            key = (record["sandbox_id"], generation)
            name = f"{key[0]}/{generation}"
            row = rows.pop(key, None)
            if row is None:
                differences.append(Difference(ASSIGNMENTS, name, ROW, None, PRESENT))
                continue
            expected = {
                **flat(plain(to_durable_assignment(record))),
                "sandbox_stream": stream.hex,
            }
            _diff(ASSIGNMENTS, name, _read(_assignment_row_fields, row), expected, differences)
    for sandbox_id, generation in sorted(rows):
        differences.append(
            Difference(ASSIGNMENTS, f"{sandbox_id}/{generation}", ROW, PRESENT, None)
        )
    return count


def _assignment_row_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**flat(plain(row_to_assignment(dict(row)))), "sandbox_stream": row["sandbox_stream"]}


def _read(decode: Any, row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's fields as the read model answers them, or the reason it cannot (a
    value rewritten into something that does not even decode)."""
    try:
        fields: dict[str, Any] = decode(row)
    except Exception as error:  # any garbage a rewrite may have put there
        return {ROW: f"unreadable: {type(error).__name__}: {error}"}
    return fields


def _diff(
    read_model: str,
    key: str,
    found: Mapping[str, Any],
    expected: Mapping[str, Any],
    differences: list[Difference],
) -> None:
    if ROW in found:
        differences.append(Difference(read_model, key, ROW, found[ROW], PRESENT))
        return
    for name in sorted(set(found) | set(expected)):
        if found.get(name) != expected.get(name):
            differences.append(
                Difference(read_model, key, name, found.get(name), expected.get(name))
            )


def plain(value: Any) -> Any:
    """A value as JSON data, the same for equal values: models and mappings as objects,
    sets sorted, bytes in hex, times in ISO 8601."""
    if isinstance(value, BaseModel):
        return plain(dict(value))
    if isinstance(value, Mapping):
        return {str(name): plain(item) for name, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def flat(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A JSON record with its nested objects' fields dotted (``reserved.instances``)."""
    fields: dict[str, Any] = {}
    for name, value in record.items():
        if isinstance(value, Mapping) and value:
            fields.update(flat(value, f"{prefix}{name}."))
        else:
            fields[f"{prefix}{name}"] = value
    return fields
