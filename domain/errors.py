"""Typed errors of the scheduler.

Every error the scheduler raises on purpose is a :class:`SchedulerError`. Messages
keep the seed's wording where it has one ("SecondBox scheduler found no compatible
runner", "SecondBox scheduler ProfileRevision mismatch").
"""

from __future__ import annotations

from collections.abc import Sequence

from secondbox_scheduler.domain.placement.evidence import (
    RunnerEvaluation,
    Unlisted,
    summarize_refusals,
)


class SchedulerError(Exception):
    """Base class of every error the scheduler raises on purpose."""

    retryable: bool = False


class InvalidRequestError(SchedulerError, ValueError):
    """Bad input: names the offending field and the rule it broke. Nothing was written."""

    def __init__(self, field: str, rule: str, value: object = None) -> None:
        self.field = field
        self.rule = rule
        self.value = value
        super().__init__(f"SecondBox scheduler invalid request: {field}: {rule}")


class PlacementError(SchedulerError):
    """No runner could take the placement; carries every runner's evaluation."""

    base_message = "SecondBox scheduler found no compatible runner"

    def __init__(
        self,
        evaluations: Sequence[RunnerEvaluation] = (),
        detail: str = "",
        *,
        unlisted: Unlisted | None = None,
    ) -> None:
        self.evaluations = tuple(evaluations)
        self.unlisted = unlisted or Unlisted()  # runners refused without a record, counted
        summary = summarize_refusals(self.evaluations, self.unlisted)
        message = self.base_message
        if detail:
            message = f"{message}: {detail}"
        if summary:
            message = f"{message}: {summary}"
        super().__init__(message)


class NoCompatibleRunnerError(PlacementError):
    """No runner passed every compatibility rule."""


class HomeRunnerUnavailableError(PlacementError):
    """The sandbox's home runner is unset, absent or incompatible."""

    base_message = "SecondBox scheduler home runner unavailable"


class EgressContextUnavailableError(PlacementError):
    """A runner failed only the egress rule: the requested egress context is unsupported."""

    base_message = "SecondBox scheduler egress context unavailable"


class ProfileRevisionMismatchError(SchedulerError):
    """The sandbox is absent or pins another workspace or ProfileRevision."""

    def __init__(self, detail: str = "") -> None:
        message = "SecondBox scheduler ProfileRevision mismatch"
        super().__init__(f"{message}: {detail}" if detail else message)


class SerializationContentionError(SchedulerError):
    """Optimistic concurrency kept failing past the retry limit. Retryable."""

    retryable = True

    def __init__(self, attempts: int, subject: str) -> None:
        self.attempts = attempts
        self.subject = subject
        super().__init__(
            f"SecondBox scheduler serialization contention: {subject} lost {attempts} "
            "optimistic-concurrency race(s); retryable, try again later"
        )


class StaleFenceError(SchedulerError):
    """A generation or fencing token that is not the current one. Nothing was written."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"SecondBox scheduler stale fence: {detail}")


class NotFoundError(SchedulerError, LookupError):
    """A runner, sandbox or assignment that does not exist."""

    kind = "object"

    def __init__(self, identifier: str, detail: str = "") -> None:
        self.identifier = identifier
        message = f"SecondBox scheduler {self.kind} {identifier!r} not found"
        super().__init__(f"{message}: {detail}" if detail else message)


class RunnerNotFoundError(NotFoundError):
    kind = "runner"


class SandboxNotFoundError(NotFoundError):
    kind = "sandbox"


class AssignmentNotFoundError(NotFoundError):
    kind = "assignment"


class AccessTokenNotFoundError(NotFoundError):
    kind = "access token"


class ConflictError(SchedulerError):
    """A command that the current state refuses (an invariant would break)."""


class AlreadyExistsError(ConflictError):
    """An id that is already taken."""


class CapacityExceededError(ConflictError):
    """Reserving would make reserved exceed allocatable, or allocatable fall below reserved."""


class ReservedTotalExceededError(CapacityExceededError):
    """Reserving would make a runner's reserved total of ``dimension`` exceed
    ``MAX_RESERVED_TOTAL`` (domain/limits.py), on a checked or an unchecked dimension."""

    def __init__(self, runner_id: str, dimension: str, total: int, limit: int) -> None:
        self.runner_id = runner_id
        self.dimension = dimension
        self.total = total
        self.limit = limit
        super().__init__(
            f"runner {runner_id!r} cannot reserve {dimension}: its reserved total would be "
            f"{total}, past the largest reserved total {limit}"
        )


class RunnerUnavailableError(ConflictError):
    """The runner is draining or deregistered and takes no reservation."""


class InvalidTransitionError(ConflictError):
    """The assignment's state does not allow this command."""


class ReleaseProofError(ConflictError):
    """Release without proof, or a second release with a different proof."""


class ReconcileClaimError(ConflictError):
    """A reconcile result from an owner whose claim is not current (expired or taken over)."""
