"""secondbox_scheduler: the SecondBox scheduler as an event-sourced domain service.

The one import name of the package (docs/spec.md (section 2)). Every public name imports from
here; the layers are its subpackages:

- ``secondbox_scheduler.domain``: values, placement policy, aggregates, events (pure);
- ``secondbox_scheduler.projections``: read models rebuilt from the events;
- ``secondbox_scheduler.infrastructure``: the application service and persistence, the
  command line and the tools (simulation, bench, fault-injection run).

In a checkout the layer folders sit at the repository's top level (``domain/``,
``projections/``, ``infrastructure/``); the wheel installs them inside this package.
"""

from secondbox_scheduler.domain import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    DurableAssignment,
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    MaterializationSnapshot,
    NoCompatibleRunnerError,
    ProfileRevisionMismatchError,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
    SchedulerError,
    SerializationContentionError,
    StaleFenceError,
    select_home_runner,
    select_runner,
)
from secondbox_scheduler.domain.actors import Actor
from secondbox_scheduler.infrastructure import (
    PostgresStore,
    PostgresStoreConfig,
    SchedulerApplication,
    StoreUnavailableError,
)
from secondbox_scheduler.infrastructure.acting import acting_as

__version__ = "0.2.0"

__all__ = [
    "DRAIN_PHASE_ACTIVE",
    "DRAIN_PHASE_DRAINING",
    "Actor",
    "Capacity",
    "DurableAssignment",
    "EgressContextUnavailableError",
    "HomeRunnerUnavailableError",
    "InvalidRequestError",
    "MaterializationSnapshot",
    "NoCompatibleRunnerError",
    "PostgresStore",
    "PostgresStoreConfig",
    "ProfileRevisionMismatchError",
    "Requirements",
    "RunnerSnapshot",
    "ScheduleRequest",
    "SchedulerApplication",
    "SchedulerError",
    "SerializationContentionError",
    "StaleFenceError",
    "StoreUnavailableError",
    "__version__",
    "acting_as",
    "select_home_runner",
    "select_runner",
]
