"""secondbox_scheduler.testing: property-test a control plane against the scheduler.

What our own tests use, shipped for an application that embeds the scheduler (needs
Hypothesis: ``pip install 'secondbox-scheduler[testing]'``):

- strategies (:mod:`.strategies`): :func:`runner_snapshots`, :func:`fleets`,
  :func:`requirements`, :func:`capacities`, and :func:`histories` of commands with
  :func:`run_history` to apply one to a ``SchedulerApplication``;
- the reference model (:mod:`.model`): :class:`ReferenceModel`, the specification's answers
  kept deliberately simple;
- the rule-based state machine (:mod:`.state_machine`): :class:`SchedulerMachine`
  drives a real application and the model side by side; :func:`scheduler_machine`
  puts it on a store of your choice (:func:`sqlite_store` by default);
- builders of valid inputs and a hand-moved clock (:mod:`.builders`).

Not a layer of the scheduler: nothing in ``domain``, ``projections`` or
``infrastructure`` imports it.
"""

from secondbox_scheduler.testing.builders import Clock
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
    capacities,
    fleets,
    histories,
    requirements,
    run_history,
    runner_snapshots,
)

__all__ = [
    "TRANSITIONS",
    "Clock",
    "ModelAssignment",
    "ModelRunner",
    "ModelSandbox",
    "ReferenceModel",
    "SchedulerMachine",
    "capacities",
    "fleets",
    "histories",
    "requirements",
    "run_history",
    "runner_snapshots",
    "scheduler_machine",
    "sqlite_store",
]
