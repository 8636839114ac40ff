"""The access tokens as each request of the service sees them: read from the store at
most every ``SECONDBOX_TOKEN_REFRESH_SECONDS`` (default 1 s).

A replica serves requests with the tokens it read at most that long ago, then reads
what was issued or revoked since (one query: the stream's events after the version it
holds). So an issue or a revocation on any replica is seen by every replica within the
refresh interval plus the time of one read; an expiry is checked against the clock at
every request. 0 reads at every request.

A replica that has never read the tokens and cannot (the store is unavailable) fails
the request (503 ``store_unavailable``): never a request let through on tokens it
could not read. One that read them before and cannot read them again keeps the tokens it
read, and tries again after the interval (a warning in its log): while its store is
unavailable the only routes that answer anyway are ``/metrics`` (where ``store_up``
says so) and the OpenAPI document, and a revocation cannot be written then either.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from eventsourcing.persistence import PersistenceError

from secondbox_scheduler.domain.access_tokens import AccessTokens
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.ids import access_tokens_uuid
from secondbox_scheduler.infrastructure.access.tokens import load_tokens
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError

TOKEN_REFRESH_SECONDS = "SECONDBOX_TOKEN_REFRESH_SECONDS"
DEFAULT_TOKEN_REFRESH_SECONDS = 1.0
MAX_TOKEN_REFRESH_SECONDS = 60.0
log = logging.getLogger("secondbox_scheduler.access")


def token_refresh_seconds(value: str | None) -> float:
    """The refresh interval setting: seconds, from 0 to 60; 1 when unset."""
    if not value:
        return DEFAULT_TOKEN_REFRESH_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_TOKEN_REFRESH_SECONDS:  # also refuses NaN
        raise InvalidRequestError(
            TOKEN_REFRESH_SECONDS,
            f"must be a number of seconds from 0 to {MAX_TOKEN_REFRESH_SECONDS:g}",
            value,
        )
    return seconds


class TokenCache:
    """The access tokens of one application, re-read when older than the interval."""

    def __init__(
        self,
        app: Any,
        refresh_seconds: float | None = None,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        if refresh_seconds is None:
            refresh_seconds = token_refresh_seconds(app.env.get(TOKEN_REFRESH_SECONDS))
        self.refresh_seconds = refresh_seconds
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._tokens: AccessTokens | None = None
        self._read_at = -math.inf
        self._read_once = False

    def fresh(self) -> bool:
        """Whether the tokens held were read within the interval."""
        return self._monotonic() - self._read_at < self.refresh_seconds

    @property
    def held(self) -> AccessTokens | None:
        """The tokens as last read (only when :meth:`fresh`)."""
        return self._tokens

    def current(self) -> AccessTokens | None:
        """The tokens, read again first when older than the interval (blocking: one
        query; concurrent callers wait for one read). None: no token was ever issued.
        The store's error when they were never read and cannot be."""
        if self.fresh():
            return self._tokens
        with self._lock:
            if not self.fresh():
                try:
                    self._read()
                except (PersistenceError, StoreUnavailableError, CellUnavailableError) as error:
                    if not self._read_once:
                        raise
                    log.warning("access tokens not read again (kept as read): %s", error)
                    self._read_at = self._monotonic()
            return self._tokens

    def _read(self) -> None:
        started = self._monotonic()
        tokens = self._tokens
        if tokens is None:
            tokens = load_tokens(self.app)  # a copy of its own, from the last snapshot
        else:  # only what was recorded since (a dict lookup at a time reads it safely)
            for event in self.app.events.get(access_tokens_uuid(), gt=tokens.version):
                tokens = event.mutate(tokens)
        self._tokens = tokens
        self._read_at = started
        self._read_once = True
