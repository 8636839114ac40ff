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

from datetime import UTC, datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.audit.state import DIMENSIONS, LeaseState, RunnerState
from secondbox_scheduler.domain.placement.rules import passes_on_fields
from secondbox_scheduler.domain.values import (
    INT64_MAX,
    UINT32_MAX,
    Capacity,
    Requirements,
    RunnerSnapshot,
    trusted,
)

_FIELDS = frozenset(RunnerSnapshot.model_fields)
_DIMENSIONS = frozenset(DIMENSIONS)
_MATERIALIZATION = frozenset(("backend_kind", "architecture", "runtime_digest",
                              "toolchain_digest", "digest"))  # fmt: skip


_INT = frozenset((int,))


def plain_name(value: object) -> bool:
    """A name a trusted record keeps as it is (a string without NUL)."""
    return type(value) is str and "\x00" not in value


def plain_names(values: object) -> bool:
    return type(values) is list and all(map(plain_name, values))


def plain_runner(runner: RunnerState) -> bool:
    """Whether a runner's registered fields are all as a trusted record keeps them
    (names without NUL, capabilities each once, protocol generations in range): set
    once at registration (``RunnerState.listed``)."""
    names = runner.capabilities
    protocols = (runner.guest_protocol_minimum, runner.guest_protocol_maximum)
    return (
        all(
            map(
                plain_name,
                (runner.runner_id, runner.pool_name, runner.backend_kind, runner.architecture),
            )
        )
        and plain_names(names)
        and len(set(names)) == len(names)
        and plain_names(runner.supported_egress_contexts)
        and _INT.issuperset(map(type, protocols))
        and min(protocols) >= 0
        and max(protocols) <= UINT32_MAX
    )


def plain_lease_lists(digests: object, materializations: object) -> bool:
    """Whether a lease's digests and materializations are as a trusted record keeps
    them (set when they change: ``LeaseState.plain_lists``)."""
    return (
        plain_names(digests)
        and type(materializations) is list
        and all(
            type(m) is dict and m.keys() == _MATERIALIZATION and all(map(plain_name, m.values()))
            for m in materializations
        )
    )


def _plain_capacity(record: object, held: dict[str, int]) -> bool:
    if type(record) is not dict or record != held or record.keys() != _DIMENSIONS:
        return False
    values = record.values()
    return _INT.issuperset(map(type, values)) and min(values) >= 0 and max(values) <= INT64_MAX


def _plain_heartbeat(recorded: object, lease: LeaseState, version: int, held: Any) -> bool:
    if recorded is None or held is None:
        return recorded is None and held is None
    if lease.heartbeat_text == (version, recorded):  # as the last placement recorded it
        return True
    if type(recorded) is not str:
        return False
    try:
        moment = datetime.fromisoformat(recorded.replace("Z", "+00:00"))
    except ValueError:
        return False
    if moment == held and held.tzinfo is UTC and moment.tzinfo is UTC:
        lease.heartbeat_text = (version, recorded)
        return True
    return False


def plain_view(
    record: Any, runner: RunnerState, lease: LeaseState, version: int
) -> tuple[Any, ...] | None:
    """The lease's entry at ``version`` (``LeaseState.history``) when the evidence
    ``record`` is exactly the fold's ``runner`` and that entry, in the form
    ``RunnerSnapshot.from_record`` takes without change; None otherwise."""
    view = lease.history.get(version)
    if (
        view is None
        or not view[4]  # the lease's lists are not as a trusted record keeps them
        or runner.listed is None  # nor the runner's registered fields
        or type(record) is not dict
        or record.keys() != _FIELDS
        or record["id"] != runner.runner_id
        or record["pool_name"] != runner.pool_name
        or record["backend_kind"] != runner.backend_kind
        or record["architecture"] != runner.architecture
        or record["drain_phase"] != runner.drain_phase
        or record["capabilities"] != runner.listed
        or record["supported_egress_contexts"] != runner.supported_egress_contexts
        or record["guest_protocol_minimum"] != runner.guest_protocol_minimum
        or record["guest_protocol_maximum"] != runner.guest_protocol_maximum
        or record["artifact_digests"] != view[1]
        or record["materializations"] != view[2]
        or not plain_name(runner.drain_phase)
        or not _INT.issuperset(
            map(type, (record["guest_protocol_minimum"], record["guest_protocol_maximum"]))
        )
        or not _plain_capacity(record["allocatable"], runner.allocatable)
        or not _plain_capacity(record["reserved"], runner.reserved)
        or not _plain_heartbeat(record["last_heartbeat_at"], lease, version, view[0])
    ):
        return None
    return view


def plain_snapshot(
    runner: RunnerState, lease: LeaseState, version: int, view: tuple[Any, ...]
) -> RunnerSnapshot:
    """The snapshot of the fold's ``runner`` and ``lease`` at ``version`` (``view``,
    what :func:`plain_view` returned), built without validation."""
    return trusted(
        RunnerSnapshot,
        {
            "id": runner.runner_id,
            "pool_name": runner.pool_name,
            "backend_kind": runner.backend_kind,
            "architecture": runner.architecture,
            "capabilities": frozenset(runner.listed or ()),
            "allocatable": Capacity.of(runner.allocatable),
            "reserved": Capacity.of(runner.reserved),
            "drain_phase": runner.drain_phase,
            "last_heartbeat_at": view[0],
            "artifact_digests": tuple(view[1]),
            "materializations": lease.materializations_at(version),
            "supported_egress_contexts": tuple(runner.supported_egress_contexts),
            "guest_protocol_minimum": runner.guest_protocol_minimum,
            "guest_protocol_maximum": runner.guest_protocol_maximum,
        },
    )


def plain_evidence(
    record: Any, runner: RunnerState, lease: LeaseState, version: int
) -> RunnerSnapshot | None:
    """The evidence ``record`` as a snapshot built from the fold's ``runner`` and its
    ``lease`` at ``version``, when the record is exactly them; None otherwise."""
    view = plain_view(record, runner, lease, version)
    return None if view is None else plain_snapshot(runner, lease, version, view)


def passes_on_state(
    requirements: Requirements,
    runner: RunnerState,
    lease: LeaseState,
    view: tuple[Any, ...],
    version: int,
    now: datetime,
    heartbeat_timeout: timedelta,
    rules_version: int,
) -> bool:
    """``passes_every_rule`` on :func:`plain_snapshot`'s snapshot (the same values:
    the fold's runner, the lease's entry ``view`` at ``version``), read from the fold's
    state without building it. ``tests/test_audit_evidence.py`` holds the two equal."""
    return passes_on_fields(
        requirements, now, heartbeat_timeout, rules_version,
        runner.pool_name, runner.architecture, runner.drain_phase, view[0],
        runner.backend_kind, frozenset(runner.listed or ()), runner.guest_protocol_minimum,
        runner.guest_protocol_maximum, runner.supported_egress_contexts,
        lease.materializations_at(version), runner.allocatable, runner.reserved,
    )  # fmt: skip
