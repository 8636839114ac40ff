"""``/v1/sandboxes``: create, schedule, and the commands on one generation (running,
release, fail, advance, reconcile claims and results); the assignments, the
explanation of every decision and the timeline.

Every command is idempotent by the ids it carries, so a client may retry any of them
after a lost answer: a repeated ``schedule`` answers the assignment already made
(``created: false``), a repeated release with the same proof ``released: false``, a
repeated ``running`` the assignment as it is.
"""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from secondbox_scheduler.domain.errors import AssignmentNotFoundError
from secondbox_scheduler.domain.reconcile import ReconcileDecision
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.queries import explain, timeline
from secondbox_scheduler.infrastructure.creating.batch import RecordedHome
from secondbox_scheduler.infrastructure.http.cells import assignment_list
from secondbox_scheduler.infrastructure.http.common import (
    GenerationPath,
    GenerationQuery,
    SandboxId,
    Scheduler,
    Served,
    respond,
    sandbox_application,
)
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES
from secondbox_scheduler.infrastructure.http.models import (
    AssignmentList,
    AssignmentOut,
    Claimed,
    ClaimOwner,
    ClaimReleased,
    ExplanationOut,
    Failure,
    Fence,
    Generation,
    ReconcileClaim,
    ReconcileRecorded,
    ReconcileResult,
    Release,
    Released,
    SandboxCreation,
    SandboxHome,
    ScheduleBody,
    ScheduleResult,
    Timeline,
    TimelineEntryOut,
)

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], responses=ERROR_RESPONSES)
GENERATION = "/{sandbox_id}/generations/{generation}"


def _assignment(app: Served, sandbox_id: str, generation: int | None) -> Response:
    app.sandbox_home(sandbox_id)  # an unknown sandbox is sandbox_not_found
    assignment = app.get_assignment(sandbox_id, generation)
    if assignment is None:
        which = "the current generation" if generation is None else f"generation {generation}"
        raise AssignmentNotFoundError(sandbox_id, f"{which} has no assignment")
    return respond(AssignmentOut.of(assignment))


@router.post(
    "",
    status_code=201,
    response_model=SandboxHome,
    summary="Create a sandbox",
    responses={200: {"model": SandboxHome, "description": "It existed with these fields."}},
)
async def create_sandbox(body: SandboxCreation, app: Scheduler) -> Response:
    """Choose and record the sandbox's home runner. The same request again answers the
    recorded home (200); other fields for an existing id are 409 ``already_exists``; no
    compatible runner is 409 ``no_compatible_runner`` or ``egress_context_unavailable``."""
    if isinstance(app, SchedulerApplication):  # met in the batcher without a thread each
        home = await app.create_sandbox_async(
            sandbox_id=body.sandbox_id,
            workspace_id=body.workspace_id,
            profile_revision_id=body.profile_revision_id,
            requirements=body.requirements,
            heartbeat_timeout=timedelta(seconds=body.heartbeat_timeout_seconds),
        )
    else:  # a cell router's call: on the thread pool
        home = await run_in_threadpool(
            app.create_sandbox,
            sandbox_id=body.sandbox_id,
            workspace_id=body.workspace_id,
            profile_revision_id=body.profile_revision_id,
            requirements=body.requirements,
            heartbeat_timeout=timedelta(seconds=body.heartbeat_timeout_seconds),
        )
    found = isinstance(home, RecordedHome)  # the creation found it recorded: created nothing
    return respond(
        SandboxHome(sandbox_id=body.sandbox_id, home_runner_id=home), 200 if found else 201
    )


@router.get("/{sandbox_id}", response_model=SandboxHome, summary="A sandbox's home runner")
def get_sandbox(sandbox_id: SandboxId, app: Scheduler) -> Response:
    return respond(SandboxHome(sandbox_id=sandbox_id, home_runner_id=app.sandbox_home(sandbox_id)))


@router.post(
    "/{sandbox_id}/schedule",
    status_code=201,
    response_model=ScheduleResult,
    summary="Schedule the current generation",
    responses={200: {"model": ScheduleResult, "description": "Already assigned (a replay)."}},
)
async def schedule(sandbox_id: SandboxId, body: ScheduleBody, app: Scheduler) -> Response:
    """Serialize the sandbox's current generation and reserve capacity on its home
    runner (docs/spec.md (section 6)): 201 with the new assignment, or 200 with the existing one
    (``created: false``). Refused placements are 409 with the reasons; a request that
    lost every race of its ``serialization_retry_limit`` is 503."""
    request = body.to_request(sandbox_id)
    if isinstance(app, SchedulerApplication) and app.batcher is not None:
        # concurrent requests meet in the batcher without a thread each
        assignment, created = await app.schedule_async(request)
    else:  # one transaction per request (or a cell router's): on the thread pool
        assignment, created = await run_in_threadpool(app.schedule, request)
    return respond(
        ScheduleResult(assignment=AssignmentOut.of(assignment), created=created),
        201 if created else 200,
    )


def schedule_route() -> APIRoute:
    """The FastAPI route of :func:`schedule` (for :mod:`.schedule_route`)."""
    (route,) = [r for r in router.routes if isinstance(r, APIRoute) and r.endpoint is schedule]
    return route


