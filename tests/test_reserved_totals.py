"""Reserved totals stay within what the read models store (docs/spec.md, "Limits").

A runner with "physical-storage-admission" does not check disk against allocatable, so
only the reserved-total limit (``MAX_RESERVED_TOTAL``, 2**63-1, a BIGINT) bounds the sum
of its disk reservations: the Runner refuses a reservation past it, the placement rules
count it as a capacity shortfall, and every event the aggregates accept projects.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain.errors import (
    CapacityExceededError,
    NoCompatibleRunnerError,
    SchedulerError,
)
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import Capacity
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.testing.builders import PHYSICAL_STORAGE_ADMISSION, T0
from tests.conftest import Clock, Store
from tests.factories import (
    CAPABILITIES,
    capacity,
    create_sandbox,
    register,
    requirements,
    schedule_request,
)
from tests.test_projections import check_live_rebuilt_folded, fresh_store, read_models_of

INT64_MAX = 2**63 - 1
EXTREMES = (0, 1, 2**62, INT64_MAX)  # INT64_MAX is the most a Capacity dimension takes
ADMITTING = (*CAPABILITIES, PHYSICAL_STORAGE_ADMISSION)


def disk_requirements(disk: int) -> dict[str, Any]:
    return {
        "capacity": Capacity(
            vcpu_count=1, memory_bytes=1, disk_bytes=disk, instances=1, operations=1
        )
    }


def test_the_runner_refuses_a_reservation_past_the_reserved_total_naming_the_dimension() -> None:
    runner = Runner.register(
        runner_id="r1", pool_name="pool-a", backend_kind="firecracker", architecture="x86_64",
        capabilities=ADMITTING, allocatable=capacity(), guest_protocol_minimum=1,
        guest_protocol_maximum=3, supported_egress_contexts=(), at=T0,
    )  # fmt: skip
    huge = Capacity(disk_bytes=INT64_MAX)
    runner.reserve(assignment_id="a1", sandbox_id="s1", generation=1, capacity=huge, at=T0)
    with pytest.raises(CapacityExceededError) as refused:
        runner.reserve(assignment_id="a2", sandbox_id="s2", generation=1, capacity=huge, at=T0)
    assert getattr(refused.value, "dimension", None) == "disk_bytes"
    assert "disk_bytes" in str(refused.value)
    assert runner.reserved["disk_bytes"] == INT64_MAX
    # Up to the limit exactly is fine: 2**62 + (2**62 - 1) == INT64_MAX.
    other = Runner.register(
        runner_id="r2", pool_name="pool-a", backend_kind="firecracker", architecture="x86_64",
        capabilities=ADMITTING, allocatable=capacity(), guest_protocol_minimum=1,
        guest_protocol_maximum=3, supported_egress_contexts=(), at=T0,
    )  # fmt: skip
    for number, disk in enumerate((2**62, 2**62 - 1)):
        other.reserve(
            assignment_id=f"b{number}", sandbox_id=f"s{number}", generation=1,
            capacity=Capacity(disk_bytes=disk), at=T0,
        )  # fmt: skip
    assert other.reserved["disk_bytes"] == INT64_MAX


def test_two_maximal_unchecked_disk_placements_leave_the_read_models_working(
    store: Store, clock: Clock
) -> None:
    app = store.open()
    register(app, "r1", at=clock(), capabilities=ADMITTING)
    register(app, "other", at=clock(), pool_name="pool-b")
    create_sandbox(app, "s1", **disk_requirements(INT64_MAX))
    app.schedule(
        schedule_request("s1", clock(), requirements=requirements(**disk_requirements(INT64_MAX)))
    )
    with pytest.raises(NoCompatibleRunnerError, match="disk_bytes"):
        create_sandbox(app, "s2", **disk_requirements(INT64_MAX))
    # The read models still answer, in this pool and in another.
    assert app.get_runner("r1").reserved.disk_bytes == INT64_MAX
    assert [r.id for r in app.runner_snapshots()] == ["other", "r1"]
    create_sandbox(app, "b1", pool_name="pool-b")
    check_live_rebuilt_folded(app)
    assert verify(app).ok


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@settings(
    max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    admitting=st.booleans(),
    allocatable=st.lists(st.sampled_from(EXTREMES), min_size=5, max_size=5),
    requests=st.lists(
        st.lists(st.sampled_from(EXTREMES), min_size=5, max_size=5), min_size=1, max_size=4
    ),
    resize=st.none() | st.lists(st.sampled_from(EXTREMES), min_size=5, max_size=5),
)
@example(  # the red team's case: two maximal disk reservations where disk is unchecked
    admitting=True,
    allocatable=[INT64_MAX] * 5,
    requests=[[1, 1, INT64_MAX, 1, 1]] * 2,
    resize=None,
)
def test_extreme_capacities_project_and_rebuild_equal_to_the_fold(
    kind: str,
    admitting: bool,
    allocatable: list[int],
    requests: list[list[int]],
    resize: list[int] | None,
    request: pytest.FixtureRequest,
) -> None:
    server = request.getfixturevalue("postgres_server") if kind == "postgres" else None
    with fresh_store(kind, server) as env:
        clock = Clock()
        app = SchedulerApplication(env=env, now=clock)
        try:
            capabilities = ADMITTING if admitting else CAPABILITIES
            amounts = dict(zip(Capacity.DIMENSIONS, allocatable, strict=True))
            register(
                app, "r1", at=clock(), capabilities=capabilities, allocatable=Capacity(**amounts)
            )
            for number, wanted in enumerate(requests):
                sandbox_id = f"s{number + 1}"  # the sandboxes the read-model check reads
                need = Capacity(**dict(zip(Capacity.DIMENSIONS, wanted, strict=True)))
                try:
                    create_sandbox(app, sandbox_id, capacity=need)
                    app.schedule(
                        schedule_request(
                            sandbox_id, clock(), requirements=requirements(capacity=need)
                        )
                    )
                except SchedulerError:
                    pass
                if resize is not None and number == 0:
                    new = Capacity(**dict(zip(Capacity.DIMENSIONS, resize, strict=True)))
                    with contextlib.suppress(SchedulerError):
                        app.change_allocatable("r1", new)
            read_models_of(app).catch_up()
            check_live_rebuilt_folded(app)
            assert verify(app).ok
        finally:
            app.close()
