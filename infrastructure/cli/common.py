"""What every command of the command line shares.

The ``--database-url`` and ``--json`` option types; error reporting (an expected
failure is one line on stderr and exit code 2, no traceback); opening a store and
the settings it needs; hiding a URL's password; printing JSON and tables on stdout;
the number and time formats that several command groups print.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import typer
from eventsourcing.persistence import PersistenceError
from rich.console import Console
from rich.markup import escape

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.simulation import sqlite_path

GIB = 2**30
EXIT_REFUSED = 2
PIPE_WIDTH = 160
CONNECT_TIMEOUT = "POSTGRES_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_SECONDS = "10"

DatabaseUrl = Annotated[
    str,
    typer.Option(
        "--database-url",
        envvar=DATABASE_URL,
        help=(
            "Store to use: sqlite:///relative.db, sqlite:////absolute/path.db or "
            "postgresql://user:pass@host:port/db."
        ),
    ),
]
JsonOutput = Annotated[
    bool,
    typer.Option("--json", help="Print machine-readable JSON on stdout and nothing else."),
]


class CommandError(Exception):
    """A problem of the command's input or environment, reported as one line."""


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit with code 2."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/bold red] {message}", markup=True
    )
    raise typer.Exit(EXIT_REFUSED)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn expected failures into one line on stderr and exit code 2 (no traceback)."""
    try:
        yield
    except (SchedulerError, CommandError) as error:
        fail(escape(str(error)))
    except PersistenceError as error:
        fail(escape(f"database error: {type(error).__name__}: {error}"))


@contextmanager
def store_errors(database_url: str) -> Iterator[None]:
    """Name the store (password hidden) in a database error."""
    try:
        yield
    except PersistenceError as error:
        detail = f"{type(error).__name__}: {error}".strip()
        raise CommandError(f"database error on {redact(database_url)}: {detail}") from None


def redact(database_url: str) -> str:
    """The URL with its password replaced by ***."""
    parts = urlsplit(database_url)
    if not parts.password:
        return database_url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def store_env(database_url: str) -> dict[str, str]:
    """Application settings for the store; a PostgreSQL connect timeout unless one is set."""
    env = {DATABASE_URL: database_url}
    if CONNECT_TIMEOUT not in os.environ:
        env[CONNECT_TIMEOUT] = DEFAULT_CONNECT_TIMEOUT_SECONDS
    return env


def open_store(database_url: str, *, must_exist: bool = True) -> SchedulerApplication:
    """The application on the store; a missing SQLite file is a command error."""
    path = sqlite_path(database_url)
    if must_exist and path is not None and not path.exists():
        raise CommandError(
            f"no database at {path} ({database_url}); run `secondbox-scheduler simulate` "
            "first or pass --database-url"
        )
    with store_errors(database_url):
        return SchedulerApplication(env=store_env(database_url))


def print_json(data: Any) -> None:
    """The data as indented JSON on stdout."""
    typer.echo(json.dumps(data, indent=2))


def stdout() -> Console:
    """Tables for people: the terminal's width, or wide enough not to fold when piped."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, PIPE_WIDTH))
    return console


def gib(amount: int) -> str:
    """Bytes as whole GiB with thousands separators."""
    return f"{amount / GIB:,.0f}"


def format_time(value: datetime | None) -> str:
    """A time as ``YYYY-MM-DD HH:MM:SSZ``, or ``-`` for none."""
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")
