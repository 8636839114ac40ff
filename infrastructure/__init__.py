"""Infrastructure: the application service and persistence wiring; the command line
(``cli``), the HTTP service (``http``) and the tools (``simulation``, ``bench``,
``fault_injection``) are subpackages of their own."""

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.store.postgres_store import (
    PostgresStore,
    PostgresStoreConfig,
)
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError

__all__ = ["PostgresStore", "PostgresStoreConfig", "SchedulerApplication", "StoreUnavailableError"]
