"""Least-privilege PostgreSQL roles (docs/operations.md): a schema owner, a
request-serving application role that writes only through the owner's functions, a
projector role that keeps the read models, and a read-only audit role.

:func:`grant_statements` is the SQL that ``secondbox-scheduler db grant`` runs as an
administrator, once the schema owner has created the tables (by starting the scheduler
once under the owner's role, with its read models). The application role gets SELECT on
every table of the schema and EXECUTE on the save functions (``<events>_append``,
``<events>_append_with_snapshots`` for an unkeyed chain, ``<events>_insert`` and
``<events>_link`` for a keyed one: ``SECURITY DEFINER``, owned by the schema owner,
:mod:`.server_append`, :mod:`.keyed_append`) and nothing else: no INSERT, UPDATE,
DELETE or TRUNCATE on any table, and no use of the sequences (positions come from the
functions). Found by the red team: with INSERT on the events, the chain and the
snapshots, the role hid events at position 0, planted a far-future link and stored a
forged snapshot; with UPDATE on the read models, it made the API serve false state and
stopped the projections.

The read models and their tracking tables are written by the projector role
(``--projector``: ``secondbox-scheduler projections run`` under it, the serving
replicas with ``SECONDBOX_READ_MODELS=external``), which may read the history and
write nothing else. Without ``--projector`` nobody but the owner writes them.

The application, projector and audit roles lose a transaction they leave idle:
``ALTER ROLE ... IN DATABASE ... SET idle_in_transaction_session_timeout`` (``db grant
--idle-in-transaction-timeout``, default ``DEFAULT_IDLE_IN_TRANSACTION_SECONDS``), so
that a session of any of them that takes
a lock (the events table's, an uncommitted INSERT's, an advisory lock inside a
transaction) and idles is ended by the server: a red team's did, and every writer
waited for it.
"""

from __future__ import annotations

from psycopg import Connection
from psycopg.sql import SQL, Composed, Identifier, Literal

from secondbox_scheduler.infrastructure.store.keyed_append import (
    INSERT_ARGUMENTS,
    LINK_ARGUMENTS,
)
from secondbox_scheduler.infrastructure.store.merkle_tables import EXTEND_ARGUMENTS
from secondbox_scheduler.infrastructure.store.server_append import (
    APPEND_ARGUMENTS,
    APPEND_WITH_SNAPSHOTS_ARGUMENTS,
)

HISTORY = ("events", "events_chain", "events_merkle", "snapshots", "snapshots_seal")
PREFIX = "schedulerapplication_"
SAVE_FUNCTIONS = (  # (name suffix, signature): the saves the application role may call
    ("events_append", APPEND_ARGUMENTS),
    ("events_append_with_snapshots", APPEND_WITH_SNAPSHOTS_ARGUMENTS),
    ("events_insert", INSERT_ARGUMENTS),
    ("events_link", LINK_ARGUMENTS),
    ("events_merkle_extend", EXTEND_ARGUMENTS),  # the tree, computed from the log alone
)
# (name suffix, signature): what the audit role may call besides reading: the tree's
# update computes it from the log and writes nothing else (merkle_tree.py)
AUDIT_FUNCTIONS = (("events_merkle_extend", EXTEND_ARGUMENTS),)
DEFAULT_IDLE_IN_TRANSACTION_SECONDS = 30


