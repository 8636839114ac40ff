"""``list sandboxes``, ``list assignments``, ``list runners`` (a page at a time, with a
cursor) and ``events`` (the event feed): docs/api.md, "Lists" and "Event feed".

Each list prints one page of at most ``--limit`` items and, when more follow, the
``--cursor`` of the next page; with ``--json`` the page is ``{"items": [...],
"next": CURSOR | null}``. ``events`` prints the events after ``--after`` in log
order, filtered; with ``--follow`` it goes on printing new events as they are written
(until interrupted); with ``--json`` one JSON object a line (the HTTP feed's objects).
"""

from __future__ import annotations

import json
import threading
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

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
from secondbox_scheduler.infrastructure.cli.inspection import (
    assignment_json,
    assignment_table,
    runner_table,
)
from secondbox_scheduler.infrastructure.feed import lists
from secondbox_scheduler.infrastructure.feed.reading import MAX_LIMIT, follow
from secondbox_scheduler.infrastructure.feed.wire import event_json
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL

lists_cli = typer.Typer(
    help=(
        "List sandboxes, assignments (e.g. every uncertain one) and runners, a page at a "
        "time: pass the printed --cursor for the next page. Items are in creation order; "
        "paging to the end returns each item once while writes go on."
    ),
    no_args_is_help=True,
)
commands = typer.Typer()  # the top-level `events`

Limit = Annotated[
    int,
    typer.Option("--limit", min=1, help=f"Items per page (more than {MAX_LIMIT} is {MAX_LIMIT})."),
]
Cursor = Annotated[
    str | None, typer.Option("--cursor", help="The next page's cursor, as the last page printed.")
]
Pool = Annotated[str | None, typer.Option("--pool", help="Only this pool's.")]


def _page_out(
    items: list[dict[str, Any]], page: lists.Page[Any], table: Table, json_output: bool
) -> None:
    if json_output:
        print_json({"items": items, "next": page.next})
        return
    console = stdout()
    console.print(table)
    if page.next is not None:
        console.print(f"next page: --cursor {page.next}")


def _run(database_url: str, read: Any) -> Any:
    with reported_errors():
        app = open_store(database_url)
        try:
            with store_errors(database_url):
                return read(app)
        finally:
            app.close()


@lists_cli.command(
    "sandboxes",
    epilog="[bold]Examples[/bold]\n\n  secondbox-scheduler list sandboxes --pool edge --limit 50",
)
def list_sandboxes(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    limit: Limit = 100,
    cursor: Cursor = None,
    pool: Pool = None,
    home_runner: Annotated[
        str | None, typer.Option("--home-runner", help="Only those homed on this runner.")
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    """Sandboxes: pool, home runner, current generation and its assignment's state."""
    page = _run(
        database_url,
        lambda app: lists.list_sandboxes(
            app, cursor=cursor, limit=limit, pool_name=pool, home_runner_id=home_runner
        ),
    )
    table = Table(title=f"Sandboxes ({len(page.items)})", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("sandbox", "pool", "home runner", "gen", "state", "workspace", "created"):
        table.add_column(name)
    for item in page.items:
        table.add_row(
            shown(item.sandbox_id), shown(item.pool_name), shown(item.home_runner_id),
            str(item.generation), shown(item.state or "-"), shown(item.workspace_id),
            format_time(item.created_at),
        )  # fmt: skip
    _page_out([item.to_dict() for item in page.items], page, table, json_output)


@lists_cli.command(
    "assignments",
    epilog="[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler list assignments --state uncertain\n"
    "  secondbox-scheduler list assignments --runner general-01 --json",
)
def list_assignments(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    limit: Limit = 100,
    cursor: Cursor = None,
    state: Annotated[
        str | None,
        typer.Option(
            "--state", help="Only this state: assigned, running, released, failed, uncertain."
        ),
    ] = None,
    runner: Annotated[str | None, typer.Option("--runner", help="Only on this runner.")] = None,
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Only this sandbox's.")] = None,
    json_output: JsonOutput = False,
) -> None:
    """Every generation's assignment in the order they were fenced, as it is now."""
    page = _run(
        database_url,
        lambda app: lists.list_assignments(
            app, cursor=cursor, limit=limit, state=state, runner_id=runner, sandbox_id=sandbox
        ),
    )
    title = f"Assignments{f' {state}' if state else ''} ({len(page.items)})"
    table = assignment_table(page.items, title)
    _page_out([assignment_json(a) for a in page.items], page, table, json_output)


@lists_cli.command(
    "runners",
    epilog="[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler list runners --pool edge --drain-phase draining",
)
def list_runners(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    limit: Limit = 100,
    cursor: Cursor = None,
    pool: Pool = None,
    drain_phase: Annotated[
        str | None, typer.Option("--drain-phase", help="Only this phase: active, draining.")
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    """Registered runners in registration order (of a pool, in a drain phase)."""
    page = _run(
        database_url,
        lambda app: lists.list_runners(
            app, cursor=cursor, limit=limit, pool_name=pool, drain_phase=drain_phase
        ),
    )
    table = runner_table(page.items, pool)
    _page_out([s.model_dump(mode="json") for s in page.items], page, table, json_output)


@commands.command(
    "events",
    short_help="The event feed: events in log order, filtered; --follow for new ones.",
    epilog="[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler events --type Sandbox.AssignmentFenced\n"
    "  secondbox-scheduler events --after 120 --sandbox sbx-1 --follow --json",
)
def events(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    after: Annotated[int, typer.Option("--after", min=0, help="Events after this position.")] = 0,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="At most this many events.")
    ] = None,
    types: Annotated[
        list[str] | None,
        typer.Option("--type", help="Only this event type (repeatable): Sandbox.AssignmentFenced."),
    ] = None,
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", help="Only about this sandbox.")
    ] = None,
    runner: Annotated[str | None, typer.Option("--runner", help="Only about this runner.")] = None,
    pool: Pool = None,
    follow_new: Annotated[
        bool, typer.Option("--follow", help="Go on with new events as they are written.")
    ] = False,
    json_output: JsonOutput = False,
) -> None:
    """The events of the store's log after a position, in order: position, type, what
    it concerns, and who asked (its actor)."""
    console = stdout()
    stop = threading.Event()

    def show(app: Any) -> None:
        for printed, item in enumerate(follow(
            app, after, types=types or (), sandbox_id=sandbox, runner_id=runner,
            pool_name=pool, wait=follow_new, stop=stop,
        ), start=1):  # fmt: skip
            data = event_json(item)
            if json_output:
                typer.echo(json.dumps(data, separators=(",", ":")))
            else:
                about = " ".join(
                    f"{name}={shown(data[key])}"
                    for name, key in (("sandbox", "sandbox_id"), ("runner", "runner_id"))
                    if data[key] is not None
                )
                console.print(
                    f"{item.position:>8}  {shown(item.type):<32} {about:<40} "
                    f"by {shown(describe_actor(data['actor']))}",
                    highlight=False,
                )
            if limit is not None and printed >= limit:
                return

    _run(database_url, show)
