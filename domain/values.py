"""Immutable value types of docs/spec.md (section 2) (frozen pydantic models).

Construction checks types and ranges and raises :class:`InvalidRequestError` naming
the field and the rule; a request's cross-field rules (docs/spec.md (section 6), step 1) are
checked by :meth:`ScheduleRequest.ensure_valid`, which ``schedule`` calls.

``to_record`` / ``from_record`` convert to and from the primitive shapes that events
carry (str, int, list, dict, ISO datetimes), with sets sorted so that equal values
always give equal records.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Self, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
    StrictBytes,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
)

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.limits import (
    MAX_FENCING_TOKEN_BYTES,
    MAX_ITEMS,
    MAX_NAME_LENGTH,
    MAX_RETRY_LIMIT,
    MAX_SERIALIZATION_RETRY_LIMIT,
    MAX_TEXT_LENGTH,
    MIN_FENCING_TOKEN_BYTES,
    text_problem,
)

DRAIN_PHASE_ACTIVE = "active"
DRAIN_PHASE_DRAINING = "draining"
DRAIN_PHASES = (DRAIN_PHASE_ACTIVE, DRAIN_PHASE_DRAINING)

INT64_MAX = 2**63 - 1
UINT32_MAX = 2**32 - 1


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


def _names_from_map(value: object) -> object:
    """Accept the seed's ``map[string]bool`` shape: keep the names mapped to true."""
    if isinstance(value, Mapping):
        return frozenset(name for name, enabled in value.items() if enabled is True)
    return value


def _trusted(info: ValidationInfo) -> bool:
    """Values read back from a stored history (``from_record``) are not held to the
    input limits, which a history written before them may exceed; NUL never passes."""
    return isinstance(info.context, dict) and info.context.get("trusted") is True


def _name(value: str, info: ValidationInfo) -> str:
    if _trusted(info):
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value
    problem = text_problem(value, max_length=MAX_NAME_LENGTH, name=True)
    if problem:
        raise ValueError(problem)
    return value


def _text(value: str, info: ValidationInfo) -> str:
    problem = text_problem(
        value, max_length=2**63 if _trusted(info) else MAX_TEXT_LENGTH, name=False
    )
    if problem:
        raise ValueError(problem)
    return value


def _at_most(limit: int) -> Any:
    """A validator bounding a collection's size (input only; see :func:`_trusted`)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if not _trusted(info) and len(value) > limit:
            raise ValueError(f"must have at most {limit} entries (got {len(value)})")
        return value

    return AfterValidator(check)


def _no_numbers(value: object) -> object:
    """Lax datetimes would take 0 or "0" for 1970-01-01: accept datetimes and ISO text only."""
    if isinstance(value, (int, float)):
        raise ValueError("must be a timezone-aware datetime, not a number")
    if isinstance(value, str):  # records carry ISO 8601 text; "0" is not a time
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError("must be an ISO 8601 time") from None
    return value


UTCDatetime = Annotated[AwareDatetime, BeforeValidator(_no_numbers), AfterValidator(_to_utc)]
Name = Annotated[StrictStr, AfterValidator(_name)]  # ids, names, digests
Text = Annotated[StrictStr, AfterValidator(_text)]  # free text
Count = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
ProtocolGeneration = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]
NameSet = Annotated[
    frozenset[Name],
    BeforeValidator(_names_from_map),
    _at_most(MAX_ITEMS),
    PlainSerializer(sorted, when_used="json"),
]
Names = Annotated[tuple[Name, ...], _at_most(MAX_ITEMS)]
TextMap = Annotated[dict[Name, Text], _at_most(MAX_ITEMS)]


def invalid_request_from(model: str, error: ValidationError) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming field and rule."""
    first = error.errors()[0]
    path = [str(part) for part in first["loc"]]
    inner = first.get("ctx", {}).get("error")
    if isinstance(inner, InvalidRequestError):  # a nested value type's own refusal
        return InvalidRequestError(".".join([*path, inner.field]), inner.rule, inner.value)
    field = ".".join(path) or model
    return InvalidRequestError(field, f"{first['msg']} ({model})", first.get("input"))


