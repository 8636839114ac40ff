"""``/v1/runners``: register, heartbeat, drain and cancel, allocatable, deregister; the
runner snapshots, one runner, its assignments and its timeline.

Commands answer with the runner as its aggregates now hold it (not the read model,
which another process may keep behind); queries read the read models.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from secondbox_scheduler.domain.values import Capacity, RunnerSnapshot
from secondbox_scheduler.infrastructure.audit.queries import timeline
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.http.cells import cell_of_runner, runner_list_over_cells
from secondbox_scheduler.infrastructure.http.common import (
    PoolQuery,
    RunnerId,
    Scheduler,
    respond,
    runner_application,
)
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES
from secondbox_scheduler.infrastructure.http.models import (
    AssignmentList,
    AssignmentOut,
    Deregistered,
    Heartbeat,
    HeartbeatOutcome,
    RegisteredRunner,
    RunnerChanged,
    RunnerList,
    RunnerRegistration,
    Timeline,
    TimelineEntryOut,
)

router = APIRouter(prefix="/v1/runners", tags=["runners"], responses=ERROR_RESPONSES)


@router.post(
    "",
    status_code=201,
    response_model=RegisteredRunner,
    summary="Register a runner",
    responses={200: {"model": RegisteredRunner, "description": "Already registered so."}},
)
def register_runner(body: RunnerRegistration, app: Scheduler) -> Response:
    """Register a runner host. A repeat of the same registration answers 200 with
    ``created: false``; another registration of a taken id is 409 ``already_exists``."""
    created = app.register_runner(
        runner_id=body.runner_id,
        pool_name=body.pool_name,
        backend_kind=body.backend_kind,
        architecture=body.architecture,
        capabilities=body.capabilities,
        allocatable=body.allocatable,
        guest_protocol_minimum=body.guest_protocol_minimum,
        guest_protocol_maximum=body.guest_protocol_maximum,
        supported_egress_contexts=body.supported_egress_contexts,
    )
    runner = app.fold_runner(body.runner_id)
    return respond(RegisteredRunner(runner=runner, created=created), 201 if created else 200)


@router.get("", response_model=RunnerList, summary="Runner snapshots")
def list_runners(app: Scheduler, pool_name: PoolQuery = None) -> Response:
    """Every registered runner (of one pool), sorted by id, from the read model. Over
    cells: every cell's, each naming its ``cell``, and the cells that did not answer."""
    if isinstance(app, CellRouter):
        return runner_list_over_cells(app, pool_name)
    return respond(RunnerList(runners=app.runner_snapshots(pool_name)))


@router.get("/{runner_id}", response_model=RunnerSnapshot, summary="One runner")
def get_runner(runner_id: RunnerId, app: Scheduler) -> Response:
    return respond(app.get_runner(runner_id))


@router.delete("/{runner_id}", response_model=Deregistered, summary="Deregister a runner")
def deregister_runner(runner_id: RunnerId, app: Scheduler) -> Response:
    """Refused (409 ``conflict``) while anything is reserved on the runner; a repeat is
    404 ``runner_not_found`` (the runner is gone)."""
    app.deregister_runner(runner_id)
    return respond(Deregistered(runner_id=runner_id))


@router.post(
    "/{runner_id}/heartbeat", response_model=HeartbeatOutcome, summary="Record a heartbeat"
)
def record_heartbeat(runner_id: RunnerId, body: Heartbeat, app: Scheduler) -> Response:
    """Liveness and evidence. Evidence changes are always recorded, a plain renewal at
    most once per renewal interval; an older heartbeat changes nothing."""
    outcome = app.record_heartbeat(
        runner_id=runner_id,
        at=body.at,
        artifact_digests=body.artifact_digests,
        materializations=body.materializations,
    )
    return respond(HeartbeatOutcome(runner_id=runner_id, outcome=outcome))


@router.post("/{runner_id}/drain", response_model=RunnerChanged, summary="Start draining")
def start_drain(runner_id: RunnerId, app: Scheduler) -> Response:
    """No new reservation lands on a draining runner."""
    app.start_drain(runner_id)
    return respond(RunnerChanged(runner=app.fold_runner(runner_id)))


@router.post("/{runner_id}/cancel-drain", response_model=RunnerChanged, summary="Cancel a drain")
def cancel_drain(runner_id: RunnerId, app: Scheduler) -> Response:
    app.cancel_drain(runner_id)
    return respond(RunnerChanged(runner=app.fold_runner(runner_id)))


@router.put("/{runner_id}/allocatable", response_model=RunnerChanged, summary="Change allocatable")
def change_allocatable(runner_id: RunnerId, body: Capacity, app: Scheduler) -> Response:
    """Refused (409 ``capacity_exceeded``) below what is reserved."""
    app.change_allocatable(runner_id, body)
    return respond(RunnerChanged(runner=app.fold_runner(runner_id)))


@router.get(
    "/{runner_id}/assignments", response_model=AssignmentList, summary="Runner's assignments"
)
def runner_assignments(runner_id: RunnerId, app: Scheduler) -> Response:
    """The assignments that hold a reservation on the runner."""
    found = app.runner_assignments(runner_id)
    return respond(
        AssignmentList(assignments=[AssignmentOut.of(a) for a in found]),
        headers=cell_of_runner(app, runner_id),
    )


@router.get("/{runner_id}/timeline", response_model=Timeline, summary="Runner's history")
def runner_timeline(runner_id: RunnerId, app: Scheduler) -> Response:
    """The runner's events and its lease's, in time order (``audit timeline``)."""
    entries = timeline(runner_application(app, runner_id), runner_id=runner_id)
    return respond(
        Timeline(entries=[TimelineEntryOut.model_validate(e.to_dict()) for e in entries])
    )
