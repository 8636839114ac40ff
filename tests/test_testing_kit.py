"""The testing kit's placement cases (secondbox_scheduler.testing): built on purpose.

``placement_cases()`` builds each runner from the requirements to pass every rule or to
fail chosen rules by a near miss. These tests hold the kit to what it says it built,
through the public ``select_runner`` only: the chosen runner is one built to pass (the
best of them by the ranking of docs/spec.md (section 3)), every runner built to fail is refused with
exactly those reason codes, a case without a passing runner gets the right error, and
the default draws are placeable often enough to test something.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from secondbox_scheduler import (
    Capacity,
    EgressContextUnavailableError,
    NoCompatibleRunnerError,
    Requirements,
    RunnerSnapshot,
    select_runner,
)

# Not re-exported by secondbox_scheduler.domain: the reason codes, to check that the
# kit knows every rule there is.
from secondbox_scheduler.domain.placement.evidence import REASON_CODES
from secondbox_scheduler.testing import (
    NEAR_MISSES,
    PLACEMENT_RULES,
    PlacementCase,
    compatible_runner,
    near_miss_runner,
    placement_cases,
)
from secondbox_scheduler.testing.builders import HEARTBEAT_TIMEOUT, T0, TICK, profile

PLACEABLE_DRAWS = 300
CASE_SETTINGS = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
VARIANT_SETTINGS = settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])


def refused_codes(
    requirements: Requirements,
    runners: Sequence[RunnerSnapshot],
    now: datetime = T0,
    timeout: timedelta = HEARTBEAT_TIMEOUT,
) -> dict[str, frozenset[str]]:
    """Per runner id, the reason codes select_runner refuses it with (it must refuse)."""
    with pytest.raises((NoCompatibleRunnerError, EgressContextUnavailableError)) as info:
        select_runner(requirements, runners, now, timeout)
    return {e.runner_id: frozenset(e.reason_codes) for e in info.value.evaluations}


def seed_rank(requirements: Requirements, runner: RunnerSnapshot) -> tuple[int | str, ...]:
    """The ranking of docs/spec.md (section 3), written again: locality, free instances,
    vCPU, memory, id."""
    preferred = set(requirements.preferred_artifact_digests)
    free = runner.free()
    return (
        -sum(1 for digest in runner.artifact_digests if digest in preferred),
        -free.instances,
        -free.vcpu_count,
        -free.memory_bytes,
        runner.id,
    )


def check_case(case: PlacementCase) -> None:
    """The kit's promise for one case, checked through select_runner alone."""
    reqs, now, timeout = case.requirements, case.now, case.heartbeat_timeout
    for runner, rules in zip(case.runners, case.failing, strict=True):
        if rules:  # alone, each runner is refused with exactly the rules it was built to fail
            assert refused_codes(reqs, [runner], now, timeout) == {runner.id: rules}
        else:
            assert select_runner(reqs, [runner], now, timeout) == runner
    passing = [r for r, rules in zip(case.runners, case.failing, strict=True) if not rules]
    if passing:
        chosen = select_runner(reqs, case.runners, now, timeout)
        assert chosen in passing
        assert chosen == min(passing, key=lambda runner: seed_rank(reqs, runner))
        return
    egress_only = any(rules == {"egress"} for rules in case.failing)
    expected = EgressContextUnavailableError if egress_only else NoCompatibleRunnerError
    with pytest.raises(expected) as info:
        select_runner(reqs, case.runners, now, timeout)
    assert type(info.value) is expected
    assert {e.runner_id: frozenset(e.reason_codes) for e in info.value.evaluations} == {
        runner.id: rules for runner, rules in zip(case.runners, case.failing, strict=True)
    }


# --------------------------------------------------------------------------- builders


def test_the_kit_knows_every_placement_rule_and_a_near_miss_of_each() -> None:
    assert PLACEMENT_RULES == REASON_CODES
    assert set(NEAR_MISSES) == set(PLACEMENT_RULES)
    assert all(NEAR_MISSES[rule] for rule in PLACEMENT_RULES)


WIDE = profile(required_capabilities=frozenset({"snapshot-restore"}), egress_context="public")


def test_a_compatible_runner_is_chosen() -> None:
    runner = compatible_runner(WIDE, "r1")
    assert select_runner(WIDE, [runner], T0, HEARTBEAT_TIMEOUT) == runner


@pytest.mark.parametrize(
    ("rule", "way"),
    [(rule, way) for rule in PLACEMENT_RULES for way in range(len(NEAR_MISSES[rule]))],
)
def test_each_near_miss_fails_its_rule_alone(rule: str, way: int) -> None:
    runner = near_miss_runner(WIDE, rule, "r1", ways={rule: way})
    assert refused_codes(WIDE, [runner]) == {"r1": frozenset({rule})}