def grant_statements(
    connection: Connection[tuple[object, ...]],
    schema: str,
    owner: str,
    application: str,
    auditor: str | None = None,
    projector: str | None = None,
    idle_in_transaction_timeout: float = DEFAULT_IDLE_IN_TRANSACTION_SECONDS,
) -> list[Composed]:
    """The statements that give ``application``, ``projector`` and ``auditor`` their
    privileges on the tables ``owner`` made in ``schema`` (and take every other
    privilege away), and end a transaction any of them leaves idle for
    ``idle_in_transaction_timeout`` seconds (0: never)."""
    if not 0 <= idle_in_transaction_timeout <= 86400:  # also refuses NaN
        raise ValueError("the idle-in-transaction timeout is seconds from 0 to 86400")
    tables = [
        str(row[0])
        for row in connection.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tableowner = %s "
            "ORDER BY tablename",
            (schema, owner),
        ).fetchall()
    ]
    history = {PREFIX + suffix for suffix in HISTORY}
    if not {PREFIX + "events", PREFIX + "events_chain"} <= set(tables):
        raise LookupError(
            f"{schema}: the tables of the scheduler are not there, or not owned by {owner} "
            "(start the scheduler once as the schema owner first)"
        )
    s, app = Identifier(schema), Identifier(application)
    lock = Identifier(PREFIX + "events_lock")
    statements = [
        SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, app),
        SQL("REVOKE CREATE ON SCHEMA {} FROM {}").format(s, app),
        SQL("REVOKE ALL ON FUNCTION {}.{}() FROM PUBLIC").format(s, lock),
        SQL("REVOKE ALL ON FUNCTION {}.{}() FROM {}").format(s, lock, app),
        SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {} FROM {}").format(s, app),
    ]
    for suffix, arguments in SAVE_FUNCTIONS:
        function = PREFIX + suffix
        if _has_function(connection, schema, function):
            signature = SQL("{}.{}(" + arguments + ")").format(s, Identifier(function))
            statements += [
                SQL("REVOKE ALL ON FUNCTION {} FROM PUBLIC").format(signature),
                SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(signature, app),
            ]
    for table in tables:  # read only: every write goes through the functions
        t = Identifier(table)
        statements += [
            SQL("REVOKE ALL ON {}.{} FROM {}").format(s, t, app),
            SQL("GRANT SELECT ON {}.{} TO {}").format(s, t, app),
        ]
    if projector:
        p = Identifier(projector)
        statements += [
            SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, p),
            SQL("REVOKE CREATE ON SCHEMA {} FROM {}").format(s, p),
        ]
        for table in tables:
            t = Identifier(table)
            statements.append(SQL("REVOKE ALL ON {}.{} FROM {}").format(s, t, p))
            if table in history:
                privileges = SQL("SELECT")
            else:  # read models and their tracking: rewritten as the log is projected
                privileges = SQL("SELECT, INSERT, UPDATE, DELETE")
            statements.append(SQL("GRANT {} ON {}.{} TO {}").format(privileges, s, t, p))
    if auditor:
        a = Identifier(auditor)
        statements += [
            SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, a),
            SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(s, a),
        ]
        for suffix, arguments in AUDIT_FUNCTIONS:
            function = PREFIX + suffix
            if _has_function(connection, schema, function):
                signature = SQL("{}.{}(" + arguments + ")").format(s, Identifier(function))
                statements.append(SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(signature, a))
    database = Identifier(str(connection.info.dbname))
    idle = Literal(f"{int(idle_in_transaction_timeout * 1000)}ms")
    for role in (r for r in (application, projector, auditor) if r):
        statements.append(
            SQL("ALTER ROLE {} IN DATABASE {} SET idle_in_transaction_session_timeout = {}").format(
                Identifier(role), database, idle
            )
        )
    return statements


def _has_function(connection: Connection[tuple[object, ...]], schema: str, name: str) -> bool:
    return bool(
        connection.execute(
            "SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname = %s",
            (schema, name),
        ).fetchone()
    )


def grant(
    connection: Connection[tuple[object, ...]],
    schema: str,
    owner: str,
    application: str,
    auditor: str | None = None,
    projector: str | None = None,
    idle_in_transaction_timeout: float = DEFAULT_IDLE_IN_TRANSACTION_SECONDS,
) -> list[str]:
    """Run :func:`grant_statements` in one transaction; returns them as text."""
    statements = grant_statements(
        connection, schema, owner, application, auditor, projector, idle_in_transaction_timeout
    )
    with connection.transaction():
        for statement in statements:
            connection.execute(statement)
    return [statement.as_string(connection) for statement in statements]
