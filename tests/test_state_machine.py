"""The Hypothesis state machine of ``secondbox_scheduler.testing`` on SQLite and PostgreSQL.

The machine and its reference model ship with the package (one copy, also for
embedders); see :mod:`secondbox_scheduler.testing.state_machine` for what it checks.
Under the ``ci`` Hypothesis profile (tests/conftest.py) the run is derandomized: the
same examples every run, enough of them to reach every transition the rules can take,
which the test asserts and prints. The ``deep`` profile runs many more, at random.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from secondbox_scheduler.testing import TRANSITIONS, scheduler_machine, sqlite_store
from tests.conftest import HYPOTHESIS_PROFILE
from tests.test_projections import fresh_store

# (examples on SQLite, examples on PostgreSQL, steps per example), by profile
SIZES = {"ci": (50, 10, 50), "deep": (1000, 150, 80)}


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_state_machine(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "postgres":
        server = request.getfixturevalue("postgres_server")
        machine = scheduler_machine(lambda: fresh_store("postgres", server), "_postgres")
    else:
        machine = scheduler_machine(sqlite_store, "_sqlite")
    on_sqlite, on_postgres, steps = SIZES[HYPOTHESIS_PROFILE]
    machine.TestCase.settings = settings(
        max_examples=on_sqlite if kind == "sqlite" else on_postgres,
        stateful_step_count=steps,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
    reached = machine.transitions
    print(f"\ntransitions reached on {kind} ({HYPOTHESIS_PROFILE} profile):")
    for transition in sorted(TRANSITIONS):
        print(f"  {reached[transition]:6d}  {transition}")
    if kind == "sqlite" or HYPOTHESIS_PROFILE == "deep":  # PostgreSQL: fewer examples
        assert set(reached) == TRANSITIONS, sorted(TRANSITIONS - set(reached))


def test_the_ci_profile_is_derandomized() -> None:
    current = settings.default
    assert current is not None
    if HYPOTHESIS_PROFILE == "ci":
        assert current.derandomize
    assert current.deadline is None


def test_state_machine_with_every_dimension_tight() -> None:
    """The same machine with runners that offer as few units of every dimension as of
    instances, on SQLite: the sandboxes that ask two vCPUs, memory, disk or operations
    run out of that dimension first, and the model (which tracks every dimension) must
    still predict every answer and every reservation. Fewer examples, no transition
    census (the default run above is the one tuned to reach them all)."""
    machine = scheduler_machine(sqlite_store, "_tight", every_dimension_tight=True)
    machine.TestCase.settings = settings(
        max_examples=SIZES[HYPOTHESIS_PROFILE][1] * 2,
        stateful_step_count=SIZES[HYPOTHESIS_PROFILE][2],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
    reached = machine.transitions
    print(f"\ntransitions reached with every dimension tight: {dict(sorted(reached.items()))}")
    assert reached["schedule: created"] > 0
    assert reached["schedule: home unavailable"] > 0