@router.get("/{sandbox_id}/assignment", response_model=AssignmentOut, summary="One assignment")
def get_assignment(
    sandbox_id: SandboxId, app: Scheduler, generation: GenerationQuery = None
) -> Response:
    """The current generation's assignment, or the given generation's."""
    return _assignment(app, sandbox_id, generation)


@router.get("/{sandbox_id}/assignments", response_model=AssignmentList, summary="Every assignment")
def list_assignments(sandbox_id: SandboxId, app: Scheduler) -> Response:
    """Every generation's assignment, oldest first."""
    return assignment_list(app, app.assignments(sandbox_id), sandbox_id=sandbox_id)


@router.post(f"{GENERATION}/running", response_model=AssignmentOut, summary="Report running")
def mark_running(
    sandbox_id: SandboxId, generation: GenerationPath, body: Fence, app: Scheduler
) -> Response:
    """The runner reports the compute running (also ends ``uncertain``); a wrong
    generation or token is 409 ``stale_fence`` and writes nothing."""
    app.mark_running(sandbox_id, generation, body.token())
    return _assignment(app, sandbox_id, generation)


@router.post(f"{GENERATION}/release", response_model=Released, summary="Release with proof")
def release(
    sandbox_id: SandboxId, generation: GenerationPath, body: Release, app: Scheduler
) -> Response:
    """Free the reserved capacity, once: a repeat with the same proof is
    ``released: false``; another proof is 409 ``release_proof_mismatch``."""
    released = app.release(sandbox_id, generation, body.token(), body.release_proof)
    return respond(Released(released=released))


@router.post(f"{GENERATION}/fail", response_model=AssignmentOut, summary="Report a failure")
def fail(
    sandbox_id: SandboxId, generation: GenerationPath, body: Failure, app: Scheduler
) -> Response:
    """A transient class retries within the assignment's retry_limit, else terminal."""
    assignment = app.fail(sandbox_id, generation, body.token(), body.failure_class)
    return respond(AssignmentOut.of(assignment))


@router.post(f"{GENERATION}/advance", response_model=Generation, summary="Next generation")
def advance_generation(
    sandbox_id: SandboxId, generation: GenerationPath, app: Scheduler
) -> Response:
    """Only after release; the next schedule targets the new generation. Advancing a
    generation that already moved on is 409 ``stale_fence``."""
    new = app.advance_generation(sandbox_id, generation)
    return respond(Generation(sandbox_id=sandbox_id, generation=new))


@router.post(
    f"{GENERATION}/reconcile-claim", response_model=Claimed, summary="Claim reconciliation"
)
def claim_reconcile(
    sandbox_id: SandboxId, generation: GenerationPath, body: ReconcileClaim, app: Scheduler
) -> Response:
    """``claimed: false`` while another owner holds an unexpired claim."""
    claimed = app.claim_reconcile(sandbox_id, generation, body.owner, body.until)
    return respond(Claimed(claimed=claimed))


@router.post(
    f"{GENERATION}/reconcile-claim/release",
    response_model=ClaimReleased,
    summary="Release a reconcile claim",
)
def release_reconcile_claim(
    sandbox_id: SandboxId, generation: GenerationPath, body: ClaimOwner, app: Scheduler
) -> Response:
    """``released: false`` when the owner holds no claim."""
    released = app.release_reconcile_claim(sandbox_id, generation, body.owner)
    return respond(ClaimReleased(released=released))


@router.post(
    f"{GENERATION}/reconcile", response_model=ReconcileRecorded, summary="Record a reconcile"
)
def record_reconcile(
    sandbox_id: SandboxId, generation: GenerationPath, body: ReconcileResult, app: Scheduler
) -> Response:
    """Commit a reconcile decision (``none``, ``deadline_exceeded``, ``uncertain``) while
    the owner's claim is current, else 409 ``reconcile_claim_not_held``."""
    decision = ReconcileDecision(body.action, body.reason, body.next_reconcile_at)
    app.record_reconcile(sandbox_id, generation, body.owner, decision)
    return respond(ReconcileRecorded())


@router.get("/{sandbox_id}/explain", response_model=ExplanationOut, summary="Explain decisions")
def explain_sandbox(
    sandbox_id: SandboxId, app: Scheduler, generation: GenerationQuery = None
) -> Response:
    """Why this home runner, why each generation's runner, why each refusal, from the
    evidence recorded with each decision (``audit explain``)."""
    explanation = explain(sandbox_application(app, sandbox_id), sandbox_id, generation)
    return respond(ExplanationOut.model_validate(explanation.to_dict()))


@router.get("/{sandbox_id}/timeline", response_model=Timeline, summary="Sandbox's history")
def sandbox_timeline(sandbox_id: SandboxId, app: Scheduler) -> Response:
    """The sandbox's events and its refusals, in time order (``audit timeline``)."""
    entries = timeline(sandbox_application(app, sandbox_id), sandbox_id=sandbox_id)
    return respond(
        Timeline(entries=[TimelineEntryOut.model_validate(e.to_dict()) for e in entries])
    )
