"""What every command of the command line shares.

The ``--database-url`` and ``--json`` option types; error reporting (an expected
failure is one line on stderr and its exit code, :mod:`..exit_codes`, no traceback);
opening a store and
the settings it needs; hiding a URL's password; printing JSON and tables on stdout;
the number and time formats that several command groups print.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any, NoReturn

import typer
from eventsourcing.persistence import PersistenceError
from rich.console import Console
from rich.markup import escape
from rich.segment import Segment

from secondbox_scheduler.domain.errors import SchedulerError
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.exit_codes import (
    EXIT_REFUSED,
    EXIT_STORE_UNAVAILABLE,
    EXIT_USAGE,
    CommandError,
    exit_code_of,
)
from secondbox_scheduler.infrastructure.extras import MissingExtraError, require_extra
from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    READ_MODELS,
    redact_url,
    sqlite_path,
)

GIB = 2**30
PIPE_WIDTH = 160

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


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control and bidirectional-formatting character written as an
    escape (``\x1b``, ``\u202e``), so that data (an id, a reason) can never move the
    cursor, change colours or reorder what a terminal shows."""
    if text.isprintable():
        return text
    out = []
    for character in text:
        if character == "\n" and keep_newlines:
            out.append(character)
        elif unicodedata.category(character) in ("Cc", "Cf", "Cs"):
            code = ord(character)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(character)
    return "".join(out)


def shown(value: object) -> str:
    """Data for a human table or line: control characters escaped, markup inert."""
    return escape(printable(str(value)))


class SafeConsole(Console):
    """A console that escapes control characters in what it writes (the styles it adds
    itself are not text, so they stay): the last guard for data printed for people."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            segment
            if segment.control or segment.text.isprintable()
            else Segment(printable(segment.text, keep_newlines=True), segment.style)
            for segment in buffer
        )


def fail(message: str, exit_code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``exit_code`` (a usage error)."""
    say_error(message)
    raise typer.Exit(exit_code)


def say_error(message: str) -> None:
    """``error: message`` on stderr, one line (``message`` is markup)."""
    SafeConsole(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]error:[/bold red] {message}", markup=True
    )


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn expected failures into one line on stderr and their exit code (no
    traceback): 2 usage, 3 refused by a rule, 4 store unavailable (:mod:`..exit_codes`)."""
    try:
        yield
    except (SchedulerError, CommandError, MissingExtraError) as error:
        fail(escape(str(error)), exit_code_of(error) or EXIT_REFUSED)
    except PersistenceError as error:
        fail(escape(f"database error: {type(error).__name__}: {error}"), EXIT_STORE_UNAVAILABLE)


def needs_extra(extra: str, command: str) -> None:
    """Exit with the usage code, after one line naming the extra, unless the
    installation has ``extra`` (:mod:`..extras`)."""
    try:
        require_extra(extra, f"secondbox-scheduler {command}")
    except MissingExtraError as error:
        fail(escape(str(error)), EXIT_USAGE)


@contextmanager
def store_errors(database_url: str) -> Iterator[None]:
    """Name the store (password hidden) in a database error."""
    try:
        yield
    except PersistenceError as error:
        detail = f"{type(error).__name__}: {error}".strip()
        raise CommandError(
            f"database error on {redact_url(database_url)}: {detail}", EXIT_STORE_UNAVAILABLE
        ) from None


def store_env(database_url: str) -> dict[str, str]:
    """Application settings for the store (the connect timeout is the application's,
    ``POSTGRES_CONNECT_TIMEOUT``, a few seconds unless set)."""
    return {DATABASE_URL: database_url}


def open_store(
    database_url: str, *, must_exist: bool = True, read_models: bool = True
) -> SchedulerApplication:
    """The application on the store; a missing SQLite file is a command error.
    ``read_models=False``: commands that only read the log (audit), which then need no
    write privilege at all (the read-only audit role, docs/operations.md)."""
    path = sqlite_path(database_url)
    if must_exist and path is not None and not path.exists():
        raise CommandError(
            f"no database at {path} ({database_url}); run `secondbox-scheduler simulate` "
            "first or pass --database-url",
            EXIT_STORE_UNAVAILABLE,
        )
    with store_errors(database_url):
        env = store_env(database_url)
        if not read_models:
            env[READ_MODELS] = "off"
        return SchedulerApplication(env=env)


def print_json(data: Any) -> None:
    """The data as indented JSON on stdout."""
    typer.echo(json.dumps(data, indent=2))


def stdout() -> Console:
    """Tables for people: the terminal's width, or wide enough not to fold when piped."""
    console = SafeConsole(highlight=False)
    if not console.is_terminal:
        console = SafeConsole(highlight=False, width=max(console.width, PIPE_WIDTH))
    return console


def gib(amount: int) -> str:
    """Bytes as whole GiB with thousands separators."""
    return f"{amount / GIB:,.0f}"


def format_time(value: datetime | None) -> str:
    """A time as ``YYYY-MM-DD HH:MM:SSZ``, or ``-`` for none."""
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")
