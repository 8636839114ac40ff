"""The typed error of a cell whose store cannot be reached (docs/operations.md, "Cells").

A deployment of several cells (``infrastructure/cells/``) sends each command to the one
cell that owns it; when that cell's PostgreSQL cannot be reached (refused, no answer
within the connect timeout, lost under a command, or its reconnect budget spent), the
command fails with this error naming the cell, and only that cell's commands do. It is
retryable: the HTTP answer is 503 with ``Retry-After``, the command line's exit code is
4 (the store unavailable).
"""

from __future__ import annotations

from secondbox_scheduler.domain.errors import SchedulerError


class CellUnavailableError(SchedulerError):
    """The store of cell ``cell`` is unavailable; ``detail`` says what failed."""

    retryable = True

    def __init__(self, cell: str, detail: str = "", *, target: str = "") -> None:
        self.cell = cell
        self.detail = detail
        self.target = target  # where its store is (never a password), if known
        message = f"SecondBox scheduler cell {cell!r} unavailable"
        if target:
            message = f"{message} ({target})"
        super().__init__(f"{message}: {detail}" if detail else message)
