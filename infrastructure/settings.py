"""Persistence settings: ``SECONDBOX_DATABASE_URL`` to eventsourcing environment.

``sqlite:///relative/path``, ``sqlite:////absolute/path``, ``sqlite:///:memory:`` and
``postgresql://user:pass@host:port/db[?schema=name]`` become the eventsourcing
settings (``PERSISTENCE_MODULE``, ``SQLITE_DBNAME``, ``POSTGRES_*``). Explicit
eventsourcing settings given next to a URL win over what the URL implies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.limits import DEFAULT_CLOCK_TOLERANCE, MAX_CLOCK_TOLERANCE

DATABASE_URL = "SECONDBOX_DATABASE_URL"
LEASE_RENEWAL_SECONDS = "SECONDBOX_LEASE_RENEWAL_SECONDS"
# "on" (default): reads catch the read models up first; "external": another process
# (``secondbox-scheduler projections run``) maintains them; "off": read the aggregates.
READ_MODELS = "SECONDBOX_READ_MODELS"
# How far a caller's time may differ from the scheduler's clock (docs/spec.md (section 6a)).
CLOCK_TOLERANCE_SECONDS = "SECONDBOX_CLOCK_TOLERANCE_SECONDS"
# Placement batching (infrastructure/placing/batcher.py): on/off, largest batch, longest wait.
BATCHING = "SECONDBOX_BATCHING"
BATCH_SIZE = "SECONDBOX_BATCH_SIZE"
BATCH_WAIT_MS = "SECONDBOX_BATCH_WAIT_MS"
# Advisory locks on a batch's home runners (infrastructure/placing/runner_locks.py, PostgreSQL):
# "on" (default) or "off", to measure what they change.
RUNNER_LOCKS = "SECONDBOX_RUNNER_LOCKS"
# Events a read model may lag behind the log before /readyz answers 503 (``serve
# --max-read-model-lag`` wins over it).
READY_MAX_LAG = "SECONDBOX_READY_MAX_LAG"
DEFAULT_READY_MAX_LAG = 1000
DEFAULT_SQLITE_URL = "sqlite:///secondbox.db"
# The key of the event chain and snapshot seals (HMAC-SHA-256; unset: SHA-256 alone).
AUDIT_KEY = "SECONDBOX_AUDIT_KEY"
# The private key that signs checkpoints (``audit checkpoint``, ``/v1/audit/checkpoint``):
# the key itself (PRIVATE+KEY+...) or the path of the file ``audit keygen`` wrote.
CHECKPOINT_KEY = "SECONDBOX_CHECKPOINT_KEY"
# Hidden, for the bench's comparison only: "off" stores events without the chain.
CHAIN = "SECONDBOX_CHAIN"
APPLICATION_RECORDER_TOPIC = "APPLICATION_RECORDER_TOPIC"
CHAINED_RECORDERS = {
    "eventsourcing.sqlite": "secondbox_scheduler.infrastructure.store.chained_sqlite"
    ":ChainedSQLiteRecorder",
    "eventsourcing.postgres": "secondbox_scheduler.infrastructure.store.chained_postgres"
    ":ChainedPostgresRecorder",
}

SQLITE_MODULE = "eventsourcing.sqlite"
POSTGRES_MODULE = "eventsourcing.postgres"
POSTGRES_SETTINGS = (
    "POSTGRES_HOST",
    "POSTGRES_PORT",
    "POSTGRES_USER",
    "POSTGRES_PASSWORD",
    "POSTGRES_DBNAME",
    "POSTGRES_SCHEMA",
    "POSTGRES_CONNECT_TIMEOUT",
    "POSTGRES_TARGET_SESSION_ATTRS",
)
# libpq's target_session_attrs (a multi-host URL's ``?target_session_attrs=read-write``):
# which of the URL's hosts a connection may settle on.
TARGET_SESSION_ATTRS = "POSTGRES_TARGET_SESSION_ATTRS"
# The name of the cell this application's store is (docs/operations.md, "Cells"), named
# by the CellUnavailableError of its reconnection (store/reconnect.py); "default" unset.
CELL = "SECONDBOX_CELL"
DEFAULT_CELL = "default"
TARGET_SESSION_ATTRS_VALUES = (
    "any", "read-write", "read-only", "primary", "standby", "prefer-standby",
)  # fmt: skip


def clock_tolerance(value: str | None) -> timedelta:
    """The clock tolerance setting: seconds, from 0 to the largest tolerance (300)."""
    if not value:
        return DEFAULT_CLOCK_TOLERANCE
    limit = MAX_CLOCK_TOLERANCE.total_seconds()
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= limit:  # also refuses NaN
        raise InvalidRequestError(
            CLOCK_TOLERANCE_SECONDS, f"must be a number of seconds from 0 to {limit:g}", value
        )
    return timedelta(seconds=seconds)


def ready_max_lag(value: str | None) -> int:
    """The readiness bound (``SECONDBOX_READY_MAX_LAG``): a whole number of events, 0 or
    more; 1,000 when unset."""
    if not value:
        return DEFAULT_READY_MAX_LAG
    try:
        events = int(value)
    except ValueError:
        events = -1
    if events < 0:
        raise InvalidRequestError(
            READY_MAX_LAG, "must be a whole number of events, 0 or more", value
        )
    return events


def batch_setting(value: str | None, default: float, name: str) -> float:
    """A batching setting: a non-negative number (the size at least 1, at most 1,024)."""
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    low, high = (1, 1024) if name == BATCH_SIZE else (0, 1000)
    if not low <= number <= high:
        raise InvalidRequestError(name, f"must be a number from {low} to {high}", value)
    return int(number) if name == BATCH_SIZE else number


def redact_url(database_url: str) -> str:
    """The URL with its password replaced by ``***`` (for every output: headers, JSON,
    reports, logs, errors)."""
    parts = urlsplit(database_url)
    if parts.password is None:
        return database_url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def sqlite_path(database_url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL (None for other stores and in-memory SQLite)."""
    if not database_url.lower().startswith("sqlite:"):
        return None
    name = settings_from_url(database_url)["SQLITE_DBNAME"]
    return None if name.startswith("file:") else Path(name)


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
        user, password, hosts, ports = _postgres_netloc(parts.netloc)
        settings = {
            "PERSISTENCE_MODULE": POSTGRES_MODULE,
            "POSTGRES_DBNAME": dbname,
            "POSTGRES_HOST": hosts,
            "POSTGRES_PORT": ports,
            "POSTGRES_USER": user or "postgres",
            "POSTGRES_PASSWORD": password,
        }
        query = parse_qs(parts.query)
        schema = query.get("schema")
        if schema:
            settings["POSTGRES_SCHEMA"] = schema[0]
        attrs = query.get("target_session_attrs")
        if attrs:
            if attrs[0] not in TARGET_SESSION_ATTRS_VALUES:
                raise InvalidRequestError(
                    DATABASE_URL,
                    "target_session_attrs must be one of " + ", ".join(TARGET_SESSION_ATTRS_VALUES),
                    attrs[0],
                )
            settings[TARGET_SESSION_ATTRS] = attrs[0]
        return settings
    raise InvalidRequestError(
        DATABASE_URL,
        "must start with sqlite:/// or postgresql:// "
        f"(got {scheme + '://' if scheme else redact_url(url)!r})",
    )


def _postgres_netloc(netloc: str) -> tuple[str, str, str, str]:
    """User, password, hosts and ports of a libpq URL's authority, which may name several
    hosts (``user:pw@h1:5432,h2:5433``, ``[::1]:5432``): hosts and ports joined by commas,
    as libpq takes them (a host without a port gets 5432)."""
    userinfo, _, hostlist = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    hosts: list[str] = []
    ports: list[str] = []
    for entry in hostlist.split(",") if hostlist else [""]:
        host, port = entry, ""
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            port = rest.removeprefix(":")
        elif ":" in entry:
            host, _, port = entry.rpartition(":")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise InvalidRequestError(DATABASE_URL, "a port must be a number from 1 to 65535")
        hosts.append(unquote(host) or "127.0.0.1")
        ports.append(port or "5432")
    return unquote(user), unquote(password), ",".join(hosts), ",".join(ports)


def persistence_env(env: Mapping[str, str]) -> dict[str, str]:
    """Expand ``SECONDBOX_DATABASE_URL`` in ``env`` into eventsourcing settings."""
    merged = dict(env)
    url = merged.get(DATABASE_URL)
    if url:
        for key, value in settings_from_url(url).items():
            merged.setdefault(key, value)
    return merged
