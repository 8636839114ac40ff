"""The ``db`` command group: least-privilege roles on PostgreSQL (docs/operations.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from secondbox_scheduler.infrastructure.cli.common import DatabaseUrl, reported_errors, stdout

db_cli = typer.Typer(
    help="PostgreSQL administration: the roles the scheduler runs under. See docs/operations.md.",
    no_args_is_help=True,
)


@db_cli.command(
    "grant",
    help=(
        "Give the request-serving application role SELECT on every table and EXECUTE on "
        "the schema owner's save functions (it writes the history only through them, and "
        "holds no INSERT, UPDATE, DELETE or TRUNCATE on any table); a projector role "
        "SELECT on the history and the writes of the read models and their tracking "
        "(run `projections run` under it, the replicas with SECONDBOX_READ_MODELS=external); "
        "and an audit role SELECT only. Run it as an administrator after the schema owner "
        "has started the scheduler once "
        "(which creates the tables). Prints each statement.\n\n[bold]Example[/bold]\n\n"
        "  secondbox-scheduler db grant --database-url postgresql://postgres@db/secondbox "
        "--owner secondbox_owner --app secondbox_app --projector secondbox_projector "
        "--auditor secondbox_audit"
    ),
)
def db_grant(
    owner: Annotated[str, typer.Option("--owner", help="The role that owns the tables.")],
    app: Annotated[str, typer.Option("--app", help="The application's role.")],
    database_url: DatabaseUrl,
    auditor: Annotated[
        str | None, typer.Option("--auditor", help="A read-only role for audit.")
    ] = None,
    projector: Annotated[
        str | None,
        typer.Option("--projector", help="The role that writes the read models (projections)."),
    ] = None,
    schema: Annotated[str, typer.Option("--schema", help="The scheduler's schema.")] = "public",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the statements without running them.")
    ] = False,
    idle_in_transaction_timeout: Annotated[
        float,
        typer.Option(
            "--idle-in-transaction-timeout",
            min=0,
            max=86400,
            help=(
                "Seconds after which the server ends a transaction the application or "
                "audit role leaves idle (and the locks it holds); 0: never."
            ),
        ),
    ] = 30,
) -> None:
    from secondbox_scheduler.infrastructure.settings import settings_from_url
    from secondbox_scheduler.infrastructure.store.roles import grant, grant_statements
    from secondbox_scheduler.infrastructure.store.startup import connect_postgres

    with reported_errors():
        connection = connect_postgres(settings_from_url(database_url))
        with connection:
            if dry_run:
                done = [
                    s.as_string(connection)
                    for s in grant_statements(
                        connection,
                        schema,
                        owner,
                        app,
                        auditor,
                        projector,
                        idle_in_transaction_timeout,
                    )
                ]
            else:
                done = grant(
                    connection,
                    schema,
                    owner,
                    app,
                    auditor,
                    projector,
                    idle_in_transaction_timeout,
                )
    for statement in done:
        stdout().print(statement + ";", highlight=False, soft_wrap=True)
