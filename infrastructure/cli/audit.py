"""The ``audit`` command group: verify, state, timeline, explain and whatif, replayed from
the events (``whatif``'s options and report are in :mod:`.whatif`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from secondbox_scheduler.domain.actors import describe_actor
from secondbox_scheduler.infrastructure.cells.config import CELLS, load_cells
from secondbox_scheduler.infrastructure.cli.audit_log import (
    CHECK_PROOF_HELP,
    KEYGEN_HELP,
    PROVE_HELP,
    WITNESS_HELP,
    check_proof,
    keygen,
    prove,
    signer_of,
    verify_checks,
    witness,
    write_state,
)
from secondbox_scheduler.infrastructure.cli.cells import CellsFile, open_router
from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    format_time,
    open_store,
    print_json,
    reported_errors,
    say_error,
    shown,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.cli.inspection import (
    assignment_json,
    assignment_table,
    runner_table,
)
from secondbox_scheduler.infrastructure.cli.whatif import WHATIF_HELP, audit_whatif
from secondbox_scheduler.infrastructure.exit_codes import EXIT_USAGE, CommandError
from secondbox_scheduler.infrastructure.settings import CHECKPOINT_KEY, DEFAULT_SQLITE_URL

if TYPE_CHECKING:
    from secondbox_scheduler.infrastructure.audit.signed_notes import Signer
    from secondbox_scheduler.infrastructure.audit.verify import AuditReport, ChainReport

audit_cli = typer.Typer(
    help=(
        "Audit replay of the scheduling history from the events alone: verify every "
        "invariant, show the state at any point, timelines, and why each placement was "
        "made. See docs/audit.md."
    ),
    no_args_is_help=True,
)
CELL_AUDITS = frozenset({"verify", "checkpoint"})  # the audits over every cell


@audit_cli.callback()
def _audit(context: typer.Context) -> None:
    """The audit commands (a cells file only for verify and checkpoint)."""
    cells = os.environ.get(CELLS)
    if cells and context.invoked_subcommand not in CELL_AUDITS:
        say_error(
            shown(
                f"audit {context.invoked_subcommand} acts on one store: give --database-url "
                f"of one cell, not a cells file ({cells}; unset {CELLS})"
            )
        )
        raise typer.Exit(EXIT_USAGE)


UntilOption = Annotated[
    str | None,
    typer.Option(
        "--until", help="Stop at a notification POSITION or at the first event after an ISO TIME."
    ),
]


@audit_cli.command(
    "verify",
    help=(
        "Replay the whole notification log through a pure fold (no cache, no projection) and "
        "check invariants 1 to 6 after every event, and every placement against the "
        "reconstructed runner state and its recorded evidence. Exits 1 listing each "
        "violation (position, aggregate, event, rule).\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler audit verify\n"
        "  secondbox-scheduler audit verify --until 2026-11-29T12:00:00Z --json"
    ),
)
def audit_verify(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    until: UntilOption = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            help=(
                "Also fail unless the log still extends this checkpoint: POSITION:DIGEST as "
                "`audit checkpoint` prints it, or the DIGEST alone (give the same "
                "SECONDBOX_AUDIT_KEY as when it was taken), or a signed checkpoint FILE "
                "(`audit checkpoint --sign-key`): the log's Merkle tree at its size must "
                "have its root. Truncated, rewritten or rolled back logs fail."
            ),
        ),
    ] = None,
    log_key: Annotated[
        str | None,
        typer.Option(
            "--log-key",
            help="The log's verifier key: a signed checkpoint must carry its signature.",
        ),
    ] = None,
    witness_keys: Annotated[
        list[str] | None,
        typer.Option(
            "--witness",
            help=(
                "A witness's verifier key: the signed checkpoint (--checkpoint FILE or "
                "--since FILE) must be co-signed by it (repeat for several)."
            ),
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help=(
                "Re-audit only the events after this signed checkpoint FILE: the log must "
                "extend it (consistency proof), and the fold starts from the state sealed "
                "at it (--since-state)."
            ),
        ),
    ] = None,
    since_state: Annotated[
        str | None,
        typer.Option(
            "--since-state", help="The fold state sealed at the --since checkpoint (a FILE)."
        ),
    ] = None,
    save_state: Annotated[
        str | None,
        typer.Option(
            "--save-state",
            help=(
                "Write the fold state sealed where this verify ends to FILE, for a later "
                "--since: at the signed --checkpoint FILE's size when one is given."
            ),
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            help=(
                "Processes to verify with: 1, this one only; 2, the fold and the snapshot "
                "check here, the "
                "chain and Merkle checks in a second process; 3 (or more), the snapshot "
                "check in a third. The findings are the same. Default: 2 on a machine "
                "with two cores or more, else 1 (a verify by time, or with --since or "
                "--save-state, runs in one process)."
            ),
        ),
    ] = None,
    as_json: JsonOutput = False,
    cells: CellsFile = None,
) -> None:
    from secondbox_scheduler.infrastructure.audit.log_fold import parse_until
    from secondbox_scheduler.infrastructure.audit.verify import verify

    if cells is not None:
        if witness_keys or since is not None or since_state is not None or log_key:
            raise typer.BadParameter(
                "over cells, verify with --checkpoint FEDERATION only: the Merkle options "
                "(--since, --since-state, --witness, --log-key) are for one cell's log",
                param_hint="'--cells'",
            )
        _verify_cells(cells, until, checkpoint, as_json)
        return
    if witness_keys and checkpoint is None and since is None:
        raise typer.BadParameter(
            "--witness needs a signed checkpoint: --checkpoint FILE or --since FILE",
            param_hint="'--witness'",
        )
    if (since is None) != (since_state is None):
        raise typer.BadParameter(
            "--since CHECKPOINT and --since-state FILE go together", param_hint="'--since'"
        )
    expected, merkle = verify_checks(checkpoint, log_key, witness_keys or [], since, since_state)
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        limit = parse_until(until)
        total = app.event_count()
        with Progress(
            TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(stderr=True), disable=as_json, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("verify", total=total)
            report = verify(
                app,
                limit,
                progress=lambda n: bar.advance(task, n),
                checkpoint=expected,
                merkle=merkle,
                save_state=save_state is not None,
                workers=workers,
            )
        app.close()
    if save_state is not None:
        write_state(save_state, report.state)
    if as_json:
        print_json(report.to_dict())
    else:
        console = stdout()
        for violation in report.violations:
            console.print(f"[red]violation[/red] {shown(str(violation))}")
        verdict = (
            "[green]OK[/green]"
            if report.ok
            else f"[red]{len(report.violations)} violation(s)[/red]"
        )
        console.print(
            f"{verdict}: {report.events:,} events checked up to position {report.position:,} in "
            f"{report.seconds:.2f}s ({report.events_per_second:,.0f} events/s; raw notification "
            f"read {report.raw_events_per_second:,.0f} events/s)"
        )
        console.print(chain_line(report.chain))
        console.print(merkle_line(report, save_state))
    if not report.ok:
        raise typer.Exit(1)


def _verify_cells(cells: Path, until: str | None, checkpoint: str | None, as_json: bool) -> None:
    """``audit verify --cells``: every cell's audit, against its entry of a federation
    checkpoint; exit 1 if any cell fails."""
    from secondbox_scheduler.infrastructure.cells.federation import (
        FederationCheckpoint,
        verify_cells,
    )

    with reported_errors():
        if until is not None:
            raise CommandError("audit verify --cells checks whole logs: --until is for one cell")
        expected = None if checkpoint is None else FederationCheckpoint.parse(checkpoint)
        with open_router(load_cells(cells), read_models=False) as router:
            reports = verify_cells(router, expected)
    ok = all(report.ok for report in reports.values())
    if as_json:
        print_json({
            "ok": ok,
            "cells": {name: report.to_dict() for name, report in reports.items()},
        })  # fmt: skip
    else:
        console = stdout()
        for name, report in reports.items():
            for violation in report.violations:
                console.print(f"[red]violation[/red] cell {shown(name)}: {shown(str(violation))}")
            verdict = (
                "[green]OK[/green]"
                if report.ok
                else f"[red]{len(report.violations)} violation(s)[/red]"
            )
            console.print(
                f"cell {shown(name)}: {verdict}: {report.events:,} events checked up to "
                f"position {report.position:,}; {chain_line(report.chain)}"
            )
        console.print(
            f"{len(reports)} cell(s): " + ("[green]OK[/green]" if ok else "[red]FAILED[/red]")
        )
    if not ok:
        raise typer.Exit(1)


def merkle_line(report: AuditReport, save_state: str | None) -> str:
    """One line on the Merkle tree: the head refolded, the stored tree, a re-audit."""
    merkle = report.merkle
    parts = [f"merkle: tree size {merkle.tree_size:,}, root {merkle.root_hash}"]
    parts.append("stored tree checked" if merkle.stored_checked else "stored tree not checked")
    if merkle.since is not None:
        parts.append(f"re-audited from the checkpoint of tree size {merkle.since:,}")
    if save_state is not None:
        parts.append(f"fold state sealed at tree size {merkle.tree_size:,} in {save_state}")
    return "; ".join(parts)


def chain_line(chain: ChainReport) -> str:
    """One line on the chain: how much of the log it covers, the snapshots, the key."""
    if not chain.chained:
        return "chain: this store keeps no chain"
    parts = [f"chain: {chain.links_checked:,} links checked"]
    if chain.unchained_until:
        parts.append(
            f"unchained up to position {chain.unchained_until:,} (written before the chain)"
        )
    parts.append(f"{chain.snapshots_checked:,} snapshots checked")
    parts.append("keyed (HMAC-SHA-256)" if chain.keyed else "not keyed (SHA-256)")
    if chain.checkpoint:
        parts.append(f"checked against checkpoint {chain.checkpoint}")
    return "; ".join(parts)


@audit_cli.command(
    "checkpoint",
    help=(
        "Print the head of the event chain: its position and digest (POSITION:DIGEST). Keep "
        "it elsewhere (a ticket, a log line, another system); `audit verify --checkpoint` "
        "later fails if the log no longer extends it. Keyed with SECONDBOX_AUDIT_KEY when "
        "set. With --sign-key (or SECONDBOX_CHECKPOINT_KEY): the signed checkpoint of the "
        "log's Merkle tree instead (C2SP tlog-checkpoint: origin, tree size, base64 root, "
        "a blank line, the signature line), for `audit prove`, `check-proof`, `witness` "
        "and `verify --checkpoint FILE`.\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler audit checkpoint\n"
        "  secondbox-scheduler audit checkpoint --sign-key log.key > cp.txt\n"
        "  secondbox-scheduler audit checkpoint --json"
    ),
)
def audit_checkpoint(
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    sign_key: Annotated[
        str | None,
        typer.Option(
            "--sign-key",
            envvar=CHECKPOINT_KEY,
            help="Sign the Merkle tree's checkpoint with this private key file (`audit keygen`).",
        ),
    ] = None,
    origin: Annotated[
        str | None,
        typer.Option("--origin", help="The checkpoint's origin line (default: the key's name)."),
    ] = None,
    as_json: JsonOutput = False,
    cells: CellsFile = None,
) -> None:
    from secondbox_scheduler.infrastructure.audit.verify import checkpoint

    if cells is not None:
        if sign_key:
            raise typer.BadParameter(
                "a federation checkpoint is not signed: sign each cell's with "
                "--database-url of the cell",
                param_hint="'--sign-key'",
            )
        from secondbox_scheduler.infrastructure.cells.federation import federation_checkpoint

        with reported_errors(), open_router(load_cells(cells), read_models=False) as router:
            federation = federation_checkpoint(router)
        if as_json:
            print_json({
                "checkpoint": str(federation),
                "cells": {
                    name: None if head is None else str(head)
                    for name, head in federation.cells.items()
                },
            })  # fmt: skip
            return
        stdout().print(str(federation), highlight=False, soft_wrap=True)
        return
    if sign_key:
        _signed_checkpoint(database_url, signer_of(sign_key), origin, as_json)
        return
    if origin is not None:
        raise typer.BadParameter("--origin goes with --sign-key", param_hint="'--origin'")
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        head = checkpoint(app)
        keyed = app.chain.keyed
        app.close()
    if head is None:
        stdout().print("no checkpoint: the log has no chained event yet", highlight=False)
        raise typer.Exit(1)
    if as_json:
        print_json({
            "checkpoint": str(head),
            "position": head.position,
            "digest": head.digest.hex(),
            "keyed": keyed,
        })  # fmt: skip
        return
    stdout().print(str(head), highlight=False)


def _signed_checkpoint(
    database_url: str, signer: Signer, origin: str | None, as_json: bool
) -> None:
    from secondbox_scheduler.infrastructure.audit.merkle_log import b64, signed_checkpoint

    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        try:
            note, body = signed_checkpoint(app, signer, origin)
        finally:
            app.close()
    if as_json:
        print_json({
            "checkpoint": str(note),
            "origin": body.origin,
            "tree_size": body.size,
            "root_hash": b64(body.root),
        })  # fmt: skip
        return
    typer.echo(str(note), nl=False)


@audit_cli.command(
    "state",
    help=(
        "Every runner snapshot and assignment as they stood at a notification position or a "
        "time.\n\n[bold]Example[/bold]\n\n  secondbox-scheduler audit state --at 5000"
    ),
)
def audit_state(
    at: Annotated[str, typer.Option("--at", help="POSITION or ISO TIME.")],
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit.log_fold import parse_until
    from secondbox_scheduler.infrastructure.audit.queries import state_at

    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        state = state_at(app, parse_until(at))
        app.close()
    if as_json:
        print_json({
            "position": state.position,
            "runners": [r.to_record() for r in state.runners],
            "assignments": [assignment_json(a) for a in state.assignments],
        })  # fmt: skip
        return
    console = stdout()
    console.print(f"state at position {state.position:,}")
    console.print(runner_table(state.runners))
    console.print(assignment_table(state.assignments, f"Assignments ({len(state.assignments)})"))


@audit_cli.command(
    "timeline",
    help=(
        "One sandbox's history (with its refused placements) or one runner's (with its "
        "heartbeat lease), in time order, each event with the actor who asked for it "
        "(unknown: recorded before 0.3).\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler audit timeline --sandbox sbx-0001\n"
        "  secondbox-scheduler audit timeline --runner general-01"
    ),
)
def audit_timeline(
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Sandbox id.")] = None,
    runner: Annotated[str | None, typer.Option("--runner", help="Runner id.")] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit.queries import timeline

    if (sandbox is None) == (runner is None):
        raise typer.BadParameter("give exactly one of --sandbox ID or --runner ID")
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        entries = timeline(app, sandbox_id=sandbox, runner_id=runner)
        app.close()
    if as_json:
        print_json([entry.to_dict() for entry in entries])
        return
    subject = f"sandbox {shown(sandbox)}" if sandbox else f"runner {shown(runner)}"
    table = Table(
        title=f"Timeline of {subject}",
        box=box.SIMPLE,
    )
    for column in ("time", "stream", "v", "event", "actor", "fields"):
        table.add_column(column)
    for entry in entries:
        fields = ", ".join(f"{k}={v}" for k, v in entry.fields.items())
        table.add_row(
            format_time(entry.time),
            shown(entry.stream),
            str(entry.version),
            entry.event,
            shown(describe_actor(entry.actor)),
            shown(fields),
        )
    stdout().print(table)


@audit_cli.command(
    "explain",
    help=(
        "Why this sandbox's home runner, why each generation's runner, and why each refused "
        "placement: every candidate's reason codes and capacity shortfall, and a one-line "
        "summary in kube-scheduler's manner, from the evidence recorded at decision time, "
        "and who asked for each decision."
        "\n\n[bold]Examples[/bold]\n\n"
        "  secondbox-scheduler audit explain --sandbox sbx-0001\n"
        "  secondbox-scheduler audit explain --sandbox sbx-0001 --generation 2 --json"
    ),
)
def audit_explain(
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Sandbox id.")] = None,
    generation: Annotated[
        int | None, typer.Option("--generation", help="Only this generation.")
    ] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
    positional: Annotated[
        str | None,
        typer.Argument(hidden=True, metavar="SANDBOX", help="Older spelling of --sandbox."),
    ] = None,
) -> None:
    from secondbox_scheduler.infrastructure.audit.queries import explain

    sandbox_id = _one_sandbox(sandbox, positional)
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        explanation = explain(app, sandbox_id, generation)
        app.close()
    if as_json:
        print_json(explanation.to_dict())
        return
    console = stdout()
    console.print(f"[bold]sandbox {shown(sandbox_id)}[/bold]")
    for decision in explanation.decisions:
        console.print(
            f"\n[bold]{shown(decision.title)}[/bold] at {format_time(decision.decided_at)} "
            f"(heartbeat timeout {decision.heartbeat_timeout_seconds:g}s)"
        )
        console.print(f"  {shown(decision.summary)}")
        console.print(f"  asked by: {shown(describe_actor(decision.actor))}")
        for key, value in decision.detail.items():
            console.print(f"  {key}: {shown(str(value))}")
        for line in decision.candidates:
            reasons = "; ".join(
                r["code"] + (f" (short {r['shortfall']})" if r.get("shortfall") else "")
                for r in line.reasons
            )
            rank = ""
            if line.rank:
                rank = ", ".join(f"{k} {v:,}" for k, v in line.rank.items())
            runner_id = shown(line.runner_id)
            console.print(f"  {runner_id:<16} {line.verdict:<26} {shown(reasons or rank)}")


audit_cli.command("whatif", help=WHATIF_HELP)(audit_whatif)
audit_cli.command("keygen", help=KEYGEN_HELP)(keygen)
audit_cli.command("prove", help=PROVE_HELP)(prove)
audit_cli.command("check-proof", help=CHECK_PROOF_HELP)(check_proof)
audit_cli.command("witness", help=WITNESS_HELP)(witness)


def _one_sandbox(option: str | None, positional: str | None) -> str:
    """The sandbox id given as --sandbox ID or, as before, as the positional argument."""
    if option is not None and positional is not None and option != positional:
        raise typer.BadParameter(
            f"--sandbox {option} and SANDBOX {positional} differ; give the sandbox once",
            param_hint="'--sandbox' / 'SANDBOX'",
        )
    found = option if option is not None else positional
    if found is None:
        raise typer.BadParameter("give the sandbox with --sandbox ID", param_hint="'--sandbox'")
    return found