def test_every_near_miss_at_once_fails_every_rule() -> None:
    runner = near_miss_runner(WIDE, PLACEMENT_RULES, "r1")
    assert refused_codes(WIDE, [runner]) == {"r1": frozenset(PLACEMENT_RULES)}


def test_near_misses_sit_one_step_past_the_boundary() -> None:
    stale = near_miss_runner(WIDE, "heartbeat_stale")
    assert stale.last_heartbeat_at == T0 - HEARTBEAT_TIMEOUT - TICK
    at_boundary = compatible_runner(WIDE, last_heartbeat_at=T0 - HEARTBEAT_TIMEOUT)
    assert select_runner(WIDE, [at_boundary], T0, HEARTBEAT_TIMEOUT) == at_boundary
    short = near_miss_runner(WIDE, "capacity", ways={"capacity": 3})  # instances
    free = short.free().as_dict()
    wanted = WIDE.capacity.as_dict()
    assert {
        dim: wanted[dim] - free[dim] for dim in Capacity.DIMENSIONS if free[dim] < wanted[dim]
    } == {"instances": 1}
    low = near_miss_runner(WIDE, "guest_protocol")
    assert low.guest_protocol_maximum == WIDE.guest_protocol_generation - 1


def test_a_near_miss_that_would_fail_another_rule_too_gives_way_to_one_that_does_not() -> None:
    # the profile requires "storage", so the first prerequisite way (network-policy) is
    # kept, and removing "compute" is no near miss of backend alone when it is required
    reqs = profile(required_capabilities=frozenset({"storage", "compute", "gpu"}))
    runner = near_miss_runner(reqs, ["prerequisite", "backend"], "r1", ways={"prerequisite": 1})
    assert refused_codes(reqs, [runner]) == {"r1": frozenset({"prerequisite", "backend"})}
    assert "storage" in runner.capabilities
    assert runner.backend_kind == ""


@pytest.mark.parametrize(
    ("reqs", "rule"),
    [
        (profile(egress_context=None), "egress"),
        (profile(required_capabilities=frozenset({"compute", "storage"})), "capability"),
        (profile(required_capabilities=frozenset({"client-selected-image"})), "materialization"),
        (profile(capacity=Capacity()), "capacity"),
    ],
)
def test_a_rule_no_runner_can_fail_alone_is_refused(reqs: Requirements, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        near_miss_runner(reqs, rule)


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown placement rules"):
        near_miss_runner(WIDE, "colour")


# --------------------------------------------------------------------------- strategies


@CASE_SETTINGS
@given(case=placement_cases())
def test_select_runner_answers_what_each_case_was_built_for(case: PlacementCase) -> None:
    check_case(case)
    assert case.placeable == bool(case.passing)


@VARIANT_SETTINGS
@given(
    case=placement_cases(
        max_runners=3,
        placeable=False,
        fail_rules=st.sampled_from(
            [frozenset({"egress"}), frozenset({"capacity"}), frozenset({"egress", "draining"})]
        ),
    )
)
def test_cases_built_unplaceable_get_the_right_refusal(case: PlacementCase) -> None:
    assert not case.placeable
    check_case(case)
    expected = case.expected_refusal
    assert expected is not None
    with pytest.raises(expected) as info:
        select_runner(case.requirements, case.runners, case.now, case.heartbeat_timeout)
    assert type(info.value) is expected


@VARIANT_SETTINGS
@given(case=placement_cases(placeable=True, fail_rules=st.just(frozenset({"heartbeat_stale"}))))
def test_cases_built_placeable_always_place(case: PlacementCase) -> None:
    assert case.placeable
    assert case.expected_refusal is None
    check_case(case)


def test_placement_case_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        placement_cases(min_runners=3, max_runners=2)
    with pytest.raises(InvalidArgument):
        placement_cases(max_runners=0, placeable=True)


def test_a_drawn_unknown_rule_is_refused() -> None:
    @settings(max_examples=1, database=None)
    @given(placement_cases(fail_rules=st.just(frozenset({"colour"}))))
    def draw(case: PlacementCase) -> None:
        raise AssertionError("drawn")

    with pytest.raises(InvalidArgument, match="colour"):
        draw()


def test_over_a_third_of_the_default_draws_are_placeable() -> None:
    """Counted by select_runner itself (not the kit's own flag) over a fixed set of
    derandomized draws: fails if the strategy went back to drawing mostly refusals."""
    placed: list[bool] = []

    @settings(
        max_examples=PLACEABLE_DRAWS,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=placement_cases())
    def record(case: PlacementCase) -> None:
        try:
            select_runner(case.requirements, case.runners, case.now, case.heartbeat_timeout)
        except (NoCompatibleRunnerError, EgressContextUnavailableError):
            placed.append(False)
        else:
            placed.append(True)

    record()
    assert len(placed) == PLACEABLE_DRAWS
    assert 3 * sum(placed) > len(placed), f"{sum(placed)} of {len(placed)} draws placeable"
    assert not all(placed)  # the refusals are drawn too
