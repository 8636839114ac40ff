"""Placement policy of docs/spec.md (section 3): compatibility rules, ranking, refusals.

Pure: no database, no clock. Every test starts from a fully compatible baseline
runner and requirements and breaks exactly one thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from secondbox_scheduler.domain import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    MaterializationSnapshot,
    NoCompatibleRunnerError,
    Requirements,
    RunnerSnapshot,
    SchedulerError,
    select_home_runner,
    select_runner,
)
from secondbox_scheduler.domain.placement.evidence import REASON_CODES
from secondbox_scheduler.domain.placement.ranking import rank_key
from secondbox_scheduler.domain.placement.rules import evaluate_runner
from secondbox_scheduler.testing import fleets, requirements
from secondbox_scheduler.testing.strategies import RUNNER_IDS

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TIMEOUT = timedelta(seconds=30)
GIB = 2**30
RUNTIME = "sha256:runtime"
TOOLCHAIN = "sha256:toolchain"
BACKEND = "firecracker"
ARCH = "x86_64"
POOL = "pool-a"
PREREQUISITES = ("network-policy", "storage", "cleanup", "local-workspace")
BASE_CAPABILITIES = frozenset({"compute", *PREREQUISITES, "snapshot-restore"})
NO_RUNNER = "SecondBox scheduler found no compatible runner"


# --------------------------------------------------------------------------- factories


def capacity(**amounts: int) -> Capacity:
    base = {
        "vcpu_count": 8,
        "memory_bytes": 16 * GIB,
        "disk_bytes": 100 * GIB,
        "instances": 4,
        "operations": 16,
    }
    base.update(amounts)
    return Capacity(**base)


REQUESTED = Capacity(
    vcpu_count=2, memory_bytes=4 * GIB, disk_bytes=10 * GIB, instances=1, operations=1
)


def materialization(**overrides: str) -> MaterializationSnapshot:
    fields = {
        "backend_kind": BACKEND,
        "architecture": ARCH,
        "runtime_digest": RUNTIME,
        "toolchain_digest": TOOLCHAIN,
        "digest": "sha256:materialized",
    }
    fields.update(overrides)
    return MaterializationSnapshot(**fields)


def make_requirements(**overrides: Any) -> Requirements:
    fields: dict[str, Any] = {
        "pool_name": POOL,
        "architecture": ARCH,
        "required_capabilities": frozenset({"snapshot-restore"}),
        "capacity": REQUESTED,
        "guest_protocol_generation": 3,
        "preferred_artifact_digests": (RUNTIME, TOOLCHAIN),
        "egress_context": None,
    }
    fields.update(overrides)
    return Requirements(**fields)


def make_runner(runner_id: str = "runner-a", **overrides: Any) -> RunnerSnapshot:
    fields: dict[str, Any] = {
        "id": runner_id,
        "pool_name": POOL,
        "backend_kind": BACKEND,
        "architecture": ARCH,
        "capabilities": BASE_CAPABILITIES,
        "allocatable": capacity(),
        "reserved": Capacity(),
        "drain_phase": DRAIN_PHASE_ACTIVE,
        "last_heartbeat_at": NOW - timedelta(seconds=1),
        "artifact_digests": (),
        "materializations": (materialization(),),
        "supported_egress_contexts": ("public",),
        "guest_protocol_minimum": 1,
        "guest_protocol_maximum": 5,
    }
    fields.update(overrides)
    return RunnerSnapshot(**fields)


def codes(
    runner: RunnerSnapshot,
    requirements: Requirements | None = None,
    now: datetime = NOW,
    timeout: timedelta = TIMEOUT,
) -> tuple[str, ...]:
    reqs = make_requirements() if requirements is None else requirements
    return evaluate_runner(reqs, runner, now, timeout).reason_codes


def select(runners: Sequence[RunnerSnapshot], requirements: Requirements | None = None) -> str:
    reqs = make_requirements() if requirements is None else requirements
    return select_runner(reqs, runners, NOW, TIMEOUT).id


# --------------------------------------------------------------------------- baseline


def test_baseline_runner_is_compatible_and_selected() -> None:
    runner = make_runner()
    evaluation = evaluate_runner(make_requirements(), runner, NOW, TIMEOUT)
    assert evaluation.compatible
    assert evaluation.reason_codes == ()
    assert evaluation.runner_id == "runner-a"
    assert select_runner(make_requirements(), [runner], NOW, TIMEOUT) == runner


def test_every_failed_rule_is_reported_in_check_order() -> None:
    runner = make_runner(
        pool_name="pool-b",
        drain_phase=DRAIN_PHASE_DRAINING,
        last_heartbeat_at=None,
        supported_egress_contexts=(),
    )
    assert codes(runner, make_requirements(egress_context="public")) == (
        "pool",
        "draining",
        "heartbeat_stale",
        "egress",
    )


# --------------------------------------------------------------------------- one rule each


@dataclass(frozen=True)
class Case:
    """A runner and requirements that fail exactly one rule."""

    name: str
    code: str
    runner: RunnerSnapshot
    requirements: Requirements
    summary_label: str


def _cases() -> list[Case]:
    req = make_requirements()
    no_compute = BASE_CAPABILITIES - {"compute"}
    cases = [
        Case("runner-pool", "pool", make_runner(pool_name="pool-b"), req, "in another pool"),
        Case(
            "requirements-pool",
            "pool",
            make_runner(),
            make_requirements(pool_name="pool-z"),
            "in another pool",
        ),
        Case(
            "runner-architecture",
            "architecture",
            # The materialization follows the runner's own architecture, so only
            # the architecture rule fails.
            make_runner(
                architecture="aarch64",
                materializations=(materialization(architecture="aarch64"),),
            ),
            req,
            "of another architecture",
        ),
        Case(
            "requirements-architecture",
            "architecture",
            make_runner(),
            make_requirements(architecture="aarch64"),
            "of another architecture",
        ),
        Case(
            "draining",
            "draining",
            make_runner(drain_phase=DRAIN_PHASE_DRAINING),
            req,
            "draining",
        ),
        Case(
            "unknown-drain-phase",
            "draining",
            make_runner(drain_phase="retired"),
            req,
            "draining",
        ),
        Case(
            "heartbeat-one-microsecond-too-old",
            "heartbeat_stale",
            make_runner(last_heartbeat_at=NOW - TIMEOUT - timedelta(microseconds=1)),
            req,
            "heartbeat stale",
        ),
        Case(
            "heartbeat-never",
            "heartbeat_stale",
            make_runner(last_heartbeat_at=None),
            req,
            "heartbeat stale",
        ),
        Case(
            "backend-kind-empty",
            "backend",
            # The materialization follows the runner's own (empty) backend kind.
            make_runner(backend_kind="", materializations=(materialization(backend_kind=""),)),
            req,
            "without compute backend",
        ),
        Case(
            "backend-without-compute",
            "backend",
            make_runner(capabilities=no_compute),
            req,
            "without compute backend",
        ),
        Case(
            "materialization-no-digests-requested",
            "materialization",
            make_runner(),
            make_requirements(preferred_artifact_digests=()),
            "without the materialization",
        ),
        Case(
            "materialization-only-runtime-requested",
            "materialization",
            make_runner(),
            make_requirements(preferred_artifact_digests=(RUNTIME,)),
            "without the materialization",
        ),
        Case(
            "materialization-three-digests-requested",
            "materialization",
            make_runner(),
            make_requirements(preferred_artifact_digests=(RUNTIME, TOOLCHAIN, "sha256:x")),
            "without the materialization",
        ),
        Case(
            "materialization-digests-swapped",
            "materialization",
            make_runner(),
            make_requirements(preferred_artifact_digests=(TOOLCHAIN, RUNTIME)),
            "without the materialization",
        ),
        Case(
            "materialization-none",
            "materialization",
            make_runner(materializations=()),
            req,
            "without the materialization",
        ),
        Case(
            "materialization-wrong-backend",
            "materialization",
            make_runner(materializations=(materialization(backend_kind="cloud-hypervisor"),)),
            req,
            "without the materialization",
        ),
        Case(
            "materialization-wrong-architecture",
            "materialization",
            make_runner(materializations=(materialization(architecture="aarch64"),)),
            req,
            "without the materialization",
        ),
        Case(
            "materialization-empty-digest",
            "materialization",
            make_runner(materializations=(materialization(digest=""),)),
            req,
            "without the materialization",
        ),
        Case(
            "materialization-other-runtime",
            "materialization",
            make_runner(materializations=(materialization(runtime_digest="sha256:old"),)),
            req,
            "without the materialization",
        ),
        Case(
            "materialization-other-toolchain",
            "materialization",
            make_runner(materializations=(materialization(toolchain_digest="sha256:old"),)),
            req,
            "without the materialization",
        ),
        Case(
            "guest-protocol-generation-zero",
            "guest_protocol",
            make_runner(guest_protocol_minimum=0, guest_protocol_maximum=5),
            make_requirements(guest_protocol_generation=0),
            "guest protocol unsupported",
        ),
        Case(
            "guest-protocol-below-minimum",
            "guest_protocol",
            make_runner(guest_protocol_minimum=4, guest_protocol_maximum=5),
            make_requirements(guest_protocol_generation=3),
            "guest protocol unsupported",
        ),
        Case(
            "guest-protocol-above-maximum",
            "guest_protocol",
            make_runner(guest_protocol_minimum=1, guest_protocol_maximum=2),
            make_requirements(guest_protocol_generation=3),
            "guest protocol unsupported",
        ),
        Case(
            "capability-required-missing-on-runner",
            "capability",
            make_runner(capabilities=BASE_CAPABILITIES - {"snapshot-restore"}),
            req,
            "missing a required capability",
        ),
        Case(
            "capability-requirements-ask-more",
            "capability",
            make_runner(),
            make_requirements(required_capabilities={"snapshot-restore", "gpu"}),
            "missing a required capability",
        ),
        Case(
            "capability-client-selected-image-missing-on-runner",
            "capability",
            # Materialization is skipped, but the capability itself is still required.
            make_runner(materializations=()),
            make_requirements(required_capabilities={"client-selected-image"}),
            "missing a required capability",
        ),
    ]
    cases += [
        Case(
            f"prerequisite-{name}",
            "prerequisite",
            make_runner(capabilities=BASE_CAPABILITIES - {name}),
            req,
            "missing a prerequisite capability",
        )
        for name in PREREQUISITES
    ]
    for dim in Capacity.DIMENSIONS:
        requested = REQUESTED.as_dict()[dim]
        # Free on this dimension is one less than requested: allocatable stays
        # larger than requested, the reservation makes the difference.
        cases.append(
            Case(
                f"capacity-{dim}",
                "capacity",
                make_runner(
                    allocatable=capacity(**{dim: requested + 5}),
                    reserved=Capacity(**{dim: 6}),
                ),
                req,
                f"insufficient {dim}",
            )
        )
    cases.append(
        Case(
            "egress-unsupported",
            "egress",
            make_runner(supported_egress_contexts=("public",)),
            make_requirements(egress_context="private"),
            "egress context unsupported",
        )
    )
    cases.append(
        Case(
            "egress-runner-supports-none",
            "egress",
            make_runner(supported_egress_contexts=()),
            make_requirements(egress_context="public"),
            "egress context unsupported",
        )
    )
    return cases


CASES = _cases()


def test_cases_cover_every_reason_code() -> None:
    assert {case.code for case in CASES} == set(REASON_CODES)
    assert len(REASON_CODES) == 11


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_runner_failing_one_rule_is_refused_with_exactly_that_code(case: Case) -> None:
    evaluation = evaluate_runner(case.requirements, case.runner, NOW, TIMEOUT)
    assert not evaluation.compatible
    assert evaluation.reason_codes == (case.code,)
    assert evaluation.failed_only_egress is (case.code == "egress")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_select_runner_refuses_a_single_rule_failure(case: Case) -> None:
    expected = EgressContextUnavailableError if case.code == "egress" else NoCompatibleRunnerError
    with pytest.raises(expected) as raised:
        select_runner(case.requirements, [case.runner], NOW, TIMEOUT)
    assert type(raised.value) is expected
    assert str(raised.value).endswith(f": 0/1 runners are available: 1 {case.summary_label}")
    assert [e.reason_codes for e in raised.value.evaluations] == [(case.code,)]


@pytest.mark.parametrize(
    "case",
    [case for case in CASES if case.requirements == make_requirements()],
    ids=[case.name for case in CASES if case.requirements == make_requirements()],
)
def test_runner_failing_one_rule_loses_to_a_worse_ranked_compatible_runner(case: Case) -> None:
    # The broken runner would win every ranking key if it were compatible.
    broken = case.runner.model_copy(
        update={"id": "runner-0", "artifact_digests": (RUNTIME, TOOLCHAIN)}
    )
    fallback = make_runner("runner-z", allocatable=capacity(instances=1, vcpu_count=2))
    assert select([broken, fallback]) == "runner-z"


# --- heartbeat


def test_heartbeat_exactly_at_the_timeout_boundary_is_fresh() -> None:
    assert codes(make_runner(last_heartbeat_at=NOW - TIMEOUT)) == ()


def test_heartbeat_one_microsecond_past_the_boundary_is_stale() -> None:
    stale = make_runner(last_heartbeat_at=NOW - TIMEOUT - timedelta(microseconds=1))
    assert codes(stale) == ("heartbeat_stale",)


def test_heartbeat_boundary_moves_with_the_timeout() -> None:
    runner = make_runner(last_heartbeat_at=NOW - timedelta(minutes=2))
    assert codes(runner, timeout=timedelta(minutes=2)) == ()
    assert codes(runner, timeout=timedelta(minutes=2) - timedelta(microseconds=1)) == (
        "heartbeat_stale",
    )


def test_never_heartbeated_runner_is_stale_however_long_the_timeout() -> None:
    assert codes(make_runner(last_heartbeat_at=None), timeout=timedelta(days=3650)) == (
        "heartbeat_stale",
    )


def test_heartbeat_in_another_timezone_compares_by_instant() -> None:
    plus_two = timezone(timedelta(hours=2))
    boundary = (NOW - TIMEOUT).astimezone(plus_two)
    runner = make_runner(last_heartbeat_at=boundary)
    assert runner.last_heartbeat_at == NOW - TIMEOUT
    assert codes(runner) == ()
    older = make_runner(last_heartbeat_at=boundary - timedelta(microseconds=1))
    assert codes(older) == ("heartbeat_stale",)


def test_heartbeat_at_now_and_slightly_ahead_is_fresh() -> None:
    assert codes(make_runner(last_heartbeat_at=NOW)) == ()
    assert codes(make_runner(last_heartbeat_at=NOW + timedelta(seconds=1))) == ()


# --- backend


def test_empty_backend_and_missing_compute_still_one_backend_failure() -> None:
    runner = make_runner(
        backend_kind="",
        capabilities=BASE_CAPABILITIES - {"compute"},
        materializations=(materialization(backend_kind=""),),
    )
    assert codes(runner) == ("backend",)


def test_missing_compute_fails_backend_and_capability_when_compute_is_required() -> None:
    runner = make_runner(capabilities=BASE_CAPABILITIES - {"compute"})
    requirements = make_requirements(required_capabilities={"compute", "snapshot-restore"})
    assert codes(runner, requirements) == ("backend", "capability")


# --- materialization


def test_materialization_matching_one_of_several_is_enough() -> None:
    runner = make_runner(
        materializations=(
            materialization(backend_kind="cloud-hypervisor"),
            materialization(digest=""),
            materialization(architecture="aarch64"),
            materialization(),
        )
    )
    assert codes(runner) == ()


def test_materialization_must_match_in_one_entry_not_across_entries() -> None:
    runner = make_runner(
        materializations=(
            materialization(toolchain_digest="sha256:other"),
            materialization(runtime_digest="sha256:other"),
        )
    )
    assert codes(runner) == ("materialization",)


def test_materialization_skipped_for_client_selected_image() -> None:
    requirements = make_requirements(required_capabilities={"client-selected-image"})
    runner = make_runner(
        capabilities=BASE_CAPABILITIES | {"client-selected-image"}, materializations=()
    )
    assert codes(runner, requirements) == ()
    # Without the skip, the same runner and digests fail only materialization.
    assert codes(runner, make_requirements()) == ("materialization",)


def test_materialization_skip_ignores_wrong_materializations() -> None:
    requirements = make_requirements(required_capabilities={"client-selected-image"})
    runner = make_runner(
        capabilities=BASE_CAPABILITIES | {"client-selected-image"},
        materializations=(materialization(digest="", backend_kind="qemu"),),
    )
    assert codes(runner, requirements) == ()


@pytest.mark.parametrize(
    "digests", [(), ("sha256:a",), ("sha256:a", "sha256:b", "sha256:c")], ids=["0", "1", "3"]
)
@pytest.mark.parametrize("client_selected", [False, True], ids=["pinned", "client-selected"])
def test_preferred_digests_must_be_exactly_runtime_and_toolchain(
    digests: tuple[str, ...], client_selected: bool
) -> None:
    """As the original: requirements without exactly [runtime, toolchain] digests are
    compatible with no runner, even when the client selects the image."""
    wanted = {"client-selected-image"} if client_selected else set()
    requirements = make_requirements(
        required_capabilities=wanted, preferred_artifact_digests=digests
    )
    runner = make_runner(capabilities=BASE_CAPABILITIES | {"client-selected-image"})
    assert codes(runner, requirements) == ("materialization",)
    with pytest.raises(NoCompatibleRunnerError):
        select_runner(requirements, [runner], NOW, TIMEOUT)


# --- guest protocol


@pytest.mark.parametrize(
    ("generation", "compatible"), [(1, False), (2, True), (3, True), (4, True), (5, False)]
)
def test_guest_protocol_bounds_are_inclusive(generation: int, compatible: bool) -> None:
    runner = make_runner(guest_protocol_minimum=2, guest_protocol_maximum=4)
    expected: tuple[str, ...] = () if compatible else ("guest_protocol",)
    assert codes(runner, make_requirements(guest_protocol_generation=generation)) == expected


def test_guest_protocol_single_generation_range() -> None:
    runner = make_runner(guest_protocol_minimum=3, guest_protocol_maximum=3)
    assert codes(runner, make_requirements(guest_protocol_generation=3)) == ()


def test_guest_protocol_generation_zero_is_refused_even_when_runner_range_has_zero() -> None:
    runner = make_runner(guest_protocol_minimum=0, guest_protocol_maximum=0)
    assert codes(runner, make_requirements(guest_protocol_generation=0)) == ("guest_protocol",)


# --- capability


def test_runner_with_extra_capabilities_is_compatible() -> None:
    runner = make_runner(capabilities=BASE_CAPABILITIES | {"gpu", "tpu"})
    assert codes(runner) == ()


def test_capabilities_given_as_map_only_count_true_entries() -> None:
    caps = dict.fromkeys(BASE_CAPABILITIES, True)
    caps["snapshot-restore"] = False
    runner = make_runner(capabilities=caps)
    assert codes(runner) == ("capability",)


# --- capacity


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
def test_capacity_reports_the_shortfall_of_the_one_dimension(dim: str) -> None:
    requested = REQUESTED.as_dict()[dim]
    runner = make_runner(
        allocatable=capacity(**{dim: requested + 10}), reserved=Capacity(**{dim: 13})
    )
    evaluation = evaluate_runner(make_requirements(), runner, NOW, TIMEOUT)
    assert evaluation.reason_codes == ("capacity",)
    (failure,) = evaluation.failures
    assert dict(failure.shortfall) == {dim: 3}


def test_capacity_reports_every_short_dimension() -> None:
    runner = make_runner(
        allocatable=capacity(vcpu_count=1, memory_bytes=GIB, instances=0),
        reserved=Capacity(),
    )
    (failure,) = evaluate_runner(make_requirements(), runner, NOW, TIMEOUT).failures
    assert failure.code == "capacity"
    assert dict(failure.shortfall) == {"vcpu_count": 1, "memory_bytes": 3 * GIB, "instances": 1}


def test_capacity_exact_fit_on_every_dimension_passes() -> None:
    reserved = Capacity(vcpu_count=3, memory_bytes=GIB, disk_bytes=7, instances=2, operations=4)
    allocatable = Capacity(
        **{dim: REQUESTED.as_dict()[dim] + reserved.as_dict()[dim] for dim in Capacity.DIMENSIONS}
    )
    runner = make_runner(allocatable=allocatable, reserved=reserved)
    assert runner.free() == REQUESTED
    assert codes(runner) == ()


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
def test_capacity_one_unit_short_fails(dim: str) -> None:
    reserved = Capacity(vcpu_count=3, memory_bytes=GIB, disk_bytes=7, instances=2, operations=4)
    exact = {d: REQUESTED.as_dict()[d] + reserved.as_dict()[d] for d in Capacity.DIMENSIONS}
    exact[dim] -= 1
    runner = make_runner(allocatable=Capacity(**exact), reserved=reserved)
    (failure,) = evaluate_runner(make_requirements(), runner, NOW, TIMEOUT).failures
    assert (failure.code, dict(failure.shortfall)) == ("capacity", {dim: 1})


def test_capacity_disk_unchecked_with_physical_storage_admission() -> None:
    short_on_disk: dict[str, Any] = {
        "allocatable": capacity(disk_bytes=GIB),
        "reserved": Capacity(),
    }
    plain = make_runner(**short_on_disk)
    (failure,) = evaluate_runner(make_requirements(), plain, NOW, TIMEOUT).failures
    assert dict(failure.shortfall) == {"disk_bytes": 9 * GIB}
    admitted = make_runner(
        capabilities=BASE_CAPABILITIES | {"physical-storage-admission"}, **short_on_disk
    )
    assert codes(admitted) == ()


def test_physical_storage_admission_does_not_exempt_other_dimensions() -> None:
    runner = make_runner(
        capabilities=BASE_CAPABILITIES | {"physical-storage-admission"},
        allocatable=capacity(disk_bytes=0, memory_bytes=GIB),
    )
    (failure,) = evaluate_runner(make_requirements(), runner, NOW, TIMEOUT).failures
    assert dict(failure.shortfall) == {"memory_bytes": 3 * GIB}


def test_zero_request_fits_an_empty_runner() -> None:
    runner = make_runner(allocatable=Capacity())
    assert codes(runner, make_requirements(capacity=Capacity())) == ()
    assert codes(runner) == ("capacity",)


# --- egress


def test_egress_none_needs_no_supported_context() -> None:
    runner = make_runner(supported_egress_contexts=())
    assert codes(runner, make_requirements(egress_context=None)) == ()


def test_egress_supported_context_passes() -> None:
    runner = make_runner(supported_egress_contexts=("public", "private"))
    assert codes(runner, make_requirements(egress_context="private")) == ()
    assert codes(runner, make_requirements(egress_context="public")) == ()


def test_egress_unsupported_context_fails() -> None:
    runner = make_runner(supported_egress_contexts=("public", "private"))
    assert codes(runner, make_requirements(egress_context="corp-vpn")) == ("egress",)


# --------------------------------------------------------------------------- ranking


def test_rank_artifact_locality_descending() -> None:
    none = make_runner("runner-a", artifact_digests=())
    one = make_runner("runner-b", artifact_digests=(RUNTIME,))
    two = make_runner("runner-c", artifact_digests=(TOOLCHAIN, RUNTIME))
    assert select([none, one, two]) == "runner-c"
    assert select([none, one]) == "runner-b"
    reqs = make_requirements()
    assert rank_key(reqs, two) < rank_key(reqs, one) < rank_key(reqs, none)


def test_rank_locality_counts_only_preferred_digests() -> None:
    unrelated = make_runner("runner-a", artifact_digests=("sha256:x", "sha256:y", "sha256:z"))
    preferred = make_runner("runner-b", artifact_digests=(RUNTIME,))
    assert select([unrelated, preferred]) == "runner-b"


def test_rank_locality_dominates_free_instances_vcpu_memory_and_id() -> None:
    local = make_runner(
        "runner-z",
        artifact_digests=(RUNTIME,),
        allocatable=capacity(instances=1, vcpu_count=2, memory_bytes=4 * GIB),
    )
    roomy = make_runner(
        "runner-a",
        artifact_digests=(),
        allocatable=capacity(instances=64, vcpu_count=128, memory_bytes=1024 * GIB),
    )
    assert select([roomy, local]) == "runner-z"


def test_rank_free_instances_descending() -> None:
    # Same locality; instances differ by what is free, not by what is allocatable.
    busy = make_runner(
        "runner-a", allocatable=capacity(instances=10), reserved=Capacity(instances=9)
    )
    idle = make_runner("runner-b", allocatable=capacity(instances=4), reserved=Capacity())
    assert select([busy, idle]) == "runner-b"
    reqs = make_requirements()
    assert rank_key(reqs, idle) < rank_key(reqs, busy)


def test_rank_free_instances_dominate_vcpu_memory_and_id() -> None:
    more_instances = make_runner(
        "runner-z", allocatable=capacity(instances=3, vcpu_count=2, memory_bytes=4 * GIB)
    )
    more_of_the_rest = make_runner(
        "runner-a", allocatable=capacity(instances=2, vcpu_count=64, memory_bytes=512 * GIB)
    )
    assert select([more_of_the_rest, more_instances]) == "runner-z"


def test_rank_free_vcpu_descending() -> None:
    fewer = make_runner(
        "runner-a", allocatable=capacity(vcpu_count=16), reserved=Capacity(vcpu_count=12)
    )
    more = make_runner(
        "runner-b", allocatable=capacity(vcpu_count=8), reserved=Capacity(vcpu_count=2)
    )
    assert select([fewer, more]) == "runner-b"


def test_rank_free_vcpu_dominates_memory_and_id() -> None:
    more_vcpu = make_runner("runner-z", allocatable=capacity(vcpu_count=9, memory_bytes=4 * GIB))
    more_memory = make_runner(
        "runner-a", allocatable=capacity(vcpu_count=8, memory_bytes=512 * GIB)
    )
    assert select([more_memory, more_vcpu]) == "runner-z"


def test_rank_free_memory_descending() -> None:
    fewer = make_runner(
        "runner-a",
        allocatable=capacity(memory_bytes=64 * GIB),
        reserved=Capacity(memory_bytes=56 * GIB),
    )
    more = make_runner("runner-b", allocatable=capacity(memory_bytes=16 * GIB))
    assert select([fewer, more]) == "runner-b"


def test_rank_free_memory_dominates_id() -> None:
    more_memory = make_runner("runner-z", allocatable=capacity(memory_bytes=16 * GIB + 1))
    lower_id = make_runner("runner-a", allocatable=capacity(memory_bytes=16 * GIB))
    assert select([lower_id, more_memory]) == "runner-z"


def test_rank_disk_and_operations_are_not_ranking_keys() -> None:
    small = make_runner("runner-a", allocatable=capacity(disk_bytes=10 * GIB, operations=1))
    large = make_runner("runner-b", allocatable=capacity(disk_bytes=900 * GIB, operations=900))
    assert select([large, small]) == "runner-a"


def test_rank_id_ascending_breaks_full_ties() -> None:
    runners = [make_runner(runner_id) for runner_id in ("runner-c", "runner-a", "runner-b")]
    assert select(runners) == "runner-a"
    assert select(list(reversed(runners))) == "runner-a"


def test_rank_id_is_compared_as_text() -> None:
    assert select([make_runner("runner-10"), make_runner("runner-9")]) == "runner-10"
    assert select([make_runner("b"), make_runner("B")]) == "B"


def test_rank_key_orders_keys_as_the_spec_lists_them() -> None:
    runner = make_runner(
        "runner-q",
        artifact_digests=(RUNTIME, "sha256:other"),
        allocatable=capacity(instances=5, vcpu_count=7, memory_bytes=11),
        reserved=Capacity(instances=1, vcpu_count=2, memory_bytes=3),
    )
    assert rank_key(make_requirements(), runner) == (-1, -4, -5, -8, "runner-q")


# --------------------------------------------------------------------------- refusals


def test_no_compatible_runner_message_summarizes_counts() -> None:
    runners = [
        make_runner("runner-a", pool_name="pool-b"),
        make_runner("runner-b", drain_phase=DRAIN_PHASE_DRAINING),
        make_runner("runner-c", allocatable=capacity(memory_bytes=GIB)),
    ]
    with pytest.raises(NoCompatibleRunnerError) as raised:
        select_runner(make_requirements(), runners, NOW, TIMEOUT)
    message = str(raised.value)
    assert message.startswith(NO_RUNNER)
    assert "0/3 runners are available" in message
    for part in ("1 in another pool", "1 draining", "1 insufficient memory_bytes"):
        assert part in message
    assert isinstance(raised.value, SchedulerError)
    assert [e.runner_id for e in raised.value.evaluations] == ["runner-a", "runner-b", "runner-c"]


def test_summary_counts_runners_per_reason_most_frequent_first() -> None:
    runners = [
        make_runner("runner-a", drain_phase=DRAIN_PHASE_DRAINING),
        make_runner("runner-b", drain_phase=DRAIN_PHASE_DRAINING, last_heartbeat_at=None),
        make_runner("runner-c", last_heartbeat_at=None),
        make_runner("runner-d", drain_phase=DRAIN_PHASE_DRAINING),
    ]
    with pytest.raises(NoCompatibleRunnerError) as raised:
        select_runner(make_requirements(), runners, NOW, TIMEOUT)
    assert str(raised.value) == (
        f"{NO_RUNNER}: 0/4 runners are available: 3 draining, 2 heartbeat stale"
    )


def test_no_runners_at_all_is_no_compatible_runner() -> None:
    with pytest.raises(NoCompatibleRunnerError) as raised:
        select_runner(make_requirements(), [], NOW, TIMEOUT)
    assert str(raised.value) == NO_RUNNER


def test_egress_only_failure_raises_egress_context_unavailable() -> None:
    requirements = make_requirements(egress_context="private")
    runners = [
        make_runner("runner-a", supported_egress_contexts=("public",)),
        make_runner("runner-b", pool_name="pool-b", supported_egress_contexts=("private",)),
        make_runner("runner-c", drain_phase=DRAIN_PHASE_DRAINING),
    ]
    with pytest.raises(EgressContextUnavailableError) as raised:
        select_runner(requirements, runners, NOW, TIMEOUT)
    message = str(raised.value)
    assert "0/3 runners are available" in message
    assert "2 egress context unsupported" in message
    assert "1 in another pool" in message
    assert "1 draining" in message
    assert isinstance(raised.value, SchedulerError)


def test_egress_failure_together_with_another_rule_is_no_compatible_runner() -> None:
    requirements = make_requirements(egress_context="private")
    runners = [
        make_runner("runner-a", drain_phase=DRAIN_PHASE_DRAINING),
        make_runner("runner-b", last_heartbeat_at=None),
    ]
    with pytest.raises(NoCompatibleRunnerError) as raised:
        select_runner(requirements, runners, NOW, TIMEOUT)
    assert type(raised.value) is NoCompatibleRunnerError
    assert str(raised.value).startswith(NO_RUNNER)
    assert "2 egress context unsupported" in str(raised.value)


def test_compatible_runner_wins_over_egress_only_failures() -> None:
    requirements = make_requirements(egress_context="private")
    runners = [
        make_runner("runner-a", supported_egress_contexts=("public",), artifact_digests=(RUNTIME,)),
        make_runner("runner-b", supported_egress_contexts=("private",)),
    ]
    assert select(runners, requirements) == "runner-b"


# --------------------------------------------------------------------------- home runner


def _fleet() -> list[RunnerSnapshot]:
    return [
        make_runner(
            "runner-best",
            artifact_digests=(RUNTIME, TOOLCHAIN),
            allocatable=capacity(instances=64),
        ),
        make_runner("runner-home", allocatable=capacity(instances=1)),
    ]


def test_home_runner_is_selected_even_when_another_ranks_better() -> None:
    requirements = make_requirements()
    fleet = _fleet()
    assert select_runner(requirements, fleet, NOW, TIMEOUT).id == "runner-best"
    chosen = select_home_runner("runner-home", requirements, fleet, NOW, TIMEOUT)
    assert chosen == fleet[1]


def test_empty_home_runner_id_is_unavailable() -> None:
    with pytest.raises(HomeRunnerUnavailableError) as raised:
        select_home_runner("", make_requirements(), _fleet(), NOW, TIMEOUT)
    assert isinstance(raised.value, SchedulerError)


def test_empty_home_runner_id_does_not_match_a_runner_with_empty_id() -> None:
    with pytest.raises(HomeRunnerUnavailableError):
        select_home_runner("", make_requirements(), [make_runner("")], NOW, TIMEOUT)


def test_absent_home_runner_is_unavailable() -> None:
    with pytest.raises(HomeRunnerUnavailableError) as raised:
        select_home_runner("runner-gone", make_requirements(), _fleet(), NOW, TIMEOUT)
    assert "runner-gone" in str(raised.value)
    assert raised.value.evaluations == ()


def test_incompatible_home_runner_is_unavailable_despite_compatible_others() -> None:
    fleet = [*_fleet(), make_runner("runner-away", drain_phase=DRAIN_PHASE_DRAINING)]
    with pytest.raises(HomeRunnerUnavailableError) as raised:
        select_home_runner("runner-away", make_requirements(), fleet, NOW, TIMEOUT)
    assert type(raised.value) is HomeRunnerUnavailableError
    # Only the home runner is evaluated: the others are invisible.
    assert "0/1 runners are available: 1 draining" in str(raised.value)
    assert [e.runner_id for e in raised.value.evaluations] == ["runner-away"]


def test_home_runner_egress_only_failure_stays_egress_context_unavailable() -> None:
    requirements = make_requirements(egress_context="private")
    fleet = [
        make_runner("runner-home", supported_egress_contexts=("public",)),
        make_runner("runner-other", supported_egress_contexts=("private",)),
    ]
    assert select(fleet, requirements) == "runner-other"
    with pytest.raises(EgressContextUnavailableError) as raised:
        select_home_runner("runner-home", requirements, fleet, NOW, TIMEOUT)
    assert "0/1 runners are available: 1 egress context unsupported" in str(raised.value)


def test_egress_only_failure_of_an_invisible_runner_does_not_leak_into_home_refusal() -> None:
    requirements = make_requirements(egress_context="private")
    fleet = [
        make_runner(
            "runner-home",
            drain_phase=DRAIN_PHASE_DRAINING,
            supported_egress_contexts=("private",),
        ),
        make_runner("runner-other", supported_egress_contexts=("public",)),
    ]
    with pytest.raises(HomeRunnerUnavailableError) as raised:
        select_home_runner("runner-home", requirements, fleet, NOW, TIMEOUT)
    assert type(raised.value) is HomeRunnerUnavailableError


@pytest.mark.parametrize(
    "case",
    [case for case in CASES if case.requirements == make_requirements()],
    ids=[case.name for case in CASES if case.requirements == make_requirements()],
)
def test_home_runner_failing_any_one_rule_is_unavailable(case: Case) -> None:
    home = case.runner.model_copy(update={"id": "runner-home"})
    fleet = [make_runner("runner-other"), home]
    with pytest.raises(HomeRunnerUnavailableError):
        select_home_runner("runner-home", case.requirements, fleet, NOW, TIMEOUT)


# --------------------------------------------------------------------------- properties

# The strategies ship with the package (secondbox_scheduler.testing), for embedders too.
requirements_strategy = requirements()


def _outcome(
    requirements: Requirements, runners: Sequence[RunnerSnapshot]
) -> RunnerSnapshot | type[Exception]:
    try:
        return select_runner(requirements, runners, NOW, TIMEOUT)
    except (NoCompatibleRunnerError, EgressContextUnavailableError) as error:
        return type(error)


PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(requirements=requirements_strategy, runners=fleets(now=NOW), data=st.data())
def test_select_runner_is_deterministic_and_order_independent(
    requirements: Requirements, runners: list[RunnerSnapshot], data: st.DataObject
) -> None:
    first = _outcome(requirements, runners)
    assert _outcome(requirements, runners) == first
    shuffled = data.draw(st.permutations(runners))
    assert _outcome(requirements, shuffled) == first


@PROPERTY_SETTINGS
@given(requirements=requirements_strategy, runners=fleets(now=NOW))
def test_chosen_runner_is_compatible_and_no_compatible_runner_ranks_better(
    requirements: Requirements, runners: list[RunnerSnapshot]
) -> None:
    evaluations = [evaluate_runner(requirements, r, NOW, TIMEOUT) for r in runners]
    compatible = [r for r, e in zip(runners, evaluations, strict=True) if e.compatible]
    outcome = _outcome(requirements, runners)
    if not compatible:
        egress_only = any(e.reason_codes == ("egress",) for e in evaluations)
        expected = EgressContextUnavailableError if egress_only else NoCompatibleRunnerError
        assert outcome is expected
        return
    assert isinstance(outcome, RunnerSnapshot)
    assert outcome in runners
    assert evaluate_runner(requirements, outcome, NOW, TIMEOUT).compatible
    best = rank_key(requirements, outcome)
    for runner in compatible:
        assert not rank_key(requirements, runner) < best


@PROPERTY_SETTINGS
@given(requirements=requirements_strategy, runners=fleets(now=NOW), data=st.data())
def test_home_selection_sees_only_the_home_runner(
    requirements: Requirements, runners: list[RunnerSnapshot], data: st.DataObject
) -> None:
    home_id = data.draw(st.sampled_from(RUNNER_IDS))
    home = [r for r in runners if r.id == home_id]
    try:
        chosen: RunnerSnapshot | type[Exception] = select_home_runner(
            home_id, requirements, runners, NOW, TIMEOUT
        )
    except (HomeRunnerUnavailableError, EgressContextUnavailableError) as error:
        chosen = type(error)
    assert chosen == _home_outcome(requirements, home)


def _home_outcome(
    requirements: Requirements, home: list[RunnerSnapshot]
) -> RunnerSnapshot | type[Exception]:
    if not home:
        return HomeRunnerUnavailableError
    evaluation = evaluate_runner(requirements, home[0], NOW, TIMEOUT)
    if evaluation.compatible:
        return home[0]
    if evaluation.reason_codes == ("egress",):
        return EgressContextUnavailableError
    return HomeRunnerUnavailableError


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
def test_capacity_negative_is_invalid_naming_the_field(dim: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        Capacity(**{dim: -1})
    assert raised.value.field == dim
    assert dim in str(raised.value)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("dim", Capacity.DIMENSIONS)
@pytest.mark.parametrize("flag", [True, False])
def test_capacity_bool_is_invalid_naming_the_field(dim: str, flag: bool) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        Capacity(**{dim: flag})
    assert raised.value.field == dim


def test_capacity_zero_and_positive_are_valid() -> None:
    value = Capacity(vcpu_count=0, memory_bytes=1, disk_bytes=2**63 - 1)
    assert value.as_dict() == {
        "vcpu_count": 0,
        "memory_bytes": 1,
        "disk_bytes": 2**63 - 1,
        "instances": 0,
        "operations": 0,
    }


def test_nested_negative_capacity_is_invalid_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        RunnerSnapshot(id="runner-a", allocatable={"disk_bytes": -1})
    assert raised.value.field.startswith("allocatable")
    assert "disk_bytes" in str(raised.value)


def test_naive_heartbeat_is_rejected() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        make_runner(last_heartbeat_at=datetime(2026, 3, 1, 12, 0))
    assert raised.value.field == "last_heartbeat_at"


def test_aware_heartbeat_is_normalized_to_utc() -> None:
    eastern = timezone(timedelta(hours=-5))
    runner = make_runner(last_heartbeat_at=datetime(2026, 3, 1, 7, 0, tzinfo=eastern))
    assert runner.last_heartbeat_at == datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert runner.last_heartbeat_at is not None
    assert runner.last_heartbeat_at.utcoffset() == timedelta(0)


def test_capabilities_accept_a_map_keeping_true_entries() -> None:
    runner = RunnerSnapshot(
        id="runner-a", capabilities={"compute": True, "storage": False, "cleanup": True}
    )
    assert runner.capabilities == frozenset({"compute", "cleanup"})
    requirements = Requirements(required_capabilities={"gpu": True, "tpu": False})
    assert requirements.required_capabilities == frozenset({"gpu"})


def test_capabilities_accept_a_set_of_names() -> None:
    runner = RunnerSnapshot(id="runner-a", capabilities=["compute", "storage", "compute"])
    assert runner.capabilities == frozenset({"compute", "storage"})


def test_values_are_immutable() -> None:
    runner = make_runner()
    with pytest.raises(ValidationError):
        runner.pool_name = "pool-b"  # type: ignore[misc]
    assert runner.pool_name == POOL
