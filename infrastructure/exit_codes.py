"""The exit codes of the command line (docs/spec.md (section 8.4)), and which error
ends a command with which.

====  ===================  ==========================================================
code  name                 when
====  ===================  ==========================================================
0     ok                   the command did what it was asked
1     violation found      ``verify``, ``audit verify``, ``projections verify``,
                           ``simulate``'s ledger check, ``audit whatif`` that does not
                           reproduce the log, ``bench`` whose run broke an invariant:
                           the check ran and found something wrong
2     usage error          an unknown option or a bad value (the field and the rule are
                           named), a store ``simulate`` may not write into, a missing
                           extra of the installation: change the command or the install
3     refused by a rule    the scheduler refused the command (not found, stale fence,
                           conflict, no compatible runner, contention past the retries)
4     store unavailable    the store cannot be reached, opened or used (no such SQLite
                           file, connection refused, timeout, a database error, a read
                           model ahead of the log: ``projections rebuild``)
70    internal error       a fault of the scheduler (``SECONDBOX_DEBUG=1`` shows the
                           traceback; please report it)
130   interrupted          Ctrl-C
====  ===================  ==========================================================

This module imports nothing optional: the console script's entry point uses it before it
knows that the command line's extra is installed.
"""

from __future__ import annotations

from eventsourcing.persistence import PersistenceError

from secondbox_scheduler.domain.errors import InvalidRequestError, SchedulerError
from secondbox_scheduler.infrastructure.extras import MissingExtraError
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.startup import StoreUnavailableError
from secondbox_scheduler.projections.read_models import ReadModelAheadError

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_STORE_UNAVAILABLE = 4
EXIT_INTERNAL = 70  # EX_SOFTWARE of sysexits.h
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_VIOLATION: "violation found",
    EXIT_USAGE: "usage error",
    EXIT_REFUSED: "refused by a rule",
    EXIT_STORE_UNAVAILABLE: "store unavailable",
    EXIT_INTERNAL: "internal error",
}


class CommandError(Exception):
    """A problem of the command's input or environment, reported as one line and
    ``exit_code`` (a usage error unless said otherwise)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_of(error: BaseException) -> int | None:
    """The exit code an expected error ends a command with; None for anything else (a
    fault: :data:`EXIT_INTERNAL`)."""
    if isinstance(error, CommandError):
        return error.exit_code
    if isinstance(error, (InvalidRequestError, MissingExtraError)):
        return EXIT_USAGE
    if isinstance(
        error,
        (StoreUnavailableError, CellUnavailableError, PersistenceError, ReadModelAheadError),
    ):
        return EXIT_STORE_UNAVAILABLE
    if isinstance(error, SchedulerError):
        return EXIT_REFUSED
    return None
