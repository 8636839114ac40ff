"""The commands' input checks and clock checks: pure, no I/O, no clock read.

Each refuses bad input with ``InvalidRequestError`` naming the field and the rule,
before anything is loaded or written. The clock checks compare a caller's times with
the scheduler's clock reading and tolerance, which the service passes in
(docs/spec.md, section 6a).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.limits import MAX_DEADLINE_AHEAD, MAX_HEARTBEAT_TIMEOUT
from secondbox_scheduler.domain.values import Capacity, Requirements, ScheduleRequest, require_text


def seconds_text(duration: timedelta) -> str:
    return f"{duration.total_seconds():g}s"


def not_after_clock(field: str, value: datetime, now: datetime, tolerance: timedelta) -> None:
    """docs/spec.md (section 6a): no caller-supplied time later than clock + tolerance."""
    if value > now + tolerance:
        raise InvalidRequestError(
            field,
            f"must not be later than the scheduler's clock + {seconds_text(tolerance)} "
            f"(clock {now.isoformat()}, got {value.isoformat()})",
        )


def near_clock(field: str, value: datetime, now: datetime, tolerance: timedelta) -> None:
    """docs/spec.md (section 6a): a request's time within clock +/- tolerance."""
    not_after_clock(field, value, now, tolerance)
    if value < now - tolerance:
        raise InvalidRequestError(
            field,
            f"must not be earlier than the scheduler's clock - "
            f"{seconds_text(tolerance)} (clock {now.isoformat()}, got "
            f"{value.isoformat()})",
        )


def not_long_before_clock(field: str, value: datetime, now: datetime) -> None:
    """docs/spec.md (section 6a): no caller-supplied time earlier than clock - the
    largest heartbeat timeout (one that old cannot make a runner fresh for any sandbox,
    and a stored time far in the past broke later reads)."""
    if value < now - MAX_HEARTBEAT_TIMEOUT:
        raise InvalidRequestError(
            field,
            f"must not be earlier than the scheduler's clock - the largest heartbeat "
            f"timeout {seconds_text(MAX_HEARTBEAT_TIMEOUT)} (clock {now.isoformat()}, got "
            f"{value.isoformat()})",
        )


def check_heartbeat_time(at: datetime, now: datetime, tolerance: timedelta) -> None:
    """docs/spec.md (section 6a): a heartbeat's ``at`` no later than clock + tolerance and
    no earlier than clock - the largest heartbeat timeout."""
    not_after_clock("at", at, now, tolerance)
    not_long_before_clock("at", at, now)


def check_request_times(request: ScheduleRequest, now: datetime, tolerance: timedelta) -> None:
    """docs/spec.md (section 6a) and the limits: a schedule request's times against the
    clock."""
    assert request.now is not None
    assert request.effect_started_at is not None
    assert request.plan_ready_at is not None
    near_clock("now", request.now, now, tolerance)
    not_after_clock("effect_started_at", request.effect_started_at, now, tolerance)
    not_after_clock("plan_ready_at", request.plan_ready_at, now, tolerance)
    for name in ("claim_expires_at", "operation_deadline"):
        value = getattr(request, name)
        not_long_before_clock(name, value, now)
        if value - request.now > MAX_DEADLINE_AHEAD:
            raise InvalidRequestError(
                name, f"must be at most {seconds_text(MAX_DEADLINE_AHEAD)} after now", value
            )
    require_timeout(request.heartbeat_timeout)


def as_collection(field_name: str, value: object) -> Any:
    if isinstance(value, (str, bytes)):
        raise InvalidRequestError(field_name, "must be a collection, not a single string", value)
    return value


def as_capacity(field_name: str, value: object) -> Capacity:
    if isinstance(value, Capacity):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field_name, "must be a Capacity or a mapping", value)
    try:
        return Capacity(**value)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"{field_name}.{error.field}", error.rule, error.value) from None


def as_requirements(value: object) -> Requirements:
    if isinstance(value, Mapping):
        value = Requirements(**value)
    if not isinstance(value, Requirements):
        raise InvalidRequestError("requirements", "must be Requirements or a mapping", value)
    if not value.pool_name:
        raise InvalidRequestError("requirements.pool_name", "must not be empty")
    if not value.architecture:
        raise InvalidRequestError("requirements.architecture", "must not be empty")
    if value.guest_protocol_generation < 1:
        raise InvalidRequestError("requirements.guest_protocol_generation", "must be at least 1")
    return value


def require_timeout(value: object) -> None:
    if not isinstance(value, timedelta):
        raise InvalidRequestError("heartbeat_timeout", "must be a timedelta", value)
    if value <= timedelta(0):
        raise InvalidRequestError("heartbeat_timeout", "must be greater than zero")
    if value > MAX_HEARTBEAT_TIMEOUT:
        raise InvalidRequestError(
            "heartbeat_timeout", f"must be at most {seconds_text(MAX_HEARTBEAT_TIMEOUT)}", value
        )


def require_generation(sandbox_id: object, generation: object) -> None:
    require_text("sandbox_id", sandbox_id)
    if type(generation) is not int or generation < 1:  # not bool, not an IntEnum member
        raise InvalidRequestError("generation", "must be an integer of at least 1", generation)


def require_fence(sandbox_id: object, generation: object, fencing_token: object) -> None:
    require_generation(sandbox_id, generation)
    if not isinstance(fencing_token, bytes) or not fencing_token:
        raise InvalidRequestError("fencing_token", "must be non-empty bytes", fencing_token)
