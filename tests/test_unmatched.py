"""A requirement no runner of the pool can meet is refused without reading the pool.

``create_sandbox`` asks first, by index lookups, whether some runner of the pool has the
toolchain's materialization, the architecture, each required and prerequisite
capability (``projections/unmatched.py``); when one is absent from every runner, the
refusal is decided there: ``select_runner``'s error class, every runner of the pool
counted under that rule (as ``select_runner`` over the whole pool counts it), and no
page of candidates read. On PostgreSQL the lookups probe GIN indexes
(tests/test_query_plans.py reads their plans).
"""

from __future__ import annotations

from typing import Any

import pytest

import secondbox_scheduler.projections.candidates as candidates
from secondbox_scheduler.domain.errors import (
    EgressContextUnavailableError,
    NoCompatibleRunnerError,
    PlacementError,
)
from secondbox_scheduler.domain.placement.evidence import reason_label, refusal_counts
from secondbox_scheduler.domain.placement.rules import select_runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock
from tests.factories import HEARTBEAT_TIMEOUT, RUNTIME, capacity, register, requirements

NOBODY = "sha256:no-runner-has"

# requirement overrides -> the rules every runner of the pool fails
CASES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "toolchain": ({"preferred_artifact_digests": (RUNTIME, NOBODY)}, {"materialization"}),
    "toolchain, egress": (
        {"preferred_artifact_digests": (RUNTIME, NOBODY), "egress_context": "vpn"},
        {"materialization", "egress"},
    ),
    "one digest": ({"preferred_artifact_digests": (RUNTIME,)}, {"materialization"}),
    "capability": ({"required_capabilities": frozenset({"gpu"})}, {"capability"}),
    "architecture": ({"architecture": "riscv64"}, {"architecture"}),
}


def _pool(app: SchedulerApplication, clock: Clock, pool: str) -> None:
    """Eight runners, compatible with the default profile but for two draining, one
    stale and one full (so that other rules refuse some of them too)."""
    for index in range(8):
        overrides: dict[str, Any] = {}
        if index == 7:
            overrides["allocatable"] = capacity(instances=0)
        register(
            app, f"{pool}-{index}", at=clock(), heartbeat=index != 6, pool_name=pool, **overrides
        )
        if index < 2:
            app.start_drain(f"{pool}-{index}")


def _not_read(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the pool was read")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_requirement_no_runner_can_meet_is_refused_without_reading_the_pool(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    overrides, failing = CASES[case]
    pool = f"unmatched-{len(case)}-{case.split(',')[0].replace(' ', '-')}"
    _pool(app, clock, pool)
    wanted = requirements(pool_name=pool, **overrides)
    with pytest.raises(PlacementError) as expected:
        select_runner(wanted, app.runner_snapshots(pool), clock(), HEARTBEAT_TIMEOUT)
    monkeypatch.setattr(candidates, "first_candidates", _not_read)
    monkeypatch.setattr(candidates, "candidate_page", _not_read)
    with pytest.raises(PlacementError) as raised:
        app.create_sandbox(
            sandbox_id=f"{pool}-s",
            workspace_id="w",
            profile_revision_id="profile-1",
            requirements=wanted,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
    error = raised.value
    assert type(error) is type(expected.value) is NoCompatibleRunnerError
    assert error.evaluations == ()
    assert error.unlisted.refused == error.unlisted.total == 8
    assert set(error.unlisted.reasons) == failing
    python = refusal_counts(expected.value.evaluations)
    for reason, count in error.unlisted.reasons.items():
        assert count == python[reason_label(reason)] == 8
    assert "0/8 runners are available" in str(error)


def test_egress_alone_is_decided_by_the_rules(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An egress context no runner supports refuses every runner, but whether one
    failed only egress (EgressContextUnavailableError) needs its other rules: the pool
    is read as usual."""
    _pool(app, clock, "egress-only")
    wanted = requirements(pool_name="egress-only", egress_context="vpn")
    with pytest.raises(EgressContextUnavailableError) as raised:
        app.create_sandbox(
            sandbox_id="egress-only-s",
            workspace_id="w",
            profile_revision_id="profile-1",
            requirements=wanted,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
    assert raised.value.evaluations  # evaluated, not refused by a lookup


def test_a_deregistered_runner_does_not_make_a_requirement_possible(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only runner with the capability is deregistered: the lookups ignore it."""
    _pool(app, clock, "gone")
    register(app, "gone-gpu", at=clock(), pool_name="gone", capabilities=["gpu", "compute"])
    app.deregister_runner("gone-gpu")
    monkeypatch.setattr(candidates, "first_candidates", _not_read)
    with pytest.raises(NoCompatibleRunnerError) as raised:
        app.create_sandbox(
            sandbox_id="gone-s",
            workspace_id="w",
            profile_revision_id="profile-1",
            requirements=requirements(pool_name="gone", required_capabilities={"gpu"}),
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
    assert raised.value.unlisted.reasons == {"capability": 8}
