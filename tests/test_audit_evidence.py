"""The audit fold's evidence check without validation (``domain/audit/evidence.py``):
on a sound history every placement's evidence is taken from the fold's own runner and
lease, and that snapshot equals the validated one; any record that differs in the least
(a value, a key, a type, a NUL, a bound) is validated and compared as before."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from secondbox_scheduler.domain.audit import sandbox_checks
from secondbox_scheduler.domain.audit.evidence import (
    plain_evidence,
    plain_lease_lists,
    plain_runner,
    plain_snapshot,
    plain_view,
)
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import RunnerSnapshot
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import log_events
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.tools.bench.audit_history import steady_history
from tests.aggregates import EventLog, new_lease, new_runner, new_sandbox, place, slots


def test_every_placement_of_a_sound_history_is_checked_on_the_folds_own_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = SchedulerApplication(env={DATABASE_URL: f"sqlite:///{tmp_path / 'a.db'}"})
    steady_history(app, 300, runners=2, sandboxes=6)
    seen: list[tuple[Any, RunnerSnapshot | None]] = []

    def spy(record: Any, runner: Any, lease: Any, version: int) -> tuple[Any, ...] | None:
        view = plain_view(record, runner, lease, version)
        found = None if view is None else plain_snapshot(runner, lease, version, view)
        seen.append((record, found))
        assert found == plain_evidence(record, runner, lease, version)
        return view

    monkeypatch.setattr(sandbox_checks, "plain_view", spy)
    audit = AuditFold(compact=True)
    for position, event in log_events(app, None):
        audit.apply(position, event)
    audit.finish()
    app.close()
    assert audit.violations == []
    fences = sum(1 for record, _ in seen)
    assert fences > 12
    for record, found in seen:
        assert found is not None
        assert found == RunnerSnapshot.from_record(record)
        assert found.model_dump() == RunnerSnapshot.from_record(record).model_dump()


def _fence_and_fold() -> tuple[dict[str, Any], AuditFold, int]:
    """A placement's evidence record, and the fold of the history just before it."""
    log = EventLog()
    runner, lease = new_runner("r1", allocatable=slots(3)), new_lease("r1")
    log.save(runner, lease)
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    log.save(sandbox)
    before = len(log.events)
    made = place(sandbox, runner, lease)
    log.save(sandbox, runner, made.token_use)
    fence = log.events[before]
    assert isinstance(fence, Sandbox.AssignmentFenced)
    audit = AuditFold(compact=True)
    for position, event in enumerate(log.events[:before], start=1):
        audit.apply(position, event)
    return dict(fence.placement), audit, before + 1


def _state(audit: AuditFold) -> tuple[Any, Any]:
    (runner,) = [s.runner for s in audit._streams.values() if s.runner is not None]
    (lease,) = [s.lease for s in audit._streams.values() if s.lease is not None]
    return runner, lease


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda record: record.__setitem__(key, value)


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "reserved": lambda r: r["reserved"].__setitem__("instances", 1),
    "allocatable": lambda r: r["allocatable"].__setitem__("vcpu_count", 99),
    "reserved bool": lambda r: r["reserved"].__setitem__("instances", False),
    "reserved negative": lambda r: r["reserved"].__setitem__("operations", -1),
    "allocatable key missing": lambda r: r["allocatable"].pop("operations"),
    "extra key": _set("extra", 1),
    "key missing": lambda r: r.pop("supported_egress_contexts"),
    "id": _set("id", "r2"),
    "pool": _set("pool_name", "other"),
    "pool NUL": lambda r: r.__setitem__("pool_name", r["pool_name"] + "\x00"),
    "drain": _set("drain_phase", "draining"),
    "capabilities doubled": lambda r: r["capabilities"].append(r["capabilities"][0]),
    "capabilities reordered": lambda r: r["capabilities"].reverse(),
    "heartbeat": _set("last_heartbeat_at", "2026-01-01T00:00:00Z"),
    "heartbeat gone": _set("last_heartbeat_at", None),
    "digests": _set("artifact_digests", []),
    "materialization": lambda r: r["materializations"][0].__setitem__("digest", "x"),
    "materialization extra": lambda r: r["materializations"][0].__setitem__("more", "x"),
    "egress": _set("supported_egress_contexts", ["default", "more"]),
    "protocol": _set("guest_protocol_maximum", 2**40),
    "protocol float": _set("guest_protocol_minimum", 1.0),
}


@pytest.mark.parametrize("zone", ["Z", "+00:00"])
def test_the_fast_path_takes_the_record_of_the_folds_own_state(zone: str) -> None:
    placement, audit, _ = _fence_and_fold()
    runner, lease = _state(audit)
    record = copy.deepcopy(placement["runner"])
    record["last_heartbeat_at"] = record["last_heartbeat_at"].replace("Z", zone)
    found = plain_evidence(record, runner, lease, placement["lease_version"])
    assert found is not None
    assert found == RunnerSnapshot.from_record(record)


@pytest.mark.parametrize("change", CHANGES)
def test_any_other_record_is_validated_and_compared(change: str) -> None:
    placement, audit, _ = _fence_and_fold()
    runner, lease = _state(audit)
    record = copy.deepcopy(placement["runner"])
    CHANGES[change](record)
    assert repr(record) != repr(placement["runner"])
    assert plain_evidence(record, runner, lease, placement["lease_version"]) is None


def test_a_lease_version_the_fold_does_not_hold_is_validated() -> None:
    placement, audit, _ = _fence_and_fold()
    runner, lease = _state(audit)
    assert plain_evidence(placement["runner"], runner, lease, lease.version + 1) is None
    runner.listed = None  # a runner registered with doubled or odd capabilities
    assert plain_evidence(placement["runner"], runner, lease, placement["lease_version"]) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pool_name", "pool\x00"),
        ("capabilities", ["compute", "compute"]),
        ("guest_protocol_maximum", 2**40),
        ("guest_protocol_minimum", True),
        ("supported_egress_contexts", ["default", 7]),
    ],
)
def test_a_runner_registered_with_fields_validation_would_change_is_never_taken_as_is(
    field: str, value: Any
) -> None:
    _, audit, _ = _fence_and_fold()
    runner, _ = _state(audit)
    assert plain_runner(runner)
    setattr(runner, field, value)
    assert not plain_runner(runner)


def test_a_lease_whose_lists_validation_would_change_is_never_taken_as_is() -> None:
    placement, audit, _ = _fence_and_fold()
    runner, lease = _state(audit)
    version = placement["lease_version"]
    assert plain_lease_lists(lease.artifact_digests, lease.materializations)
    assert not plain_lease_lists(["sha256:x\x00"], [])
    assert not plain_lease_lists([], [{"digest": "x"}])
    heartbeat, digests, materializations, at, _ = lease.history[version]
    lease.history[version] = (heartbeat, digests, materializations, at, False)
    assert plain_evidence(placement["runner"], runner, lease, version) is None


def test_a_lease_version_recorded_again_forgets_the_heartbeat_text_taken() -> None:
    placement, audit, _ = _fence_and_fold()
    runner, lease = _state(audit)
    version = placement["lease_version"]
    assert plain_evidence(placement["runner"], runner, lease, version) is not None
    assert lease.heartbeat_text == (version, placement["runner"]["last_heartbeat_at"])
    lease.last_heartbeat_at = None  # the same version again, with another heartbeat
    lease.record(version, lease.history[version][3], timedelta(minutes=15))
    assert lease.heartbeat_text is None
    assert plain_evidence(placement["runner"], runner, lease, version) is None
