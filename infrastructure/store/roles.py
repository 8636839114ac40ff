"""Least-privilege PostgreSQL roles: a schema owner, an append-only application role,
and a read-only audit role (docs/operations.md).

:func:`grant_statements` is the SQL that ``secondbox-scheduler db grant`` runs as an
administrator, once the schema owner has created the tables (by starting the scheduler
once under the owner's role). The application role may INSERT and SELECT the events, the
chain, the snapshots and their seals, and use the read models and their tracking tables;
it may not UPDATE, DELETE or TRUNCATE the events or the chain: the server refuses. It
takes the events table's write lock through the owner's ``SECURITY DEFINER`` function
``<events>_lock()`` (EXECUTE granted to it alone), since ``LOCK TABLE ... IN EXCLUSIVE
MODE`` needs UPDATE, DELETE or TRUNCATE privilege. EXECUTE on ``<events>_append(...)``
and ``<events>_append_with_snapshots(...)`` (the saves of an unkeyed chain in one
statement, :mod:`.server_append`; ``SECURITY INVOKER``, so they insert with the
application role's own privileges) is likewise granted to the application role alone.

Both roles lose a transaction they leave idle: ``ALTER ROLE ... IN DATABASE ... SET
idle_in_transaction_session_timeout`` (``db grant --idle-in-transaction-timeout``,
default ``DEFAULT_IDLE_IN_TRANSACTION_SECONDS``), so that a session of either that takes
a lock (the events table's, an uncommitted INSERT's, an advisory lock inside a
transaction) and idles is ended by the server: a red team's did, and every writer
waited for it.
"""

from __future__ import annotations

from psycopg import Connection
from psycopg.sql import SQL, Composed, Identifier, Literal

from secondbox_scheduler.infrastructure.store.server_append import (
    APPEND_ARGUMENTS,
    APPEND_WITH_SNAPSHOTS_ARGUMENTS,
    append_function,
    append_with_snapshots_function,
)

APPEND_ONLY = ("events", "events_chain")  # suffixes of the append-only tables
PREFIX = "schedulerapplication_"
DEFAULT_IDLE_IN_TRANSACTION_SECONDS = 30


def grant_statements(
    connection: Connection[tuple[object, ...]],
    schema: str,
    owner: str,
    application: str,
    auditor: str | None = None,
    idle_in_transaction_timeout: float = DEFAULT_IDLE_IN_TRANSACTION_SECONDS,
) -> list[Composed]:
    """The statements that give ``application`` and ``auditor`` their privileges on the
    tables ``owner`` made in ``schema`` (and take every other privilege away), and end
    a transaction either leaves idle for ``idle_in_transaction_timeout`` seconds (0:
    never)."""
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
    append_only = {PREFIX + suffix for suffix in APPEND_ONLY}
    if not append_only <= set(tables):
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
        SQL("GRANT EXECUTE ON FUNCTION {}.{}() TO {}").format(s, lock, app),
    ]
    for function, arguments in (
        (append_function(PREFIX + "events"), APPEND_ARGUMENTS),
        (append_with_snapshots_function(PREFIX + "events"), APPEND_WITH_SNAPSHOTS_ARGUMENTS),
    ):  # the saves in one statement (a schema of an earlier release: none or one)
        if connection.execute(
            "SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname = %s",
            (schema, function),
        ).fetchone():
            signature = SQL("{}.{}(" + arguments + ")").format(s, Identifier(function))
            statements += [
                SQL("REVOKE ALL ON FUNCTION {} FROM PUBLIC").format(signature),
                SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(signature, app),
            ]
    statements.append(SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, app))
    for table in tables:
        t = Identifier(table)
        statements.append(SQL("REVOKE ALL ON {}.{} FROM {}").format(s, t, app))
        if table in append_only or table.startswith(PREFIX + "snapshots"):
            privileges = SQL("SELECT, INSERT")  # never UPDATE, DELETE or TRUNCATE
        else:  # read models and their tracking: rewritten as the log is projected
            privileges = SQL("SELECT, INSERT, UPDATE, DELETE")
        statements.append(SQL("GRANT {} ON {}.{} TO {}").format(privileges, s, t, app))
    if auditor:
        a = Identifier(auditor)
        statements += [
            SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, a),
            SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(s, a),
        ]
    database = Identifier(str(connection.info.dbname))
    idle = Literal(f"{int(idle_in_transaction_timeout * 1000)}ms")
    for role in (application, auditor) if auditor else (application,):
        statements.append(
            SQL("ALTER ROLE {} IN DATABASE {} SET idle_in_transaction_session_timeout = {}").format(
                Identifier(role), database, idle
            )
        )
    return statements


def grant(
    connection: Connection[tuple[object, ...]],
    schema: str,
    owner: str,
    application: str,
    auditor: str | None = None,
    idle_in_transaction_timeout: float = DEFAULT_IDLE_IN_TRANSACTION_SECONDS,
) -> list[str]:
    """Run :func:`grant_statements` in one transaction; returns them as text."""
    statements = grant_statements(
        connection, schema, owner, application, auditor, idle_in_transaction_timeout
    )
    with connection.transaction():
        for statement in statements:
            connection.execute(statement)
    return [statement.as_string(connection) for statement in statements]
