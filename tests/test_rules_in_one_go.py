"""``passes_every_rule`` (``domain/placement/rules.py``): every rule's condition of
passing tested in one go, which the audit fold uses to settle a sound placement without
evaluating each rule. It must never pass a runner that ``evaluate_runner`` finds a
failure in (the audit would miss a finding), and here it answers exactly as
``evaluate_runner`` does: on runners built to fail each rule by the smallest step past
its boundary, on random fleets, under both rule versions, and it refuses the inputs
``evaluate_runner`` refuses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.placement.rules import evaluate_runner, passes_every_rule
from secondbox_scheduler.domain.values import Capacity, Requirements, RunnerSnapshot
from secondbox_scheduler.testing import PlacementCase, fleets, placement_cases, requirements
from secondbox_scheduler.testing.builders import (
    CLIENT_SELECTED_IMAGE,
    NEAR_MISSES,
    PHYSICAL_STORAGE_ADMISSION,
    PLACEMENT_RULES,
    compatible_runner,
    near_miss_runner,
    profile,
)

NOW = datetime(2026, 12, 7, 1, 0, tzinfo=UTC)
TIMEOUT = timedelta(seconds=30)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _agree(
    wanted: Requirements,
    runner: RunnerSnapshot,
    now: datetime,
    timeout: timedelta,
    rules_version: int,
) -> bool:
    evaluation = evaluate_runner(wanted, runner, now, timeout, rules_version=rules_version)
    passed = passes_every_rule(wanted, runner, now, timeout, rules_version=rules_version)
    assert passed == evaluation.compatible, (passed, evaluation.failures)
    return passed


# a profile for which every rule can be failed alone (an egress context, a required
# capability besides the prerequisites, no client-selected image)
FAILABLE = profile(egress_context="public", required_capabilities=frozenset({"snapshot-restore"}))


NEAR_MISS_WAYS = [(rule, way) for rule in PLACEMENT_RULES for way in range(len(NEAR_MISSES[rule]))]


@pytest.mark.parametrize(("rule", "way"), NEAR_MISS_WAYS)
@pytest.mark.parametrize("rules_version", [1, 2])
def test_a_runner_one_step_past_any_rule_does_not_pass(
    rule: str, way: int, rules_version: int
) -> None:
    runner = near_miss_runner(FAILABLE, rule, now=NOW, heartbeat_timeout=TIMEOUT, ways={rule: way})
    evaluation = evaluate_runner(FAILABLE, runner, NOW, TIMEOUT, rules_version=rules_version)
    assert rule in evaluation.reason_codes
    assert not passes_every_rule(FAILABLE, runner, NOW, TIMEOUT, rules_version=rules_version)


@pytest.mark.parametrize("rules_version", [1, 2])
def test_a_runner_at_every_boundary_passes(rules_version: int) -> None:
    wanted = FAILABLE
    exact = wanted.capacity.as_dict()
    runner = compatible_runner(
        wanted,
        now=NOW,
        last_heartbeat_at=NOW - TIMEOUT,  # the oldest heartbeat still fresh
        allocatable=Capacity(**exact),  # exactly the request: no room to spare
        guest_protocol_minimum=wanted.guest_protocol_generation,
        guest_protocol_maximum=wanted.guest_protocol_generation,
    )
    assert _agree(wanted, runner, NOW, TIMEOUT, rules_version)


@pytest.mark.parametrize("rules_version", [1, 2])
def test_disk_past_the_limit_without_its_check_and_the_client_selected_image(
    rules_version: int,
) -> None:
    # disk unchecked with physical admission, still bounded by the reserved-total limit
    wanted = profile()
    base = compatible_runner(wanted, now=NOW)
    admitted = base.capabilities | {PHYSICAL_STORAGE_ADMISSION}
    for reserved_disk in (0, 2**63 - 1 - wanted.capacity.disk_bytes, 2**63 - 1):
        runner = base.model_copy(
            update={"capabilities": admitted, "reserved": Capacity(disk_bytes=reserved_disk)}
        )
        _agree(wanted, runner, NOW, TIMEOUT, rules_version)
    # the client selects the image: release 0.1 skipped the whole rule, digests included
    chosen = profile(
        required_capabilities=frozenset({CLIENT_SELECTED_IMAGE}),
        preferred_artifact_digests=("sha256:only-one",),
    )
    runner = compatible_runner(profile(required_capabilities=frozenset({CLIENT_SELECTED_IMAGE})),
                               now=NOW, materializations=())  # fmt: skip
    assert _agree(chosen, runner, NOW, TIMEOUT, rules_version) is (rules_version < 2)


@SETTINGS
@given(case=placement_cases(now=NOW), rules_version=st.sampled_from([1, 2]))
def test_it_answers_as_every_rule_on_placement_cases(
    case: PlacementCase, rules_version: int
) -> None:
    for runner, failing in zip(case.runners, case.failing, strict=True):
        passed = _agree(case.requirements, runner, case.now, case.heartbeat_timeout, rules_version)
        if failing and rules_version == 2:
            assert not passed


@SETTINGS
@given(wanted=requirements(), runners=fleets(now=NOW), rules_version=st.sampled_from([1, 2]))
def test_it_answers_as_every_rule_on_random_fleets(
    wanted: Requirements, runners: list[RunnerSnapshot], rules_version: int
) -> None:
    for runner in runners:
        _agree(wanted, runner, NOW, TIMEOUT, rules_version)


def test_it_reads_every_dimension_of_a_capacity() -> None:
    # passes_every_rule spells the dimensions out
    spelled = ("vcpu_count", "memory_bytes", "disk_bytes", "instances", "operations")
    assert spelled == Capacity.DIMENSIONS


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
@pytest.mark.parametrize("admitted", [False, True])
def test_one_unit_short_or_past_the_limit_on_any_dimension_does_not_pass(
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
    full = {**base.reserved.as_dict(), dim: 2**63 - requested}  # at the limit + 1 unit
    for runner in (
        base.model_copy(update={"allocatable": Capacity(**short)}),
        base.model_copy(update={"reserved": Capacity(**full)}),
    ):
        _agree(wanted, runner, NOW, TIMEOUT, 2)
        assert _agree(wanted, runner, NOW, TIMEOUT, 1) is (
            admitted and dim == "disk_bytes" and runner.allocatable.as_dict() == short
        )


def test_it_refuses_what_evaluate_runner_refuses() -> None:
    wanted = profile()
    runner = compatible_runner(wanted, now=NOW)
    bad: list[tuple[object, object]] = [
        (NOW.replace(tzinfo=None), TIMEOUT),  # a naive time
        (NOW, 30),  # a timeout that is not a timedelta
        (datetime.min.replace(tzinfo=UTC), TIMEOUT),  # before the first representable time
    ]
    for now, timeout in bad:
        with pytest.raises(InvalidRequestError) as expected:
            evaluate_runner(wanted, runner, now, timeout)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError) as found:
            passes_every_rule(wanted, runner, now, timeout)  # type: ignore[arg-type]
        assert str(found.value) == str(expected.value)
