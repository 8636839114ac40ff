"""Domain of the SecondBox scheduler: values, placement policy, aggregates, errors.

Pure: no I/O, no clock reads, no database imports. Times come in as arguments.
"""

from secondbox_scheduler.domain.errors import (
    EgressContextUnavailableError,
    HomeRunnerUnavailableError,
    InvalidRequestError,
    NoCompatibleRunnerError,
    ProfileRevisionMismatchError,
    SchedulerError,
    SerializationContentionError,
    StaleFenceError,
)
from secondbox_scheduler.domain.placement.rules import select_home_runner, select_runner
from secondbox_scheduler.domain.values import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
)

__all__ = [
    "DRAIN_PHASE_ACTIVE",
    "DRAIN_PHASE_DRAINING",
    "Capacity",
    "DurableAssignment",
    "EgressContextUnavailableError",
    "HomeRunnerUnavailableError",
    "InvalidRequestError",
    "MaterializationSnapshot",
    "NoCompatibleRunnerError",
    "ProfileRevisionMismatchError",
    "Requirements",
    "RunnerSnapshot",
    "ScheduleRequest",
    "SchedulerError",
    "SerializationContentionError",
    "StaleFenceError",
    "select_home_runner",
    "select_runner",
]

# Histories of earlier releases name classes by their former module paths.
from secondbox_scheduler.domain import event_topics as _event_topics  # noqa: F401
