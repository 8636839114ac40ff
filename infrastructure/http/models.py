"""Request and response bodies of the HTTP API, where the domain's own types do not fit.

The domain's pydantic types are used as they are wherever JSON carries them unchanged:
:class:`Capacity`, :class:`Requirements`, :class:`MaterializationSnapshot`,
:class:`RunnerSnapshot`; their field types (ids and names, bounded collections, aware
UTC times) build the bodies below. What differs from the Python API, and why:

- bytes travel as lowercase hex (``fencing_token``): :class:`AssignmentOut` is
  :class:`DurableAssignment` with a hex token, and request bodies take ``HexToken``;
- durations are seconds (``heartbeat_timeout_seconds``, a JSON number), as a Go
  client writes ``d.Seconds()``; the Python API takes a ``timedelta``;
- the sandbox or runner named in the path is not repeated in the body;
- ``serialization_retry_limit`` defaults to 8 here (0 in the Python API), so that a
  request that loses a race to another replica is retried before the answer is a 503;
- runner and sandbox ids created over HTTP must be addressable in a URL path: no ``/``,
  and not ``.`` or ``..`` (which clients remove from paths).

Every body refuses unknown fields (``extra="forbid"``): a misspelt field is a 422, not
a silently ignored value.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBytes,
    StrictInt,
    StrictStr,
    WithJsonSchema,
)

from secondbox_scheduler.domain.assignment import FAILURE_CLASSES
from secondbox_scheduler.domain.lease import (
    OBSERVED_COALESCED,
    OBSERVED_EVIDENCE,
    OBSERVED_RENEWED,
    OBSERVED_STALE,
)
from secondbox_scheduler.domain.limits import (
    EARLIEST_TIME,
    LATEST_TIME,
    MAX_FENCING_TOKEN_BYTES,
    MAX_HEARTBEAT_TIMEOUT,
    MAX_ITEMS,
    MAX_NAME_LENGTH,
    MAX_PROOF_ENTRIES,
    MAX_RETRY_LIMIT,
    MAX_SERIALIZATION_RETRY_LIMIT,
    MIN_FENCING_TOKEN_BYTES,
)
from secondbox_scheduler.domain.reconcile import ACTIONS
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
    Name,
    Names,
    NameSet,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
    Text,
    TextMap,
    UTCDatetime,
)

DEFAULT_SERIALIZATION_RETRY_LIMIT = 8
HEX_PATTERN = r"^([0-9a-fA-F]{2})*$"
PATH_ID_PATTERN = r"^[^/]+$"


def _addressable(value: str) -> str:
    if value in (".", ".."):
        raise ValueError("must not be '.' or '..' (it could not be addressed in a URL path)")
    return value


# An id that names a resource in URL paths (runner, sandbox).
PathName = Annotated[
    Name,
    Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=PATH_ID_PATTERN,
        json_schema_extra={"pattern": PATH_ID_PATTERN},
    ),
    AfterValidator(_addressable),
]
HexToken = Annotated[
    StrictStr,
    Field(
        min_length=2 * MIN_FENCING_TOKEN_BYTES,
        max_length=2 * MAX_FENCING_TOKEN_BYTES,
        pattern=HEX_PATTERN,
        description=(
            f"The fencing token as hex ({MIN_FENCING_TOKEN_BYTES} to "
            f"{MAX_FENCING_TOKEN_BYTES} bytes)."
        ),
    ),
]


def _sane_time(value: datetime) -> datetime:
    if not EARLIEST_TIME <= value < LATEST_TIME:
        raise ValueError(
            f"must be from {EARLIEST_TIME.isoformat()} to before {LATEST_TIME.isoformat()}"
        )
    return value


# Every time of a request body: aware, UTC, and within a sane range (docs/spec.md, 9).
Time = Annotated[UTCDatetime, AfterValidator(_sane_time)]
Seconds = Annotated[
    float,
    Strict(),
    Field(gt=0, le=MAX_HEARTBEAT_TIMEOUT.total_seconds(), allow_inf_nan=False),
]


class Body(BaseModel):
    """A request body: immutable, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# -- runners ------------------------------------------------------------------


class RunnerRegistration(Body):
    """``register_runner``."""

    runner_id: PathName
    pool_name: Name
    backend_kind: Name = ""
    architecture: Name
    capabilities: NameSet = frozenset()
    allocatable: Capacity
    guest_protocol_minimum: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
    guest_protocol_maximum: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
    supported_egress_contexts: Names = ()


class RegisteredRunner(BaseModel):
    runner: RunnerSnapshot
    created: bool = Field(description="False when the same registration was already recorded.")


class RunnerList(BaseModel):
    runners: list[RunnerSnapshot]


class Heartbeat(Body):
    """``record_heartbeat``: ``at`` is the runner's time; the scheduler's clock refuses
    one later than itself plus the clock tolerance."""

    at: Time
    artifact_digests: Names = ()
    materializations: Annotated[
        tuple[MaterializationSnapshot, ...], Field(max_length=MAX_ITEMS)
    ] = ()


class HeartbeatOutcome(BaseModel):
    runner_id: str
    outcome: str = Field(
        description=f"{OBSERVED_RENEWED} or {OBSERVED_EVIDENCE}: recorded; "
        f"{OBSERVED_COALESCED}: nothing written (within the renewal interval, same "
        f"evidence); {OBSERVED_STALE}: older than the last recorded heartbeat"
    )


class RunnerChanged(BaseModel):
    """The runner after a command that changed it."""

    runner: RunnerSnapshot


