"""Infrastructure: the application service, persistence wiring and the CLI."""

from infrastructure.application import SchedulerApplication
from infrastructure.postgres_store import PostgresStore, PostgresStoreConfig

__all__ = ["PostgresStore", "PostgresStoreConfig", "SchedulerApplication"]
