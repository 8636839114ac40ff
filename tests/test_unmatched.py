"""A create_sandbox that no runner of the pool can match is refused without reading the
pool (projections/unmatched.py), with the evidence a full scan records.

Without the shortcut, a refusal read, parsed and evaluated every runner that passed the
SQL prefilter (14 to 18 s at 50,000 runners for a toolchain digest none has). These
tests compare its refusal with the full scan's (the shortcut switched off) on random
pools, on SQLite and PostgreSQL, and count the runners it reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import secondbox_scheduler.infrastructure.queries as queries
import secondbox_scheduler.projections.candidates as candidates
import secondbox_scheduler.projections.unmatched as unmatched
from secondbox_scheduler.domain import Requirements
from secondbox_scheduler.domain.errors import PlacementError
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock
from tests.factories import HEARTBEAT_TIMEOUT, RUNTIME, TOOLCHAIN, capacity
from tests.test_selection import REQUIREMENTS, RUNNER, _register

_pools = itertools.count()
NOBODY = "sha256:toolchain-nobody-has"


def _refusal(app: SchedulerApplication, sandbox_id: str, requirements: Requirements) -> Any:
    """What create_sandbox answers: the error's class, message, evaluations and counts
    (or the chosen runner's id)."""
    try:
        return app.create_sandbox(
            sandbox_id=sandbox_id,
            workspace_id="w",
            profile_revision_id="profile-1",
            requirements=requirements,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
    except PlacementError as error:
        return type(error), str(error), error.evaluations, error.unlisted


def _full_scan(app: SchedulerApplication, sandbox_id: str, requirements: Requirements) -> Any:
    """The answer with the shortcut switched off: the candidates paged as before."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(queries, "unmatched_candidates", lambda *args: None)
        return _refusal(app, sandbox_id, requirements)


UNMATCHED = st.sampled_from(
    [
        {"preferred_artifact_digests": (RUNTIME, NOBODY)},
        {"required_capabilities": frozenset({"gpu"})},
        {"egress_context": "nowhere"},
        {},
    ]
)


def _alike(spec: dict[str, Any], count: int, instances: list[int]) -> list[dict[str, Any]]:
    """``count`` copies of ``spec`` but for their ids and free instances."""
    return [
        {**spec, "suffix": f"c{index:02d}", "instances": instances[index % len(instances)]}
        for index in range(count)
    ]


# Pools where one kind of runner has more than EVIDENCE_PER_REASON members, so that the
# evidence is bounded, beside a few random ones.
POOLS = st.builds(
    lambda spec, count, instances, others: _alike(spec, count, instances) + others,
    RUNNER,
    st.integers(0, 20),
    st.lists(st.integers(0, 4), min_size=1, max_size=4),
    st.lists(RUNNER, min_size=1, max_size=12, unique_by=lambda spec: spec["suffix"]),
)


@pytest.mark.parametrize("prefix", [1, 16])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    runners=POOLS,
    wanted=REQUIREMENTS,
    change=UNMATCHED,
)
def test_the_refusal_is_the_full_scans(
    app: SchedulerApplication,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    prefix: int,
    runners: list[dict[str, Any]],
    wanted: dict[str, Any],
    change: dict[str, Any],
) -> None:
    monkeypatch.setattr(unmatched, "PREFIX", prefix)  # 1: the first runners searched apart
    pool = f"u{next(_pools)}"
    for spec in runners:
        _register(app, clock, pool, spec)
    requirements = Requirements(pool_name=pool, architecture="x86_64", **{**wanted, **change})
    taken: list[bool] = []
    original = unmatched.refusal_candidates

    def watched(*args: Any) -> Any:
        found = original(*args)
        taken.append(found is not None)
        return found

    surveys: list[bool] = []  # per survey: all passing runners alike (one statement)
    alike = unmatched._alike

    def watched_alike(*args: Any) -> Any:
        found = alike(*args)
        surveys.append(found is not None)
        return found

    monkeypatch.setattr(unmatched, "refusal_candidates", watched)
    monkeypatch.setattr(unmatched, "_alike", watched_alike)
    answer = _refusal(app, f"{pool}-a", requirements)
    assert answer == _full_scan(app, f"{pool}-b", requirements)
    event("shortcut" if any(taken) else "paged" if isinstance(answer, str) else "refused, paged")
    if surveys:
        event("passing runners alike" if surveys[0] else "passing runners grouped")


def _pool(app: SchedulerApplication, clock: Clock, pool: str, size: int) -> None:
    """``size`` runners alike but for their free instances, a few draining, one stale."""
    for index in range(size):
        _register(
            app,
            clock,
            pool,
            {
                "suffix": f"{index:03d}",
                "architecture": "x86_64",
                "backend_kind": "firecracker",
                "capabilities": [
                    "compute",
                    "network-policy",
                    "storage",
                    "cleanup",
                    "local-workspace",
                ],
                "instances": 1 + index % 4,
                "vcpu": 4,
                "memory": 4,
                "disk": 4,
                "guest": (1, 3),
                "egress": ("default",),
                "heartbeat_age": 90.0 if index == 7 else 0.0,
                "digests": [RUNTIME],
                "materialized": True,
                "draining": index % 10 == 3,
            },
        )


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """Count the rows ``module`` parses into snapshots."""
    parsed = [0]
    original: Callable[..., Any] = module.row_to_snapshot

    def counted(row: dict[str, Any]) -> Any:
        parsed[0] += 1
        return original(row)

    monkeypatch.setattr(module, "row_to_snapshot", counted)
    return parsed


def test_a_digest_nobody_has_reads_a_few_runners_not_the_pool(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 60
    _pool(app, clock, "big", size)
    requirements = Requirements(
        pool_name="big",
        architecture="x86_64",
        capacity=capacity(instances=1, vcpu_count=1, memory_bytes=1, disk_bytes=1, operations=0),
        guest_protocol_generation=2,
        preferred_artifact_digests=(RUNTIME, NOBODY),
    )
    expected = _full_scan(app, "full", requirements)
    paged = _counting(monkeypatch, candidates)
    read = _counting(monkeypatch, unmatched)
    answer = _refusal(app, "short", requirements)
    assert answer == expected
    _, message, evaluations, unlisted = answer
    assert message.endswith(
        f"0/{size} runners are available: 53 without the materialization, 6 draining, "
        "1 heartbeat stale"
    )
    assert len(evaluations) == 8  # the first 8 in candidate order, as the full scan keeps
    assert unlisted.refused == size - 8
    assert paged[0] == 0  # the pages of home_candidates: never read
    assert read[0] <= unmatched.PREFIX + 1  # the survey's prefix and one runner per group
    # and a digest some runner has still pages as before, to a home
    requirements = requirements.model_copy(
        update={"preferred_artifact_digests": (RUNTIME, TOOLCHAIN)}
    )
    read[0] = 0
    assert isinstance(_refusal(app, "home", requirements), str)
    assert read[0] == 0
    assert paged[0] > 0


def test_copied_rows_count_in_the_refusal_and_are_not_read(
    app: SchedulerApplication, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmark's large pool: rows copied from a registered runner's (no stream of
    their own) are counted by the refusal, and the shortcut reads only a few of them."""
    _pool(app, clock, "copied", 2)
    read_models = app.queries.current_read_models()
    assert read_models is not None
    read_models.runners.copy_row("copied-000", "copied-copy-", 300, instances=1)
    requirements = Requirements(
        pool_name="copied",
        architecture="x86_64",
        guest_protocol_generation=2,
        preferred_artifact_digests=(RUNTIME, NOBODY),
    )
    read = _counting(monkeypatch, unmatched)
    paged = _counting(monkeypatch, candidates)
    _, message, evaluations, _ = _refusal(app, "s", requirements)
    assert message.endswith("0/302 runners are available: 302 without the materialization")
    assert [e.runner_id for e in evaluations][:2] == ["copied-001", "copied-000"]  # most free
    assert read[0] <= unmatched.PREFIX + 1
    assert paged[0] == 0
