"""The audit fold's rules read from its own state (``passes_on_state``,
``domain/audit/evidence.py``) answer as ``passes_every_rule`` on the snapshot that
state makes (``plain_snapshot``), and ``audit verify`` finds with them exactly what it
finds with every placement checked on the snapshot.

When a placement's evidence is exactly the fold's runner and lease (``plain_view``), the
fold settles it by every rule's condition of passing read from that state, without
building the snapshot; only when they do not pass is the snapshot built and every rule
evaluated, each failure named. Here: the fold state of every runner of the rules' own
tests (each rule failed by the smallest step, every boundary, random fleets, both rule
versions) gives the same answer and the same snapshot; the same refusals of a naive
time and a bad timeout; and ``audit verify`` of edited histories (evidence the rules
refuse on the fold's own state, requirements edited, the tamper tests' placement edits)
finds the same violations in the same order with and without the state path, on SQLite
and PostgreSQL, in 1 and 2 processes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain.audit import sandbox_checks
from secondbox_scheduler.domain.audit.evidence import passes_on_state, plain_snapshot
from secondbox_scheduler.domain.audit.state import LeaseState, RunnerState
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.placement.rules import passes_every_rule
from secondbox_scheduler.domain.values import Capacity, Requirements, RunnerSnapshot
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.testing import PlacementCase, fleets, placement_cases, requirements
from secondbox_scheduler.testing.builders import (
    NEAR_MISSES,
    PHYSICAL_STORAGE_ADMISSION,
    PLACEMENT_RULES,
    compatible_runner,
    near_miss_runner,
    profile,
)
from tests.test_tamper import (  # noqa: F401 (fixtures)
    EDITS,
    Copy,
    Raw,
    copy_of,
    edit_json,
    nth,
    simulated,
)

NOW = datetime(2026, 12, 7, 1, 0, tzinfo=UTC)
TIMEOUT = timedelta(seconds=30)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VERSION = 3  # the lease version the state holds the runner's view at
FAILABLE = profile(egress_context="public", required_capabilities=frozenset({"snapshot-restore"}))


def _state(runner: RunnerSnapshot) -> tuple[RunnerState, LeaseState, tuple[Any, ...]]:
    """The fold's runner and lease holding ``runner`` (the lease at :data:`VERSION`)."""
    state = RunnerState(
        runner_id=runner.id,
        pool_name=runner.pool_name,
        backend_kind=runner.backend_kind,
        architecture=runner.architecture,
        capabilities=sorted(runner.capabilities),
        allocatable=runner.allocatable.as_dict(),
        supported_egress_contexts=list(runner.supported_egress_contexts),
        guest_protocol_minimum=runner.guest_protocol_minimum,
        guest_protocol_maximum=runner.guest_protocol_maximum,
        reserved=runner.reserved.as_dict(),
        drain_phase=runner.drain_phase,
    )
    state.listed = sorted(runner.capabilities)
    lease = LeaseState(runner.id, version=VERSION)
    view = (
        runner.last_heartbeat_at,
        list(runner.artifact_digests),
        [m.model_dump() for m in runner.materializations],
        NOW,
        True,
    )
    lease.history[VERSION] = view
    return state, lease, view


def _agree(
    wanted: Requirements,
    runner: RunnerSnapshot,
    now: datetime,
    timeout: timedelta,
    rules_version: int,
) -> bool:
    state, lease, view = _state(runner)
    assert plain_snapshot(state, lease, VERSION, view) == runner
    passed = passes_every_rule(wanted, runner, now, timeout, rules_version=rules_version)
    on_state = passes_on_state(wanted, state, lease, view, VERSION, now, timeout, rules_version)
    assert on_state == passed
    return passed


NEAR_MISS_WAYS = [(rule, way) for rule in PLACEMENT_RULES for way in range(len(NEAR_MISSES[rule]))]


@pytest.mark.parametrize(("rule", "way"), NEAR_MISS_WAYS)
@pytest.mark.parametrize("rules_version", [1, 2])
def test_a_runner_one_step_past_any_rule_does_not_pass_on_the_folds_state(
    rule: str, way: int, rules_version: int
) -> None:
    runner = near_miss_runner(FAILABLE, rule, now=NOW, heartbeat_timeout=TIMEOUT, ways={rule: way})
    assert not _agree(FAILABLE, runner, NOW, TIMEOUT, rules_version)


@pytest.mark.parametrize("rules_version", [1, 2])
def test_a_runner_at_every_boundary_passes_on_the_folds_state(rules_version: int) -> None:
    wanted = FAILABLE
    runner = compatible_runner(
        wanted,
        now=NOW,
        last_heartbeat_at=NOW - TIMEOUT,
        allocatable=Capacity(**wanted.capacity.as_dict()),
        guest_protocol_minimum=wanted.guest_protocol_generation,
        guest_protocol_maximum=wanted.guest_protocol_generation,
    )
    assert _agree(wanted, runner, NOW, TIMEOUT, rules_version)


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
@pytest.mark.parametrize("admitted", [False, True])
def test_one_unit_short_or_past_the_limit_on_any_dimension_on_the_folds_state(
    dim: str, admitted: bool
) -> None:
    wanted = profile()
    base = compatible_runner(wanted, now=NOW)
    if admitted:
        base = base.model_copy(
            update={"capabilities": base.capabilities | {PHYSICAL_STORAGE_ADMISSION}}
        )
    requested = wanted.capacity.as_dict()[dim]
    short = {**base.allocatable.as_dict(), dim: requested - 1}
    full = {**base.reserved.as_dict(), dim: 2**63 - requested}
    for runner in (
        base.model_copy(update={"allocatable": Capacity(**short)}),
        base.model_copy(update={"reserved": Capacity(**full)}),
    ):
        for rules_version in (1, 2):
            _agree(wanted, runner, NOW, TIMEOUT, rules_version)


