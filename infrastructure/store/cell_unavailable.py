"""A cell whose store has no writable primary: :class:`CellUnavailableError`.

A cell is one event store on its own PostgreSQL cluster (docs/operations.md, "Cells").
When its primary disappears, the application waits a bounded time for a writable
server (:mod:`.reconnect`: the multi-host URL's other hosts, with backoff) and then
fails the command with this error, which names the cell. It is a
:class:`~.startup.StoreUnavailableError` (reason ``unavailable``), so everything that
handles an unreachable store handles it too: HTTP 503 with ``Retry-After``, exit code 4,
``retryable``. A request it interrupted may have committed: retrying it is answered as a
serial execution would answer it (a retried ``schedule`` replays its assignment).
"""

from __future__ import annotations

from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError


class CellUnavailableError(StoreUnavailableError):
    """The store of cell ``cell`` has no writable primary (for now): retry later."""

    def __init__(self, cell: str, detail: str = "", *, target: str = "") -> None:
        self.cell = cell
        super().__init__("unavailable", f"cell {cell!r}" + (f" ({target})" if target else ""),
                         detail)  # fmt: skip
        self.retryable = True
