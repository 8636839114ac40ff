"""The seed's ``PostgresStore`` facade over :class:`SchedulerApplication`.

``PostgresStore.connect(PostgresStoreConfig(database_url=...))`` coordinates scheduler
replicas through one PostgreSQL: every replica's schedule is an atomic save with
optimistic concurrency on the Sandbox and Runner streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Self

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.values import DurableAssignment, ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    POSTGRES_MODULE,
    settings_from_url,
)


@dataclass(frozen=True)
class PostgresStoreConfig:
    """The scheduler's explicit durable dependencies."""

    database_url: str
    now: Callable[[], datetime] | None = None
    pool_size: int = 5
    max_overflow: int = 10
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        if not isinstance(self.database_url, str) or not self.database_url:
            raise InvalidRequestError("database_url", "must be a postgresql:// URL")
        if settings_from_url(self.database_url)["PERSISTENCE_MODULE"] != POSTGRES_MODULE:
            raise InvalidRequestError("database_url", "must be a postgresql:// URL")
        if self.pool_size < 1:
            raise InvalidRequestError("pool_size", "must be at least 1")
        if self.max_overflow < 0:
            raise InvalidRequestError("max_overflow", "must not be negative")
        return {
            **self.extra_env,
            DATABASE_URL: self.database_url,
            "POSTGRES_POOL_SIZE": str(self.pool_size),
            "POSTGRES_MAX_OVERFLOW": str(self.max_overflow),
        }


class PostgresStore:
    """Coordinates scheduler replicas through durable PostgreSQL transactions."""

    def __init__(self, application: SchedulerApplication) -> None:
        self.application = application

    @classmethod
    def connect(cls, config: PostgresStoreConfig) -> PostgresStore:
        """Connect the scheduler to PostgreSQL authority (creates tables if missing)."""
        return cls(SchedulerApplication(env=config.env(), now=config.now))

    def schedule(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        """Serialize one sandbox generation and reserve capacity on one compatible runner."""
        return self.application.schedule(request)

    def close(self) -> None:
        self.application.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
