"""Registering a runner: the checked registration, the new aggregate, and whether a
registered runner is what a repeated registration asks for.

``register_runner`` is idempotent by the runner id (docs/spec.md (section 5)): the
identical registration of a registered runner is a no-op that writes nothing, in the
library as over HTTP; another registration of a taken id (a deregistered runner's id
included: it stays taken) is :class:`~secondbox_scheduler.domain.errors.AlreadyExistsError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime

from secondbox_scheduler.domain.command_inputs import as_collection
from secondbox_scheduler.domain.errors import RunnerNotFoundError
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot, require_text


def checked_registration(
    runner_id: str,
    pool_name: str,
    backend_kind: str,
    architecture: str,
    capabilities: Iterable[str] | Mapping[str, bool],
    allocatable: Capacity | Mapping[str, int],
    guest_protocol_minimum: int,
    guest_protocol_maximum: int,
    supported_egress_contexts: Iterable[str],
) -> RunnerSnapshot:
    """The registration as a snapshot, every field checked (``InvalidRequestError``
    naming the field)."""
    require_text("runner_id", runner_id)
    require_text("pool_name", pool_name)
    require_text("architecture", architecture)
    return RunnerSnapshot(
        id=runner_id,
        pool_name=pool_name,
        backend_kind=backend_kind,
        architecture=architecture,
        capabilities=as_collection("capabilities", capabilities),
        allocatable=allocatable,
        guest_protocol_minimum=guest_protocol_minimum,
        guest_protocol_maximum=guest_protocol_maximum,
        supported_egress_contexts=as_collection(
            "supported_egress_contexts", supported_egress_contexts
        ),
    )


def registered_runner(checked: RunnerSnapshot, at: datetime) -> Runner:
    """The new runner aggregate of a checked registration."""
    return Runner.register(
        runner_id=checked.id,
        pool_name=checked.pool_name,
        backend_kind=checked.backend_kind,
        architecture=checked.architecture,
        capabilities=checked.capabilities,
        allocatable=checked.allocatable,
        guest_protocol_minimum=checked.guest_protocol_minimum,
        guest_protocol_maximum=checked.guest_protocol_maximum,
        supported_egress_contexts=checked.supported_egress_contexts,
        at=at,
    )


def same_registration(runner: RunnerSnapshot, wanted: RunnerSnapshot) -> bool:
    """Whether the registered ``runner`` is what the registration ``wanted`` registers."""
    return (
        runner.pool_name == wanted.pool_name
        and runner.backend_kind == wanted.backend_kind
        and runner.architecture == wanted.architecture
        and set(runner.capabilities) == set(wanted.capabilities)
        and runner.allocatable == wanted.allocatable
        and runner.guest_protocol_minimum == wanted.guest_protocol_minimum
        and runner.guest_protocol_maximum == wanted.guest_protocol_maximum
        and set(runner.supported_egress_contexts) == set(wanted.supported_egress_contexts)
    )


def registered_so(fold: Callable[[str], RunnerSnapshot], wanted: RunnerSnapshot) -> bool:
    """Whether the runner ``wanted`` names is registered, not deregistered, exactly so
    (``fold``: the runner as its aggregates now hold it)."""
    try:
        return same_registration(fold(wanted.id), wanted)
    except RunnerNotFoundError:  # deregistered: the id stays taken
        return False
