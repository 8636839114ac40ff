"""The commands that move assignments on: ``reconcile``, and ``release`` by hand with proof."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer

from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    fail,
    open_store,
    print_json,
    reported_errors,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL

# This module's top-level commands; the package's __init__ adds them to the app `cli`.
commands = typer.Typer()


@commands.command(
    "reconcile",
    help=(
        "Claim due assignments (from the assignments projection) and apply the reconcile "
        "policy: an assignment never reported running past its operation deadline fails "
        "with deadline_exceeded (redelivered while retries remain, else terminally failed); "
        "one whose home runner's heartbeat expired becomes uncertain (it keeps its "
        "reservation: its compute may still run). No relocation, no replacement. Then sets "
        "next_reconcile_at and releases the claim. Loops until interrupted; several "
        "reconcilers on one database never work the same assignment at the same time.\n\n"
        "[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler reconcile --once\n"
        "  secondbox-scheduler reconcile --owner reconciler-a --interval 30"
    ),
)
def reconcile(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    owner: Annotated[
        str | None, typer.Option("--owner", help="Claim owner name (default host-pid).")
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Reconcile until nothing is due, then exit.")
    ] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.001, help="Seconds until an assignment is due again."),
    ] = 60.0,
    claim_ttl: Annotated[
        float, typer.Option("--claim-ttl", min=0.001, help="Seconds a claim lasts.")
    ] = 30.0,
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            "--heartbeat-timeout",
            min=0.001,
            help="Seconds of heartbeat silence that make a runner's assignments uncertain.",
        ),
    ] = 30.0,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Due assignments per pass.")] = 100,
    poll: Annotated[
        float, typer.Option("--poll", min=0.01, help="Seconds between empty passes.")
    ] = 1.0,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.reconciler import Reconciler

    with reported_errors(), store_errors(database_url):
        app = open_store(database_url)
        reconciler = Reconciler(
            app,
            owner,
            heartbeat_timeout=timedelta(seconds=heartbeat_timeout),
            claim_ttl=timedelta(seconds=claim_ttl),
            interval=timedelta(seconds=interval),
            batch=batch,
        )
        try:
            if once:
                reconciler.drain(poll=poll)
            else:
                reconciler.run(poll=poll)
        except KeyboardInterrupt:
            pass
        finally:
            app.close()
    report = reconciler.report.to_dict()
    if as_json:
        print_json({"owner": reconciler.owner, **report})
    else:
        stdout().print(f"reconciler {reconciler.owner}: {report}")


@commands.command(
    "release",
    help=(
        "Release an assignment's reservation by hand, with proof that its compute has "
        "stopped (for a failed or uncertain assignment whose runner will never report). "
        "Needs the current generation and fencing token; a repeat with the same proof "
        "changes nothing.\n\n[bold]Example[/bold]\n\n"
        "  secondbox-scheduler release --sandbox sbx-1 --generation 2 --token 3f… "
        "--proof operator=alice --proof reason=host-destroyed"
    ),
)
def release_by_hand(
    sandbox: Annotated[str, typer.Option("--sandbox", help="Sandbox id.")],
    generation: Annotated[int, typer.Option("--generation", help="Current generation.")],
    token: Annotated[str, typer.Option("--token", help="Fencing token, hex.")],
    proof: Annotated[
        list[str], typer.Option("--proof", help="Release proof entry KEY=VALUE (repeatable).")
    ],
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    entries = dict(item.split("=", 1) for item in proof if "=" in item)
    if len(entries) != len(proof):
        fail("--proof takes KEY=VALUE")
    try:
        fencing_token = bytes.fromhex(token)
    except ValueError:
        fail("--token must be hex")
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url)
        released = app.release(sandbox, generation, fencing_token, entries)
        app.close()
    if as_json:
        print_json({"sandbox_id": sandbox, "generation": generation, "released": released})
    else:
        stdout().print("released" if released else "already released with this proof")
