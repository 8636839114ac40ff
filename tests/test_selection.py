"""create_sandbox over a store's read model chooses exactly what select_runner chooses.

With the read model, create_sandbox evaluates only the runners that pass an SQL
prefilter, best first by an upper bound of the ranking key, and stops once the rest
provably rank lower (docs/architecture.md, "Selection without reading the pool").
These tests compare it with the pure ``select_runner`` over the whole pool on random
pools, on SQLite and PostgreSQL, with tiny pages so that paging is exercised.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import secondbox_scheduler.projections.candidates as candidates
from secondbox_scheduler.domain import (
    Capacity,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    select_runner,
)
from secondbox_scheduler.domain.errors import PlacementError
from secondbox_scheduler.domain.placement.evidence import Unlisted, summarize_refusals
from secondbox_scheduler.domain.placement.rules import decide
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.queries import explain
from tests.conftest import Clock
from tests.factories import CAPABILITIES, HEARTBEAT_TIMEOUT, RUNTIME, TOOLCHAIN, capacity

OTHER = "sha256:other"
TRICKY = f'x"{RUNTIME}'  # its JSON text contains "sha256:runtime": bound above locality
_pools = itertools.count()

_DEFECTS = st.sampled_from(["compute", "storage", "cleanup", *[None] * 17])
RUNNER = st.fixed_dictionaries(
    {
        "suffix": st.text(alphabet="aBz_é9-", min_size=1, max_size=3),
        "architecture": st.sampled_from(["x86_64"] * 9 + ["aarch64"]),
        "backend_kind": st.sampled_from(["firecracker"] * 9 + [""]),
        "capabilities": st.tuples(
            _DEFECTS,
            st.lists(
                st.sampled_from(["physical-storage-admission", "gpu", 'x"compute"']), unique=True
            ),
        ).map(lambda t: [n for n in CAPABILITIES if n != t[0]] + t[1]),
        "instances": st.integers(0, 4),
        "vcpu": st.integers(0, 4),
        "memory": st.integers(0, 4),
        "disk": st.integers(0, 4),
        "guest": st.sampled_from([(1, 3)] * 8 + [(1, 1), (2, 2), (3, 3), (2, 3)]),
        "egress": st.sampled_from([("default",)] * 4 + [()]),
        "heartbeat_age": st.sampled_from(
            [0.0] * 4 + [10.0] * 4 + [29.999999, 30.0, 30.000001, 90.0, None]
        ),
        "digests": st.lists(
            st.sampled_from([RUNTIME, TOOLCHAIN, OTHER, "sha256:runtime2", TRICKY]), max_size=12
        ),
        "materialized": st.sampled_from([True] * 9 + [False]),
        "draining": st.sampled_from([False] * 9 + [True]),
    }
)

REQUIREMENTS = st.fixed_dictionaries(
    {
        "required_capabilities": st.sampled_from(
            [
                frozenset(),
                frozenset(),
                frozenset({"storage"}),
                frozenset({"gpu"}),
                frozenset({"client-selected-image"}),
            ]
        ),
        "capacity": st.builds(
            lambda i, v, m, d: Capacity(
                instances=i, vcpu_count=v, memory_bytes=m, disk_bytes=d, operations=0
            ),
            st.integers(0, 1),
            st.integers(0, 2),
            st.integers(0, 1),
            st.integers(0, 2),
        ),
        "guest_protocol_generation": st.integers(1, 3),
        "preferred_artifact_digests": st.sampled_from(
            [(RUNTIME, TOOLCHAIN)] * 8 + [(TOOLCHAIN, RUNTIME), (RUNTIME,), ()]
        ),
        "egress_context": st.sampled_from([None, None, "default", "default"]),
    }
)


def _register(app: SchedulerApplication, clock: Clock, pool: str, spec: dict[str, Any]) -> str:
    runner_id = f"{pool}-{spec['suffix']}"
    app.register_runner(
        runner_id=runner_id,
        pool_name=pool,
        backend_kind=spec["backend_kind"],
        architecture=spec["architecture"],
        capabilities=spec["capabilities"],
        allocatable=capacity(
            instances=spec["instances"],
            vcpu_count=spec["vcpu"],
            memory_bytes=spec["memory"],
            disk_bytes=spec["disk"],
            operations=1,
        ),
        guest_protocol_minimum=spec["guest"][0],
        guest_protocol_maximum=spec["guest"][1],
        supported_egress_contexts=spec["egress"],
    )
    if spec["heartbeat_age"] is not None:
        app.record_heartbeat(
            runner_id=runner_id,
            at=clock() - timedelta(seconds=spec["heartbeat_age"]),
            artifact_digests=spec["digests"],
            materializations=[
                MaterializationSnapshot(
                    backend_kind=spec["backend_kind"],
                    architecture=spec["architecture"],
                    runtime_digest=RUNTIME,
                    toolchain_digest=TOOLCHAIN,
                    digest="sha256:m",
                )
            ]
            if spec["materialized"]
            else [],
        )
    if spec["draining"]:
        app.start_drain(runner_id)
    return runner_id


@pytest.mark.parametrize("page", [1, 3, 16])
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    runners=st.lists(RUNNER, min_size=6, max_size=30, unique_by=lambda spec: spec["suffix"]),
    wanted=REQUIREMENTS,
)
def test_create_sandbox_chooses_what_select_runner_chooses(
    app: SchedulerApplication,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    page: int,
    runners: list[dict[str, Any]],
    wanted: dict[str, Any],
) -> None:
    monkeypatch.setattr(candidates, "FIRST_PAGE", page)
    pool = f"p{next(_pools)}"
    for spec in runners:
        _register(app, clock, pool, spec)
    requirements = Requirements(pool_name=pool, architecture="x86_64", **wanted)
    pool_runners = app.runner_snapshots(pool)
    assert len(pool_runners) == len(runners)
    try:
        expected: str | type[PlacementError] = select_runner(
            requirements, pool_runners, clock(), HEARTBEAT_TIMEOUT
        ).id
    except PlacementError as error:
        expected = type(error)
    sandbox_id = f"{pool}-s"
    message = ""
    try:
        chosen: str | type[PlacementError] = app.create_sandbox(
            sandbox_id=sandbox_id,
            workspace_id="w",
            profile_revision_id="profile-1",
            requirements=requirements,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
    except PlacementError as error:
        chosen, message = type(error), str(error)
    assert chosen == expected
    if not isinstance(chosen, str):  # the refusal's evidence accounts for the whole pool
        assert f"0/{len(runners)} runners are available" in message
    event("chosen" if isinstance(chosen, str) else chosen.__name__)
    if isinstance(chosen, str):
        home = explain(app, sandbox_id).decisions[0]
        assert home.summary.split(" ", 1)[0].endswith(f"/{len(runners)}")
        lines = {line.runner_id: line for line in home.candidates}
        assert lines[chosen].verdict == "chosen"
        assert lines[chosen].rank is not None


def test_unlisted_counts_enter_the_summary() -> None:
    unlisted = Unlisted(
        refused=9_000, not_evaluated=990, reasons={"draining": 400, "capacity:vcpu_count": 8_700}
    )
    summary = summarize_refusals((), unlisted)
    assert summary == (
        "0/9990 runners are available (990 not evaluated: ranked below the chosen runner): "
        "8700 insufficient vcpu_count, 400 draining"
    )


def test_bounded_evidence_keeps_an_example_of_every_reason(clock: Clock) -> None:
    runners = [
        RunnerSnapshot(id=f"r{index:03d}", pool_name="p", architecture="x86_64")
        for index in range(100)
    ]
    requirements = Requirements(pool_name="p", architecture="x86_64", guest_protocol_generation=1)
    decision = decide(requirements, runners, clock(), HEARTBEAT_TIMEOUT)
    assert decision.chosen is None
    with pytest.raises(PlacementError) as raised:
        Sandbox.create(
            sandbox_id="s",
            workspace_id="w",
            profile_revision_id="p1",
            requirements=requirements,
            runners=runners,
            now=clock(),
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
    error = raised.value
    assert len(error.evaluations) < len(runners)
    assert len(error.evaluations) + error.unlisted.total == len(runners)
    assert str(error).split(": ", 1)[1].startswith("0/100 runners are available: 100 ")
