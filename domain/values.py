"""Immutable value types of SPEC section 2 (frozen pydantic models).

Construction checks types and ranges and raises :class:`InvalidRequestError` naming
the field and the rule; a request's cross-field rules (SPEC section 6, step 1) are
checked by :meth:`ScheduleRequest.ensure_valid`, which ``schedule`` calls.

``to_record`` / ``from_record`` convert to and from the primitive shapes that events
carry (str, int, list, dict, ISO datetimes), with sets sorted so that equal values
always give equal records.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Self

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
)

from secondbox_scheduler.domain.errors import InvalidRequestError

DRAIN_PHASE_ACTIVE = "active"
DRAIN_PHASE_DRAINING = "draining"
DRAIN_PHASES = (DRAIN_PHASE_ACTIVE, DRAIN_PHASE_DRAINING)

INT64_MAX = 2**63 - 1
UINT32_MAX = 2**32 - 1
MIN_FENCING_TOKEN_BYTES = 32


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


def _names_from_map(value: object) -> object:
    """Accept the seed's ``map[string]bool`` shape: keep the names mapped to true."""
    if isinstance(value, Mapping):
        return frozenset(name for name, enabled in value.items() if enabled is True)
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


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
Text = Annotated[StrictStr, AfterValidator(_no_nul)]
Count = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
ProtocolGeneration = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]
NameSet = Annotated[
    frozenset[Text],
    BeforeValidator(_names_from_map),
    PlainSerializer(sorted, when_used="json"),
]


def invalid_request_from(model: str, error: ValidationError) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming field and rule."""
    first = error.errors()[0]
    path = [str(part) for part in first["loc"]]
    inner = first.get("ctx", {}).get("error")
    if isinstance(inner, InvalidRequestError):  # a nested value type's own refusal
        return InvalidRequestError(".".join([*path, inner.field]), inner.rule, inner.value)
    field = ".".join(path) or model
    return InvalidRequestError(field, f"{first['msg']} ({model})", first.get("input"))


class Value(BaseModel):
    """Frozen value type whose validation errors are :class:`InvalidRequestError`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise invalid_request_from(type(self).__name__, error) from None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        try:
            return cls.model_validate(record)
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
        return cls.model_construct(
            vcpu_count=int(amounts.get("vcpu_count", 0)),
            memory_bytes=int(amounts.get("memory_bytes", 0)),
            disk_bytes=int(amounts.get("disk_bytes", 0)),
            instances=int(amounts.get("instances", 0)),
            operations=int(amounts.get("operations", 0)),
        )


class Requirements(Value):
    """Immutable ProfileRevision placement constraints."""

    pool_name: Text = ""
    architecture: Text = ""
    required_capabilities: NameSet = frozenset()
    capacity: Capacity = Capacity()
    guest_protocol_generation: ProtocolGeneration = 0
    preferred_artifact_digests: tuple[Text, ...] = ()
    egress_context: Text | None = None


class MaterializationSnapshot(Value):
    """One revalidated local backend composition."""

    backend_kind: Text = ""
    architecture: Text = ""
    runtime_digest: Text = ""
    toolchain_digest: Text = ""
    digest: Text = ""


class RunnerSnapshot(Value):
    """One durable registration and latest heartbeat view."""

    id: Text
    pool_name: Text = ""
    backend_kind: Text = ""
    architecture: Text = ""
    capabilities: NameSet = frozenset()
    allocatable: Capacity = Capacity()
    reserved: Capacity = Capacity()
    drain_phase: Text = DRAIN_PHASE_ACTIVE
    last_heartbeat_at: UTCDatetime | None = None
    artifact_digests: tuple[Text, ...] = ()
    materializations: tuple[MaterializationSnapshot, ...] = ()
    supported_egress_contexts: tuple[Text, ...] = ()
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

    assignment_id: Text = ""
    assignment_command_id: Text = ""
    instance_id: Text = ""
    sandbox_id: Text = ""
    workspace_id: Text = ""
    start_mutation_id: Text = ""
    profile_revision_id: Text = ""
    requirements: Requirements = Requirements()
    assignment_command: dict[Text, Text] | None = None
    fencing_token: StrictBytes = b""
    resolved_artifacts: dict[Text, Text] = Field(default_factory=dict)
    claim_expires_at: UTCDatetime | None = None
    operation_deadline: UTCDatetime | None = None
    retry_limit: Annotated[StrictInt, Field(le=INT64_MAX)] = 0
    serialization_retry_limit: Annotated[StrictInt, Field(le=INT64_MAX)] = 0
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
        """SPEC section 6 step 1: raise InvalidRequestError naming the first bad field."""
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
    """Refuse a non-string or empty identifier, naming the field."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, "must be a string", value)
    if not value:
        raise InvalidRequestError(field, "must not be empty")
    if "\x00" in value:
        raise InvalidRequestError(field, "must not contain NUL characters")
    return value


def require_string_map(field: str, value: object, *, non_empty: bool = False) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and "\x00" not in k + v for k, v in value.items()
    ):
        raise InvalidRequestError(field, "must be a mapping of str to str", value)
    if non_empty and not value:
        raise InvalidRequestError(field, "must not be empty")
    return dict(value)
