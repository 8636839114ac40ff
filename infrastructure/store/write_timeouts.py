"""How long a save on PostgreSQL may wait: the write lock timeout and the write
statement timeout (docs/operations.md, "Timeouts").

Found by a red team: a session of the application role that took the events table's
lock (``<events>_lock()``) or held an uncommitted INSERT, and then idled, made every
writer wait for the whole hold (no lock timeout). Now each save sets ``lock_timeout``
(``SECONDBOX_WRITE_LOCK_TIMEOUT_MS``, default 2,000) for its transaction, which bounds
every lock it waits for: the events table's, a row's or a unique key's an uncommitted
INSERT holds, the notification queue's; and ``statement_timeout``
(``SECONDBOX_WRITE_STATEMENT_TIMEOUT_MS``, default 10,000; 0: none) bounds each of its
statements as a whole. A save that hits either raises :class:`WriteTimeoutError`, an
``IntegrityError``: the command retries it as a lost race within its retry budget
(:mod:`..retrying`), then answers ``SerializationContentionError``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from eventsourcing.persistence import IntegrityError, OperationalError
from psycopg import errors

from secondbox_scheduler.domain.errors import InvalidRequestError

WRITE_LOCK_TIMEOUT_MS = "SECONDBOX_WRITE_LOCK_TIMEOUT_MS"
WRITE_STATEMENT_TIMEOUT_MS = "SECONDBOX_WRITE_STATEMENT_TIMEOUT_MS"
DEFAULT_WRITE_LOCK_TIMEOUT_MS = 2000
DEFAULT_WRITE_STATEMENT_TIMEOUT_MS = 10000
MAX_TIMEOUT_MS = 3_600_000

F = TypeVar("F", bound=Callable[..., Any])


class WriteTimeoutError(IntegrityError):
    """A save gave up waiting for a lock (``lock_timeout``) or for its statement
    (``statement_timeout``): nothing of it was stored. Contention, retried as a lost
    race."""


def milliseconds(env: Mapping[str, str] | Any, name: str, default: int) -> int:
    """A timeout setting in milliseconds, from 0 (none) to an hour."""
    value = env.get(name) or ""
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 <= number <= MAX_TIMEOUT_MS:  # also refuses NaN
        raise InvalidRequestError(name, f"must be milliseconds from 0 to {MAX_TIMEOUT_MS}", value)
    return int(number)


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` (the library's, or psycopg's) is a lock or statement timeout."""
    cause = error if isinstance(error, errors.Error) else error.__cause__
    return isinstance(cause, errors.LockNotAvailable | errors.QueryCanceled)


def timeouts_as_contention(function: F) -> F:
    """``function`` (a save) with its lock and statement timeouts raised as
    :class:`WriteTimeoutError` (not the library's ``OperationalError``, which its
    recorders retry ten times, each waiting the whole timeout again)."""

    @functools.wraps(function)
    def saving(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except OperationalError as error:
            if is_timeout(error):
                raise WriteTimeoutError(f"the save gave up waiting: {error}") from error
            raise

    return saving  # type: ignore[return-value]
