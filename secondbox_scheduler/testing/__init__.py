"""secondbox_scheduler.testing: property-test a control plane against the scheduler.

What our own tests use, shipped for an application that embeds the scheduler (needs
Hypothesis: ``pip install 'secondbox-scheduler[testing]'``):

- strategies (:mod:`.strategies`): :func:`placement_cases` (a :class:`PlacementCase`:
  requirements and runners built from them to pass every placement rule or to fail
  chosen rules by a near miss; placeable in about 79 of 100 default draws), with its
  parts :func:`case_requirements`, :func:`compatible_runners` and
  :func:`fail_rule_sets`; :func:`runner_snapshots`, :func:`fleets`,
  :func:`requirements`, :func:`capacities` (random: placeable together in only a few
  of 100 draws), and :func:`histories` of commands with :func:`run_history` to apply
  one to a ``SchedulerApplication``;
- the reference model (:mod:`.model`): :class:`ReferenceModel`, the specification's answers
  kept deliberately simple;
- the rule-based state machine (:mod:`.state_machine`): :class:`SchedulerMachine`
  drives a real application and the model side by side; :func:`scheduler_machine`
  puts it on a store of your choice (:func:`sqlite_store` by default);
- builders of valid inputs and a hand-moved clock (:mod:`.builders`), among them
  :func:`compatible_runner` and :func:`near_miss_runner` (a runner that fails exactly
  the rules named, :data:`PLACEMENT_RULES`, each by one of :data:`NEAR_MISSES`).

Not a layer of the scheduler: nothing in ``domain``, ``projections`` or
``infrastructure`` imports it.
"""

from secondbox_scheduler.testing.builders import (
    NEAR_MISSES,
    PLACEMENT_RULES,
    Clock,
    compatible_runner,
    near_miss_runner,
)
from secondbox_scheduler.testing.model import (
    ModelAssignment,
    ModelRunner,
    ModelSandbox,
    ReferenceModel,
)
from secondbox_scheduler.testing.state_machine import (
    TRANSITIONS,
    SchedulerMachine,
    scheduler_machine,
    sqlite_store,
)
from secondbox_scheduler.testing.strategies import (
    PlacementCase,
    capacities,
    case_requirements,
    compatible_runners,
    fail_rule_sets,
    fleets,
    histories,
    placement_cases,
    requirements,
    run_history,
    runner_snapshots,
)

__all__ = [
    "NEAR_MISSES",
    "PLACEMENT_RULES",
    "TRANSITIONS",
    "Clock",
    "ModelAssignment",
    "ModelRunner",
    "ModelSandbox",
    "PlacementCase",
    "ReferenceModel",
    "SchedulerMachine",
    "capacities",
    "case_requirements",
    "compatible_runner",
    "compatible_runners",
    "fail_rule_sets",
    "fleets",
    "histories",
    "near_miss_runner",
    "placement_cases",
    "requirements",
    "run_history",
    "runner_snapshots",
    "scheduler_machine",
    "sqlite_store",
]
