"""Infrastructure: the application service, persistence wiring and the CLI."""

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.postgres_store import PostgresStore, PostgresStoreConfig

__all__ = ["PostgresStore", "PostgresStoreConfig", "SchedulerApplication"]
