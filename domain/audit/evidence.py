"""A placement's recorded runner evidence, as the audit fold reads it (pure).

Every placement records the runner and lease it was decided on (``placement.runner``, a
``RunnerSnapshot`` record). The fold re-evaluates the placement on that evidence and
compares it with the runner and lease as the log had them. In a sound history the two
are the same, field for field; validating the record with pydantic (a tenth of the
audit's time) then only rebuilds what the fold already holds. :func:`plain_evidence`
says whether the record is exactly the fold's runner and lease, in the very form
``RunnerSnapshot.from_record`` takes without change (types, keys, no NUL, bounds), and
then builds the same snapshot from the fold's state without validation; any other
record (a field differs, a key is missing or extra, a value that validation would
refuse or convert) is left to ``RunnerSnapshot.from_record`` and the field-by-field
comparison, which name what differs. ``tests/test_audit_evidence.py`` checks that both
give equal snapshots.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from secondbox_scheduler.domain.audit.state import DIMENSIONS, LeaseState, RunnerState
from secondbox_scheduler.domain.values import (
    INT64_MAX,
    UINT32_MAX,
    Capacity,
    RunnerSnapshot,
    trusted,
)

_FIELDS = frozenset(RunnerSnapshot.model_fields)
_DIMENSIONS = frozenset(DIMENSIONS)
_MATERIALIZATION = frozenset(("backend_kind", "architecture", "runtime_digest",
                              "toolchain_digest", "digest"))  # fmt: skip


def plain_name(value: object) -> bool:
    """A name a trusted record keeps as it is (a string without NUL)."""
    return type(value) is str and "\x00" not in value


def _plain_names(values: object) -> bool:
    return type(values) is list and all(plain_name(v) for v in values)


def _plain_capacity(record: object, held: dict[str, int]) -> bool:
    return (
        type(record) is dict
        and record == held
        and record.keys() == _DIMENSIONS
        and all(type(v) is int and 0 <= v <= INT64_MAX for v in record.values())
    )


def _plain_heartbeat(recorded: object, held: datetime | None) -> bool:
    if recorded is None or held is None:
        return recorded is None and held is None
    if type(recorded) is not str or held.utcoffset() is None:
        return False
    try:
        moment = datetime.fromisoformat(recorded.replace("Z", "+00:00"))
    except ValueError:
        return False
    return moment == held and held.tzinfo is UTC and moment.tzinfo is UTC


def plain_evidence(
    record: Any, runner: RunnerState, lease: LeaseState, version: int
) -> RunnerSnapshot | None:
    """The evidence ``record`` as a snapshot built from the fold's ``runner`` and its
    ``lease`` at ``version``, when the record is exactly them; None otherwise."""
    view = lease.history.get(version)
    if (
        view is None
        or type(record) is not dict
        or record.keys() != _FIELDS
        or runner.listed is None
        or record["id"] != runner.runner_id
        or record["pool_name"] != runner.pool_name
        or record["backend_kind"] != runner.backend_kind
        or record["architecture"] != runner.architecture
        or record["drain_phase"] != runner.drain_phase
        or record["capabilities"] != runner.listed
        or record["supported_egress_contexts"] != runner.supported_egress_contexts
        or record["guest_protocol_minimum"] != runner.guest_protocol_minimum
        or record["guest_protocol_maximum"] != runner.guest_protocol_maximum
    ):
        return None
    heartbeat, digests, materializations = view[0], view[1], view[2]
    if (
        record["artifact_digests"] != digests
        or record["materializations"] != materializations
        or not _plain_capacity(record["allocatable"], runner.allocatable)
        or not _plain_capacity(record["reserved"], runner.reserved)
        or not _plain_heartbeat(record["last_heartbeat_at"], heartbeat)
        or not all(
            plain_name(record[k])
            for k in ("id", "pool_name", "backend_kind", "architecture", "drain_phase")
        )
        or not _plain_names(record["artifact_digests"])
        or not _plain_names(record["supported_egress_contexts"])
        or not all(
            type(v) is int and 0 <= v <= UINT32_MAX
            for v in (record["guest_protocol_minimum"], record["guest_protocol_maximum"])
        )
        or not all(
            type(m) is dict and m.keys() == _MATERIALIZATION and all(map(plain_name, m.values()))
            for m in record["materializations"]
        )
    ):
        return None
    return trusted(
        RunnerSnapshot,
        {
            "id": runner.runner_id,
            "pool_name": runner.pool_name,
            "backend_kind": runner.backend_kind,
            "architecture": runner.architecture,
            "capabilities": frozenset(runner.listed),
            "allocatable": Capacity.of(runner.allocatable),
            "reserved": Capacity.of(runner.reserved),
            "drain_phase": runner.drain_phase,
            "last_heartbeat_at": heartbeat,
            "artifact_digests": tuple(digests),
            "materializations": lease.materializations_at(version),
            "supported_egress_contexts": tuple(runner.supported_egress_contexts),
            "guest_protocol_minimum": runner.guest_protocol_minimum,
            "guest_protocol_maximum": runner.guest_protocol_maximum,
        },
    )
