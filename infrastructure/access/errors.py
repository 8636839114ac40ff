"""The refusals of the HTTP service's access check (answered 401 and 403)."""

from __future__ import annotations

from secondbox_scheduler.domain.errors import SchedulerError


class UnauthenticatedError(SchedulerError):
    """No valid bearer token: missing, malformed, unknown, revoked or expired."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"SecondBox scheduler unauthenticated: {reason}")


class PermissionDeniedError(SchedulerError):
    """A valid token whose role (or, for a runner token, whose runners) may not do this."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"SecondBox scheduler permission denied: {detail}")