class Deregistered(BaseModel):
    runner_id: str
    deregistered: bool = True


# -- sandboxes ----------------------------------------------------------------


class SandboxCreation(Body):
    """``create_sandbox``; repeating it with the same fields answers the same home."""

    sandbox_id: PathName
    workspace_id: Name
    profile_revision_id: Name
    requirements: Requirements
    heartbeat_timeout_seconds: Seconds


class SandboxHome(BaseModel):
    sandbox_id: str
    home_runner_id: str


class ScheduleBody(Body):
    """``schedule`` (docs/spec.md (section 6)): a ``ScheduleRequest`` for the sandbox of the path.

    The times are the caller's; the scheduler's clock refuses ``now`` outside its clock
    plus or minus the tolerance, and ``effect_started_at`` or ``plan_ready_at`` later
    than clock plus tolerance (docs/spec.md (section 6a))."""

    assignment_id: Name
    assignment_command_id: Name
    instance_id: Name
    workspace_id: Name
    start_mutation_id: Name
    profile_revision_id: Name
    requirements: Requirements
    assignment_command: TextMap | None = None
    fencing_token: HexToken
    resolved_artifacts: TextMap = Field(default_factory=dict)
    claim_expires_at: Time
    operation_deadline: Time
    retry_limit: Annotated[StrictInt, Field(ge=0, le=MAX_RETRY_LIMIT)] = 0
    serialization_retry_limit: Annotated[
        StrictInt, Field(ge=0, le=MAX_SERIALIZATION_RETRY_LIMIT)
    ] = DEFAULT_SERIALIZATION_RETRY_LIMIT
    heartbeat_timeout_seconds: Seconds
    now: Time
    effect_started_at: Time
    plan_ready_at: Time

    def to_request(self, sandbox_id: str) -> ScheduleRequest:
        """The domain's request (validated again there: docs/spec.md (section 6) step 1)."""
        fields = {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name not in ("fencing_token", "heartbeat_timeout_seconds")
        }
        return ScheduleRequest(
            sandbox_id=sandbox_id,
            fencing_token=bytes.fromhex(self.fencing_token),
            heartbeat_timeout=timedelta(seconds=self.heartbeat_timeout_seconds),
            **fields,
        )


HexBytesOut = Annotated[
    StrictBytes,
    WithJsonSchema({"type": "string", "pattern": "^([0-9a-f]{2})*$", "description": "hex"}),
]


class AssignmentOut(DurableAssignment):
    """A :class:`DurableAssignment` with its fencing token as lowercase hex."""

    model_config = ConfigDict(ser_json_bytes="hex", val_json_bytes="hex")

    fencing_token: HexBytesOut = b""

    @classmethod
    def of(cls, assignment: DurableAssignment) -> AssignmentOut:
        return cls.model_construct(**dict(assignment))


class ScheduleResult(BaseModel):
    assignment: AssignmentOut
    created: bool = Field(description="False: the generation was already assigned (a replay).")


class AssignmentList(BaseModel):
    assignments: list[AssignmentOut]


class Fence(Body):
    """The current generation's fencing token, which every runner-side command presents."""

    fencing_token: HexToken

    def token(self) -> bytes:
        return bytes.fromhex(self.fencing_token)


class Release(Fence):
    release_proof: Annotated[
        dict[StrictStr, StrictStr], Field(min_length=1, max_length=MAX_PROOF_ENTRIES)
    ]


class Failure(Fence):
    failure_class: Literal[tuple(sorted(FAILURE_CLASSES))]  # type: ignore[valid-type]


class Released(BaseModel):
    released: bool = Field(description="False: already released with this proof (a repeat).")


class ReconcileClaim(Body):
    owner: Name
    until: Time


class ClaimOwner(Body):
    owner: Name


class ReconcileResult(Body):
    """``record_reconcile``: commit a reconcile decision while ``owner``'s claim holds."""

    owner: Name
    action: Literal[ACTIONS]  # type: ignore[valid-type]
    reason: Text
    next_reconcile_at: Time | None = None


class Claimed(BaseModel):
    claimed: bool


class ClaimReleased(BaseModel):
    released: bool


class ReconcileRecorded(BaseModel):
    recorded: bool = True


class Generation(BaseModel):
    sandbox_id: str
    generation: int


# -- audit --------------------------------------------------------------------


class ActorOut(BaseModel):
    """Who asked for the command that recorded an event (docs/events.md, "The actor")."""

    kind: str = Field(description="token, anonymous, library or cli.")
    name: str | None = Field(
        default=None,
        description="The token's id, the client address, the embedder's name or the OS user.",
    )
    role: str | None = Field(default=None, description="A token's role.")


ACTOR_FIELD = Field(
    default=None, description="Who asked; null: unknown (an event recorded before 0.3)."
)


class TimelineEntryOut(BaseModel):
    time: datetime
    stream: str
    version: int
    event: str
    actor: ActorOut | None = ACTOR_FIELD
    fields: dict[str, Any]


class Timeline(BaseModel):
    entries: list[TimelineEntryOut]


class CandidateOut(BaseModel):
    runner_id: str
    verdict: str
    reasons: list[dict[str, Any]]
    rank: dict[str, int] | None = None


class DecisionOut(BaseModel):
    title: str
    decided_at: datetime
    heartbeat_timeout_seconds: float
    summary: str
    actor: ActorOut | None = ACTOR_FIELD
    candidates: list[CandidateOut]
    detail: dict[str, Any]


class ExplanationOut(BaseModel):
    sandbox_id: str
    decisions: list[DecisionOut]
