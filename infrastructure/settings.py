"""Persistence settings: ``SECONDBOX_DATABASE_URL`` to eventsourcing environment.

``sqlite:///relative/path``, ``sqlite:////absolute/path``, ``sqlite:///:memory:`` and
``postgresql://user:pass@host:port/db[?schema=name]`` become the eventsourcing
settings (``PERSISTENCE_MODULE``, ``SQLITE_DBNAME``, ``POSTGRES_*``). Explicit
eventsourcing settings given next to a URL win over what the URL implies.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import parse_qs, unquote, urlsplit

from secondbox_scheduler.domain.errors import InvalidRequestError

DATABASE_URL = "SECONDBOX_DATABASE_URL"
LEASE_RENEWAL_SECONDS = "SECONDBOX_LEASE_RENEWAL_SECONDS"
# "on" (default): reads catch the read models up first; "external": another process
# (``secondbox-scheduler projections run``) maintains them; "off": read the aggregates.
READ_MODELS = "SECONDBOX_READ_MODELS"
DEFAULT_SQLITE_URL = "sqlite:///secondbox.db"

SQLITE_MODULE = "eventsourcing.sqlite"
POSTGRES_MODULE = "eventsourcing.postgres"


def settings_from_url(url: str) -> dict[str, str]:
    """The eventsourcing settings that select the store named by ``url``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        if parts.netloc:
            raise InvalidRequestError(
                DATABASE_URL, "sqlite URLs have no host: use sqlite:///relative or sqlite:////abs"
            )
        path = unquote(parts.path)
        if not path.startswith("/") or path == "/":
            raise InvalidRequestError(DATABASE_URL, "sqlite URL needs a path: sqlite:///file.db")
        name = path[1:]
        if name == ":memory:":
            name = "file:secondbox?mode=memory&cache=shared"
        return {"PERSISTENCE_MODULE": SQLITE_MODULE, "SQLITE_DBNAME": name}
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        dbname = unquote(parts.path.lstrip("/"))
        if not dbname:
            raise InvalidRequestError(
                DATABASE_URL, "postgresql URL needs a database: postgresql://host/db"
            )
        settings = {
            "PERSISTENCE_MODULE": POSTGRES_MODULE,
            "POSTGRES_DBNAME": dbname,
            "POSTGRES_HOST": unquote(parts.hostname or "127.0.0.1"),
            "POSTGRES_PORT": str(parts.port or 5432),
            "POSTGRES_USER": unquote(parts.username or "postgres"),
            "POSTGRES_PASSWORD": unquote(parts.password or ""),
        }
        schema = parse_qs(parts.query).get("schema")
        if schema:
            settings["POSTGRES_SCHEMA"] = schema[0]
        return settings
    raise InvalidRequestError(
        DATABASE_URL,
        f"must start with sqlite:/// or postgresql:// (got {scheme + '://' if scheme else url!r})",
    )


def persistence_env(env: Mapping[str, str]) -> dict[str, str]:
    """Expand ``SECONDBOX_DATABASE_URL`` in ``env`` into eventsourcing settings."""
    merged = dict(env)
    url = merged.get(DATABASE_URL)
    if url:
        for key, value in settings_from_url(url).items():
            merged.setdefault(key, value)
    return merged
