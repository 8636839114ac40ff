"""Whether an application's store answers now: one fresh connection, no retries.

The eventsourcing recorders retry a failed query ten times (0.2 s apart, each waiting
up to the connect timeout for a pooled connection), which rides out a database
restart but makes a question as simple as "is the store up?" take many seconds while
it is down. Readiness probes and metric scrapes ask this instead: one connection with
the connect timeout (:func:`store_startup.connect_postgres`), or one look at the SQLite
file, and a :class:`StoreUnavailableError` with its ``reason`` when it fails.
"""

from __future__ import annotations

from typing import Any

from secondbox_scheduler.infrastructure.settings import (
    POSTGRES_MODULE,
    POSTGRES_SETTINGS,
    SQLITE_MODULE,
)
from secondbox_scheduler.infrastructure.store.startup import check_sqlite, connect_postgres


def probe_store(env: Any) -> None:
    """Raise StoreUnavailableError unless the store named by the application's settings
    (``app.env``) answers; the in-memory store always does."""
    module = env.get("PERSISTENCE_MODULE") or ""
    if module == POSTGRES_MODULE:
        settings = {key: env.get(key) or "" for key in POSTGRES_SETTINGS}
        connection = connect_postgres(settings)
        try:
            connection.execute("SELECT 1")
        finally:
            connection.close()
    elif module == SQLITE_MODULE:
        check_sqlite(env.get("SQLITE_DBNAME") or "")
