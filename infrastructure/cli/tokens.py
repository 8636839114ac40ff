"""The ``tokens`` command group: issue, list and revoke the HTTP service's access tokens.

The tokens live in the store (every ``serve`` replica on it sees them, within its
refresh interval); each command writes or reads them directly, as the database URL's
role. See docs/operations.md, "Access".
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from secondbox_scheduler.domain.access_tokens import ROLES
from secondbox_scheduler.domain.actors import describe_actor
from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    format_time,
    open_store,
    print_json,
    reported_errors,
    shown,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL

tokens_cli = typer.Typer(
    help=(
        "Access tokens of the HTTP service (serve): each has one role, runner (for the "
        "runner ids it names: register, heartbeat, reports on its assignments), "
        "control-plane (sandbox and runner commands, reads), auditor (reads and audit "
        "only) or admin (tokens, drains, deregistration, reads). Once any token exists, "
        "every route but /healthz and /readyz needs one. The store keeps only each "
        "token's SHA-256: a token is shown once, when it is created. See "
        'docs/operations.md, "Access".'
    ),
    no_args_is_help=True,
)
_DURATION = re.compile(r"([1-9][0-9]{0,5})([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def expiry(value: str | None, now: datetime) -> datetime | None:
    """``--expires``: a duration (``90m``, ``12h``, ``30d``) or an RFC 3339 time."""
    if value is None:
        return None
    duration = _DURATION.fullmatch(value.strip())
    if duration:
        amount, unit = duration.groups()
        return now + timedelta(**{_UNITS[unit]: int(amount)})
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise typer.BadParameter(
            "give a duration (90m, 12h, 30d) or a time with its zone (2027-01-01T00:00:00Z)",
            param_hint="'--expires'",
        )
    return when.astimezone(UTC)


@tokens_cli.command(
    "create",
    help=(
        "Create a token and print it, this once (the store keeps its SHA-256 only).\n\n"
        "[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler tokens create --role control-plane\n"
        "  secondbox-scheduler tokens create --role runner --runner general-01 --expires 30d\n"
        "  secondbox-scheduler tokens create --role admin --json"
    ),
)
def tokens_create(
    role: Annotated[
        str, typer.Option("--role", help=f"One of {', '.join(ROLES)}.", show_default=False)
    ],
    runners: Annotated[
        list[str] | None,
        typer.Option("--runner", help="A runner id the runner token acts for (repeat: several)."),
    ] = None,
    expires: Annotated[
        str | None,
        typer.Option(
            "--expires",
            help="When it stops working: a duration (90m, 12h, 30d) or an RFC 3339 time "
            "[default: never, until revoked].",
            show_default=False,
        ),
    ] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.access.tokens import issue_token

    if role not in ROLES:
        raise typer.BadParameter(f"one of {', '.join(ROLES)}", param_hint="'--role'")
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, must_exist=False)
        try:
            issued = issue_token(
                app,
                role=role,
                runner_ids=list(runners or ()),
                expires_at=expiry(expires, app.now()),
            )
        finally:
            app.close()
    if as_json:
        print_json({"id": issued.token_id, "role": issued.role, "token": issued.token})
        return
    runners_text = f" for runner(s) {', '.join(issued.runner_ids)}" if issued.runner_ids else ""
    until = "until revoked" if issued.expires_at is None else (
        f"until {format_time(issued.expires_at)}"
    )  # fmt: skip
    console = stdout()
    console.print(
        f"token {issued.token_id} (role {issued.role}{shown(runners_text)}), valid {until}; "
        "shown this once, keep it secret:"
    )
    console.print(issued.token, highlight=False, soft_wrap=True)


@tokens_cli.command(
    "list",
    help=(
        "Every token ever created: id, role, runners, when issued, when it expires or was "
        "revoked, and its state (never the token).\n\n[bold]Example[/bold]\n\n"
        "  secondbox-scheduler tokens list --json"
    ),
)
def tokens_list(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL, as_json: JsonOutput = False
) -> None:
    from secondbox_scheduler.infrastructure.access.tokens import list_tokens

    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        try:
            found = list_tokens(app)
        finally:
            app.close()
    if as_json:
        print_json([token.to_dict() for token in found])
        return
    table = Table(title=f"Access tokens ({len(found)})", box=box.SIMPLE)
    for column in ("id", "role", "runners", "issued", "by", "expires", "revoked", "state"):
        table.add_column(column)
    for token in found:
        table.add_row(
            token.token_id,
            token.role,
            shown(", ".join(token.runner_ids) or "-"),
            format_time(token.issued_at),
            shown(describe_actor(token.issued_by)),
            format_time(token.expires_at),
            format_time(token.revoked_at),
            token.state,
        )
    stdout().print(table)


@tokens_cli.command(
    "revoke",
    help=(
        "Revoke a token: every serve replica refuses it within its refresh interval "
        "(SECONDBOX_TOKEN_REFRESH_SECONDS, default 1 s). Revoking it again changes "
        "nothing.\n\n[bold]Example[/bold]\n\n  secondbox-scheduler tokens revoke 3f9a1c0b2d4e"
    ),
)
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(metavar="ID", help="The token's id.")],
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.access.tokens import revoke_token

    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        try:
            revoked = revoke_token(app, token_id)
        finally:
            app.close()
    if as_json:
        print_json({"id": token_id, "revoked": revoked})
        return
    done = "revoked" if revoked else "was revoked already"
    stdout().print(f"token {shown(token_id)} {done}")