@SETTINGS
@given(case=placement_cases(now=NOW), rules_version=st.sampled_from([1, 2]))
def test_it_answers_as_every_rule_on_placement_cases(
    case: PlacementCase, rules_version: int
) -> None:
    for runner in case.runners:
        _agree(case.requirements, runner, case.now, case.heartbeat_timeout, rules_version)


@SETTINGS
@given(wanted=requirements(), runners=fleets(now=NOW), rules_version=st.sampled_from([1, 2]))
def test_it_answers_as_every_rule_on_random_fleets(
    wanted: Requirements, runners: list[RunnerSnapshot], rules_version: int
) -> None:
    for runner in runners:
        _agree(wanted, runner, NOW, TIMEOUT, rules_version)


def test_it_refuses_what_passes_every_rule_refuses() -> None:
    wanted = profile()
    runner = compatible_runner(wanted, now=NOW)
    state, lease, view = _state(runner)
    bad: list[tuple[object, object]] = [
        (NOW.replace(tzinfo=None), TIMEOUT),
        (NOW, 30),
        (datetime.min.replace(tzinfo=UTC), TIMEOUT),
    ]
    for now, timeout in bad:
        with pytest.raises(InvalidRequestError) as expected:
            passes_every_rule(wanted, runner, now, timeout)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError) as found:
            passes_on_state(wanted, state, lease, view, VERSION, now, timeout, 2)  # type: ignore[arg-type]
        assert str(found.value) == str(expected.value)


# -- audit verify with and without the state path, on edited histories -----------


def _requirements(change: Callable[[dict[str, Any]], None], index: int) -> Callable[[Raw], int]:
    def edit(raw: Raw) -> int:
        position = nth(raw, "Sandbox.Created", index)
        edit_json(raw, position, lambda state: change(state["requirements"]))
        return position

    return edit


def _fence(change: Callable[[dict[str, Any]], None], index: int) -> Callable[[Raw], int]:
    def edit(raw: Raw) -> int:
        position = nth(raw, "Sandbox.AssignmentFenced", index)
        edit_json(raw, position, lambda state: change(state["placement"]))
        return position

    return edit


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda record: record.__setitem__(key, value)


def _capacity(dim: str, value: int) -> Callable[[dict[str, Any]], None]:
    return lambda record: record["capacity"].__setitem__(dim, value)


STATE_EDITS: dict[str, Callable[[Raw], int]] = {
    # the evidence stays the fold's own state; the rules refuse it
    "a stale heartbeat by the decision's timeout": _fence(
        _set("heartbeat_timeout_seconds", 0.000001), 4
    ),
    "a decision an hour later": _fence(
        lambda p: p["decided_at"].__setitem__("_data_", "2027-01-01T00:00:00+00:00"), 6
    ),
    "an old rules version": _fence(_set("rules_version", 1), 2),
    "the requirements' pool": _requirements(_set("pool_name", "elsewhere"), 0),
    "the requirements' architecture": _requirements(_set("architecture", "riscv64"), 1),
    "the requirements' protocol": _requirements(_set("guest_protocol_generation", 99), 2),
    "the requirements' capability": _requirements(
        lambda r: r.__setitem__("required_capabilities", [*r["required_capabilities"], "gpu"]), 3
    ),
    "the requirements' egress": _requirements(_set("egress_context", "nowhere"), 4),
    "the requirements' digests": _requirements(_set("preferred_artifact_digests", ["x"]), 5),
    "the requirements' vcpus": _requirements(_capacity("vcpu_count", 10**6), 6),
    "the requirements' memory past the limit": _requirements(
        _capacity("memory_bytes", 2**63 - 1), 7
    ),
    # the evidence is not the fold's state (validated and compared, as before)
    "the evidence's drain phase": _fence(
        lambda p: p["runner"].__setitem__("drain_phase", "draining"), 3
    ),
    **{name: EDITS[name] for name in ("decision time moved back", "heartbeat timeout 1e9",
                                      "fencing token digit")},
}  # fmt: skip


def _findings(copy: Copy, workers: int) -> list[dict[str, Any]]:
    app = copy.open()
    try:
        report = verify(app, measure_raw=False, workers=workers)
    finally:
        app.close()
    return [violation.to_dict() for violation in report.violations]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("edit", STATE_EDITS)
def test_audit_verify_finds_with_the_state_path_what_it_finds_on_the_snapshot(
    edit: str,
    kind: str,
    copy_of: Callable[[str], Copy],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copy = copy_of(kind)
    STATE_EDITS[edit](copy.raw)
    called: list[bool] = []

    def counted(*args: Any) -> bool:
        passed = passes_on_state(*args)
        called.append(passed)
        return passed

    monkeypatch.setattr(sandbox_checks, "passes_on_state", counted)
    with_state = {workers: _findings(copy, workers) for workers in (1, 2)}
    assert True in called, "placements are settled on the fold's state"
    monkeypatch.setattr(sandbox_checks, "passes_on_state", lambda *args: False)
    on_snapshot = {workers: _findings(copy, workers) for workers in (1, 2)}
    assert with_state[1], "the edit is found"
    assert with_state == on_snapshot
    assert with_state[1] == with_state[2]