M = TypeVar("M", bound=BaseModel)


def trusted(model: type[M], values: dict[str, Any]) -> M:
    """``model.model_construct(**values)`` for values that set every field, in the
    model's field order, without its per-field work (a tenth of the time): the same
    ``__dict__`` (in that order, which a dump follows), fields set (all of them: the
    keys of ``values``), no extra, no private values. For models without aliases,
    private attributes or ``model_post_init`` (``tests/test_whatif.py`` and
    ``tests/test_trusted_values.py`` check that both build equal objects)."""
    built = object.__new__(model)
    object.__setattr__(built, "__dict__", values)
    object.__setattr__(built, "__pydantic_fields_set__", set(values))
    object.__setattr__(built, "__pydantic_extra__", None)
    object.__setattr__(built, "__pydantic_private__", None)
    return built


class Value(BaseModel):
    """Frozen value type whose validation errors are :class:`InvalidRequestError`.

    Built from input (the constructor), every limit of :mod:`.limits` applies; rebuilt
    from a stored record (:meth:`from_record`), only the types do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise invalid_request_from(type(self).__name__, error) from None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        try:
            return cls.model_validate(record, context={"trusted": True})
        except ValidationError as error:
            raise invalid_request_from(cls.__name__, error) from None

    def to_record(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class Capacity(Value):
    """Runner compute that may be reserved by assignments."""

    DIMENSIONS: ClassVar[tuple[str, ...]] = (
        "vcpu_count",
        "memory_bytes",
        "disk_bytes",
        "instances",
        "operations",
    )

    vcpu_count: Count = 0
    memory_bytes: Count = 0
    disk_bytes: Count = 0
    instances: Count = 0
    operations: Count = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "vcpu_count": self.vcpu_count,
            "memory_bytes": self.memory_bytes,
            "disk_bytes": self.disk_bytes,
            "instances": self.instances,
            "operations": self.operations,
        }

    @classmethod
    def of(cls, amounts: Mapping[str, int]) -> Capacity:
        """Trusted construction from a dimension mapping (no validation)."""
        get = amounts.get
        return trusted(
            cls,
            {
                "vcpu_count": int(get("vcpu_count", 0)),
                "memory_bytes": int(get("memory_bytes", 0)),
                "disk_bytes": int(get("disk_bytes", 0)),
                "instances": int(get("instances", 0)),
                "operations": int(get("operations", 0)),
            },
        )


class Requirements(Value):
    """Immutable ProfileRevision placement constraints."""

    pool_name: Name = ""
    architecture: Name = ""
    required_capabilities: NameSet = frozenset()
    capacity: Capacity = Capacity()
    guest_protocol_generation: ProtocolGeneration = 0
    preferred_artifact_digests: Names = ()
    egress_context: Name | None = None


# the records of requirements values lately dumped, by the value's identity (the
# value is kept with its record, so its id is not reused meanwhile): a schedule checks
# a request's requirements against its sandbox's pinned record twice, and a batch's
# requests may share one value; cleared when full, and few: every value kept is
# objects the garbage collector walks (``tests/test_batching.py`` bounds them)
_REMEMBERED_RECORDS = 64
_requirements_records: dict[int, tuple[Requirements, dict[str, Any]]] = {}


def requirements_record(requirements: Requirements) -> dict[str, Any]:
    """``requirements.to_record()``, dumped once per value (a frozen value of frozen
    values, sets and tuples: its record never changes). The record is shared: read it,
    never change it."""
    known = _requirements_records.get(id(requirements))
    if known is not None and known[0] is requirements:
        return known[1]
    record = requirements.to_record()
    if len(_requirements_records) >= _REMEMBERED_RECORDS:
        _requirements_records.clear()
    _requirements_records[id(requirements)] = (requirements, record)
    return record


class MaterializationSnapshot(Value):
    """One revalidated local backend composition."""

    backend_kind: Name = ""
    architecture: Name = ""
    runtime_digest: Name = ""
    toolchain_digest: Name = ""
    digest: Name = ""


class RunnerSnapshot(Value):
    """One durable registration and latest heartbeat view."""

    id: Name
    pool_name: Name = ""
    backend_kind: Name = ""
    architecture: Name = ""
    capabilities: NameSet = frozenset()
    allocatable: Capacity = Capacity()
    reserved: Capacity = Capacity()
    drain_phase: Name = DRAIN_PHASE_ACTIVE
    last_heartbeat_at: UTCDatetime | None = None
    artifact_digests: Names = ()
    materializations: Annotated[tuple[MaterializationSnapshot, ...], _at_most(MAX_ITEMS)] = ()
    supported_egress_contexts: Names = ()
    guest_protocol_minimum: ProtocolGeneration = 0
    guest_protocol_maximum: ProtocolGeneration = 0

    def free(self) -> Capacity:
        a, r = self.allocatable, self.reserved
        return Capacity.model_construct(
            vcpu_count=a.vcpu_count - r.vcpu_count,
            memory_bytes=a.memory_bytes - r.memory_bytes,
            disk_bytes=a.disk_bytes - r.disk_bytes,
            instances=a.instances - r.instances,
            operations=a.operations - r.operations,
        )


class DurableAssignment(Value):
    """Every private runner and backend authority field of one sandbox generation.

    The seed's fields in snake_case, plus ``capacity`` (what the assignment reserved),
    ``workspace_id``, ``assignment_command_id``, ``assignment_command`` and
    ``start_mutation_id`` (the request identity it was fenced with).
    """

    id: Text
    sandbox_id: Text
    instance_id: Text = ""
    runner_id: Text = ""
    profile_revision_id: Text = ""
    backend_kind: Text = ""
    backend_reference: Text = ""
    generation: Count = 0
    fencing_token: StrictBytes = b""
    state: Text = ""
    capability_snapshot: dict[Text, Text] = Field(default_factory=dict)
    resolved_artifacts: dict[Text, Text] = Field(default_factory=dict)
    release_proof: dict[Text, Text] = Field(default_factory=dict)
    failure_class: Text = ""
    retry_count: Count = 0
    retry_limit: Count = 0
    operation_deadline: UTCDatetime | None = None
    claim_expires_at: UTCDatetime | None = None
    reconcile_owner: Text = ""
    reconcile_claim_expires_at: UTCDatetime | None = None
    next_reconcile_at: UTCDatetime | None = None
    revision: Count = 0
    created_at: UTCDatetime | None = None
    updated_at: UTCDatetime | None = None
    egress_context: Text | None = None
    capacity: Capacity = Capacity()
    workspace_id: Text = ""
    assignment_command_id: Text = ""
    assignment_command: dict[Text, Text] | None = None
    start_mutation_id: Text = ""


class ScheduleRequest(Value):
    """Explicit immutable assignment authority and retry bounds.

    Fields default to the seed's Go zero values so that a partial request can be
    built; :meth:`ensure_valid` (called by ``schedule``) refuses what is missing.
    """

    assignment_id: Name = ""
    assignment_command_id: Name = ""
    instance_id: Name = ""
    sandbox_id: Name = ""
    workspace_id: Name = ""
    start_mutation_id: Name = ""
    profile_revision_id: Name = ""
    requirements: Requirements = Requirements()
    assignment_command: TextMap | None = None
    fencing_token: Annotated[StrictBytes, Field(max_length=MAX_FENCING_TOKEN_BYTES)] = b""
    resolved_artifacts: TextMap = Field(default_factory=dict)
    claim_expires_at: UTCDatetime | None = None
    operation_deadline: UTCDatetime | None = None
    retry_limit: Annotated[StrictInt, Field(le=MAX_RETRY_LIMIT)] = 0
    serialization_retry_limit: Annotated[StrictInt, Field(le=MAX_SERIALIZATION_RETRY_LIMIT)] = 0
    heartbeat_timeout: Annotated[timedelta, Strict()] = timedelta(0)
    now: UTCDatetime | None = None
    effect_started_at: UTCDatetime | None = None
    plan_ready_at: UTCDatetime | None = None

    IDENTITY_FIELDS: ClassVar[tuple[str, ...]] = (
        "assignment_id",
        "assignment_command_id",
        "instance_id",
        "sandbox_id",
        "workspace_id",
        "start_mutation_id",
        "profile_revision_id",
    )

    def ensure_valid(self) -> None:
        """docs/spec.md (section 6) step 1: raise InvalidRequestError naming the first bad field."""
        for name in self.IDENTITY_FIELDS:
            require_text(name, getattr(self, name))
        requirements = self.requirements
        if not requirements.pool_name:
            raise InvalidRequestError("requirements.pool_name", "must not be empty")
        if not requirements.architecture:
            raise InvalidRequestError("requirements.architecture", "must not be empty")
        if requirements.guest_protocol_generation < 1:
            raise InvalidRequestError(
                "requirements.guest_protocol_generation", "must be at least 1"
            )
        if len(self.fencing_token) < MIN_FENCING_TOKEN_BYTES:
            raise InvalidRequestError(
                "fencing_token", f"must be at least {MIN_FENCING_TOKEN_BYTES} bytes"
            )
        for name in (
            "claim_expires_at",
            "operation_deadline",
            "now",
            "effect_started_at",
            "plan_ready_at",
        ):
            require_aware(name, getattr(self, name))
        if self.heartbeat_timeout <= timedelta(0):
            raise InvalidRequestError("heartbeat_timeout", "must be greater than zero")
        if self.retry_limit < 0:
            raise InvalidRequestError("retry_limit", "must not be negative")
        if self.serialization_retry_limit < 0:
            raise InvalidRequestError("serialization_retry_limit", "must not be negative")
        assert self.now
        assert self.effect_started_at
        assert self.plan_ready_at
        if self.effect_started_at < self.now:
            raise InvalidRequestError("effect_started_at", "must not be before now")
        if self.plan_ready_at < self.effect_started_at:
            raise InvalidRequestError("plan_ready_at", "must not be before effect_started_at")


def require_aware(field: str, value: object) -> datetime:
    """Refuse an unset, non-datetime or naive time, naming the field."""
    if value is None:
        raise InvalidRequestError(field, "must be set")
    if not isinstance(value, datetime):
        raise InvalidRequestError(field, "must be a datetime", value)
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidRequestError(field, "must be timezone-aware (UTC)", value)
    return value.astimezone(UTC)


def require_text(field: str, value: object) -> str:
    """Refuse a non-string, empty or unprintable identifier, or one past the length
    limit, naming the field."""
    if type(value) is not str:  # a subclass (an Enum member) could be stored otherwise
        raise InvalidRequestError(field, "must be a string (str itself, not a subclass)", value)
    if not value:
        raise InvalidRequestError(field, "must not be empty")
    problem = text_problem(value, max_length=MAX_NAME_LENGTH, name=True)
    if problem:
        raise InvalidRequestError(field, problem)
    return value


def require_string_map(
    field: str,
    value: object,
    *,
    non_empty: bool = False,
    max_entries: int = MAX_ITEMS,
    max_value_length: int = MAX_TEXT_LENGTH,
) -> dict[str, str]:
    """A mapping of non-empty names to text, within the entry and length limits."""
    if not isinstance(value, Mapping) or not all(
        type(k) is str and type(v) is str for k, v in value.items()
    ):
        raise InvalidRequestError(field, "must be a mapping of str to str", value)
    if non_empty and not value:
        raise InvalidRequestError(field, "must not be empty")
    if len(value) > max_entries:
        raise InvalidRequestError(
            field, f"must have at most {max_entries} entries (got {len(value)})"
        )
    for key, text in value.items():
        problem = "must not be empty" if not key else None
        problem = problem or text_problem(key, max_length=MAX_NAME_LENGTH, name=True)
        if problem:
            raise InvalidRequestError(f"{field} key", problem)
        problem = text_problem(text, max_length=max_value_length, name=False)
        if problem:
            raise InvalidRequestError(f"{field}[{key!r}]", problem)
    return dict(value)
