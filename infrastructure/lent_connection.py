"""A connection lent to a save: the session that holds a placement batch's runner locks.

A batch holds advisory locks on its home runners while it decides and commits
(:mod:`.runner_locks`), on a session of its own. Its save would then take a second
connection from the store's pool, and the locks were released by a third round trip
after the commit: rivals waiting for those runners waited for it too. Lent that session
(:func:`lend`, per thread), the save of an unkeyed chain (``<events>_append``,
:mod:`.event_chain`) sends ``BEGIN``, the append, ``COMMIT`` and the release (``then``)
in one pipeline: one round trip, and the locks are let go right after the commit, never
before it (the server runs the pipeline in order). A failed save releases nothing (the
rest of the pipeline is skipped; the transaction is rolled back), and the locks are
released as before, when the batch lets go of them.

A session that is closed, broken or inside a transaction, or lent for another store,
is not used: the save takes a connection of the pool, as without the lend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from eventsourcing.persistence import (
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    InternalError,
    NotSupportedError,
    OperationalError,
    PersistenceError,
    ProgrammingError,
)
from psycopg.pq import TransactionStatus

_local = threading.local()

# psycopg's errors as the library's datastore maps them (PostgresDatastore.get_connection)
_ERRORS: tuple[tuple[type[psycopg.Error], type[PersistenceError]], ...] = (
    (psycopg.InterfaceError, InterfaceError),
    (psycopg.OperationalError, OperationalError),
    (psycopg.DataError, DataError),
    (psycopg.IntegrityError, IntegrityError),
    (psycopg.InternalError, InternalError),
    (psycopg.ProgrammingError, ProgrammingError),
    (psycopg.NotSupportedError, NotSupportedError),
    (psycopg.DatabaseError, DatabaseError),
)


@dataclass
class Lent:
    """A session lent to the saves of ``datastore`` in this thread, and what to run on
    it after a save's commit (``then``; ``done()`` is called once it ran)."""

    datastore: object
    connection: psycopg.Connection[Any]
    then: bytes
    done: Callable[[], None]
    used: bool = False  # ``then`` ran: lent no more


@contextmanager
def lend(lent: Lent | None) -> Iterator[None]:
    """Lend ``lent`` to the saves this thread makes within the block (None: nothing)."""
    if lent is None:
        yield
        return
    previous = getattr(_local, "lent", None)
    _local.lent = lent
    try:
        yield
    finally:
        _local.lent = previous


def lent_to(datastore: object) -> Lent | None:
    """The session lent to a save of ``datastore`` in this thread, if it can take one."""
    lent: Lent | None = getattr(_local, "lent", None)
    if lent is None or lent.used or lent.datastore is not datastore:
        return None
    connection = lent.connection
    if (
        connection.closed
        or connection.broken
        or connection.info.transaction_status != TransactionStatus.IDLE
    ):
        return None
    return lent


def translated(error: psycopg.Error) -> PersistenceError:
    """The library's error for a psycopg error (as its datastore raises them)."""
    for raised, mapped in _ERRORS:
        if isinstance(error, raised):
            return mapped(str(error))
    return PersistenceError(str(error))


def rolled_back(connection: psycopg.Connection[Any]) -> None:
    """End a failed explicit transaction on ``connection`` (a broken one is closed)."""
    try:
        if not connection.closed and connection.info.transaction_status in (
            TransactionStatus.INERROR,
            TransactionStatus.INTRANS,
        ):
            connection.execute(b"ROLLBACK")
    except psycopg.Error:
        connection.close()
