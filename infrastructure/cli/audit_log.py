"""The ``audit`` commands of the log as a Merkle tree: ``keygen``, ``prove``,
``check-proof`` and ``witness`` (``checkpoint --sign-key`` is in :mod:`.audit`); the API
they call is :mod:`secondbox_scheduler.infrastructure.audit.merkle_log` and
:mod:`secondbox_scheduler.infrastructure.audit.witness` (docs/audit.md, "Merkle tree")."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from secondbox_scheduler.infrastructure.audit.signed_notes import (
    NoteError,
    SignedCheckpoint,
    Signer,
    load_signer,
    load_verifier,
)
from secondbox_scheduler.infrastructure.cli.common import (
    DatabaseUrl,
    JsonOutput,
    fail,
    open_store,
    print_json,
    reported_errors,
    say_error,
    shown,
    stdout,
    store_errors,
)
from secondbox_scheduler.infrastructure.exit_codes import (
    EXIT_STORE_UNAVAILABLE,
    EXIT_USAGE,
    EXIT_VIOLATION,
)
from secondbox_scheduler.infrastructure.settings import DEFAULT_SQLITE_URL

KeyOption = Annotated[
    str,
    typer.Option(
        "--key", help="A verifier key (NAME+HASH+KEY, as `audit keygen` prints it) or its file."
    ),
]
MAX_FILE_BYTES = 1 << 20


def read_text(path: str, what: str) -> str:
    """A small input file (a checkpoint, a proof), or a usage error naming it."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        fail(f"{what} {shown(path)}: {shown(error.strerror or error)}")
    if len(data) > MAX_FILE_BYTES:
        fail(f"{what} {shown(path)}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        fail(f"{what} {shown(path)}: not UTF-8")


def signer_of(value: str) -> Signer:
    try:
        return load_signer(value)
    except NoteError as error:
        fail(shown(error))


def keygen(
    name: Annotated[str, typer.Option("--name", help="The key's name (no '+', no spaces).")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="The private key file to write (default: NAME.key)."),
    ] = None,
) -> None:
    try:
        signer = Signer.generate(name)
    except NoteError as error:
        fail(shown(error))
    path = out or Path(re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".key")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fail(f"{shown(path)} exists: give another --out (a key is never overwritten)")
    except OSError as error:
        fail(f"{shown(path)}: {shown(error.strerror or error)}")
    with os.fdopen(descriptor, "w") as file:
        file.write(str(signer) + "\n")
    say = stdout()
    say.print(str(signer.verifier), highlight=False, soft_wrap=True)
    typer.echo(f"private key written to {path} (keep it secret)", err=True)


KEYGEN_HELP = (
    "Make an Ed25519 key for signing checkpoints (or a witness's co-signatures): writes "
    "the private key file (mode 0600, never overwritten) and prints the verifier key "
    "NAME+HASH+KEY that others check signatures with.\n\n[bold]Example[/bold]\n\n"
    "  secondbox-scheduler audit keygen --name scheduler.example/log --out log.key"
)


def prove(
    position: Annotated[
        int | None, typer.Option("--position", min=1, help="Prove the event at POSITION.")
    ] = None,
    size: Annotated[
        int | None,
        typer.Option("--size", min=0, help="In the tree of SIZE leaves (default: the log now)."),
    ] = None,
    old: Annotated[
        int | None,
        typer.Option("--from", min=0, help="Prove that the tree extends the tree of this size."),
    ] = None,
    new: Annotated[
        int | None,
        typer.Option("--to", min=0, help="The newer tree size (default: the log now)."),
    ] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.infrastructure.audit.merkle_log import (
        consistency_proof,
        describe_leaf,
        inclusion_proof,
    )

    if (position is None) == (old is None):
        fail("give --position N (an inclusion proof) or --from M (a consistency proof)")
    if (position is not None and new is not None) or (old is not None and size is not None):
        fail("--size goes with --position, --to with --from")
    with reported_errors(), store_errors(database_url):
        app = open_store(database_url, read_models=False)
        try:
            if position is not None:
                proof: Any = inclusion_proof(app, position, size)
            else:
                assert old is not None
                proof = consistency_proof(app, old, new)
        finally:
            app.close()
    data = proof.to_dict()
    if as_json:
        print_json(data)
        return
    say = stdout()
    if position is not None:
        say.print(
            f"inclusion of position {position:,} (leaf {data['leaf_index']:,}) in tree size "
            f"{data['tree_size']:,}, root {data['root_hash']}"
        )
        say.print(f"leaf: {shown(describe_leaf(proof.leaf_data))}")
        hashes = data["inclusion_path"]
    else:
        say.print(
            f"consistency of tree size {data['old_size']:,} (root {data['old_root']}) with "
            f"tree size {data['new_size']:,} (root {data['new_root']})"
        )
        hashes = data["consistency_path"]
    for index, item in enumerate(hashes):
        say.print(f"  {index:>2} {item}")


PROVE_HELP = (
    "An inclusion proof of one event (--position N: leaf N - 1) in the tree of the log now "
    "or of --size M, or a consistency proof that the tree of --to N (default: the log "
    "now) extends the tree of --from M (RFC 9162). --json prints exactly the fields "
    "`audit check-proof` reads; bytes are base64.\n\n[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler audit prove --position 1234 --json > inclusion.json\n"
    "  secondbox-scheduler audit prove --from 10000 --json > consistency.json"
)


def check_proof(
    checkpoint: Annotated[
        str, typer.Option("--checkpoint", help="The signed checkpoint file the proof is for.")
    ],
    key: KeyOption,
    proof: Annotated[str, typer.Option("--proof", help="The proof file (`audit prove --json`).")],
    old_checkpoint: Annotated[
        str | None,
        typer.Option(
            "--old-checkpoint",
            help="For a consistency proof: the older signed checkpoint (its root is checked).",
        ),
    ] = None,
    as_json: JsonOutput = False,
) -> None:
    from secondbox_scheduler.domain.errors import InvalidRequestError
    from secondbox_scheduler.infrastructure.audit.merkle_log import (
        ConsistencyProof,
        InclusionProof,
        check_consistency,
        check_inclusion,
        describe_leaf,
        verified_checkpoint,
    )

    try:
        verifier = load_verifier(key)
    except NoteError as error:
        fail(shown(error))
    problems: list[str] = []
    new: SignedCheckpoint | None
    old: SignedCheckpoint | None
    try:
        new = verified_checkpoint(read_text(checkpoint, "checkpoint"), verifier)
        old = (
            None
            if old_checkpoint is None
            else verified_checkpoint(read_text(old_checkpoint, "old checkpoint"), verifier)
        )
    except NoteError as error:
        new = old = None
        problems.append(f"checkpoint: {error}")
    try:
        data = json.loads(read_text(proof, "proof"))
    except json.JSONDecodeError as error:
        fail(f"proof {shown(proof)}: not JSON ({shown(error)})")
    kind = "inclusion" if isinstance(data, dict) and "leaf_index" in data else "consistency"
    summary = ""
    try:
        if kind == "inclusion":
            inclusion = InclusionProof.from_dict(data)
            summary = (
                f"{describe_leaf(inclusion.leaf_data)}, leaf {inclusion.leaf_index:,} of tree "
                f"size {inclusion.tree_size:,}"
            )
            if new is not None:
                problems += check_inclusion(inclusion, new)
        else:
            consistency = ConsistencyProof.from_dict(data)
            summary = (
                f"tree size {consistency.new_size:,} extends tree size {consistency.old_size:,}"
            )
            if new is not None:
                problems += check_consistency(consistency, new, old)
    except InvalidRequestError as error:
        problems.append(f"proof: {error.field}: {error.rule}")
    if as_json:
        print_json({"ok": not problems, "kind": kind, "problems": problems})
    elif not problems:
        stdout().print(f"OK: {kind} proof verified against the checkpoint signed by "
                       f"{shown(verifier.name)}: {shown(summary)}")  # fmt: skip
    else:
        for problem in problems:
            say_error(f"refused: {shown(problem)}")
    if problems:
        raise typer.Exit(EXIT_VIOLATION)


CHECK_PROOF_HELP = (
    "Check a proof offline, with no database: the checkpoint's signature with the "
    "verifier key, then the proof against the checkpoint's tree size and root (RFC 9162 "
    "sections 2.1.3.2 and 2.1.4.2). Exits 1 naming what is wrong; a changed byte anywhere "
    "is refused.\n\n[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler audit check-proof --checkpoint cp.txt --key log.vkey "
    "--proof inclusion.json\n"
    "  secondbox-scheduler audit check-proof --checkpoint cp-new.txt --old-checkpoint "
    "cp-old.txt --key log.vkey --proof consistency.json"
)


def witness(
    state: Annotated[
        Path, typer.Option("--state", help="The witness's directory (last checkpoint per log).")
    ],
    key: Annotated[str, typer.Option("--key", help="The witness's private key file.")],
    checkpoint: Annotated[
        str, typer.Option("--checkpoint", help="The log's signed checkpoint file to co-sign.")
    ],
    log_key: Annotated[
        str | None,
        typer.Option("--log-key", help="The log's verifier key: its signature is required."),
    ] = None,
    log_url: Annotated[
        str | None,
        typer.Option(
            "--log-url",
            help=(
                "Ask the log's HTTP service for the consistency proof (GET "
                "/v1/audit/proofs/consistency) instead of its database."
            ),
        ),
    ] = None,
    access_token: Annotated[
        str | None,
        typer.Option(
            "--access-token",
            envvar="SECONDBOX_ACCESS_TOKEN",
            help="A bearer token of a reading role for --log-url.",
        ),
    ] = None,
    database_url: DatabaseUrl = DEFAULT_SQLITE_URL,
) -> None:
    from secondbox_scheduler.infrastructure.audit.merkle_log import consistency_proof
    from secondbox_scheduler.infrastructure.audit.witness import (
        CheckpointRefused,
        LogUnreachableError,
        http_consistency,
    )
    from secondbox_scheduler.infrastructure.audit.witness import witness as cosign

    signer = signer_of(key)
    try:
        verifier = None if log_key is None else load_verifier(log_key)
    except NoteError as error:
        fail(shown(error))
    text = read_text(checkpoint, "checkpoint")
    with reported_errors(), store_errors(database_url):
        app = None if log_url else open_store(database_url, read_models=False)
        source: Any
        if log_url:
            source = http_consistency(log_url, access_token)
        else:
            store = app

            def source(old: int, new: int) -> list[bytes]:
                assert store is not None
                return list(consistency_proof(store, old, new).consistency_path)

        try:
            witnessed = cosign(state, signer, text, source, verifier)
        except CheckpointRefused as error:
            say_error(shown(error))
            raise typer.Exit(EXIT_VIOLATION) from None
        except NoteError as error:
            fail(f"checkpoint {shown(checkpoint)}: {shown(error)}", EXIT_USAGE)
        except LogUnreachableError as error:
            fail(f"the log's proof: {shown(error)}", EXIT_STORE_UNAVAILABLE)
        finally:
            if app is not None:
                app.close()
    typer.echo(str(witnessed.note), nl=False)
    if witnessed.previous_size is None:
        extended = "the first checkpoint of this log"
    elif witnessed.previous_size == witnessed.checkpoint.size:
        extended = "the tree size accepted last, with its root"
    else:
        extended = f"extends tree size {witnessed.previous_size:,}"
    typer.echo(
        f"accepted: tree size {witnessed.checkpoint.size:,} of {witnessed.checkpoint.origin} "
        f"({extended}); co-signed by {signer.name}",
        err=True,
    )


WITNESS_HELP = (
    "Co-sign the log's checkpoint as a witness, only if it extends the last checkpoint "
    "this witness accepted for the same origin (kept in --state): the log's consistency "
    "proof from the old size to the new must verify against the two checkpoints' roots. "
    "Prints the co-signed checkpoint; refuses (exit 1, naming both sizes) a checkpoint "
    "that does not extend the last one. The proof comes from the log's database, or from "
    "its HTTP service with --log-url.\n\n[bold]Examples[/bold]\n\n"
    "  secondbox-scheduler audit witness --state witness/ --key witness.key "
    "--checkpoint cp.txt --log-key log.vkey > cp-witnessed.txt\n"
    "  secondbox-scheduler audit witness --state witness/ --key witness.key "
    "--checkpoint cp.txt --log-url https://scheduler.example:8443"
)


def verify_checks(
    checkpoint: str | None,
    log_key: str | None,
    witness_keys: list[str],
    since: str | None,
    since_state: str | None,
) -> tuple[Any, Any]:
    """``audit verify``'s chain checkpoint (POSITION:DIGEST or DIGEST) and its Merkle
    checks (a signed checkpoint FILE, the keys, the ``--since`` checkpoint and state)."""
    from secondbox_scheduler.infrastructure.audit.merkle_checks import MerkleChecks
    from secondbox_scheduler.infrastructure.audit.signed_notes import (
        looks_like_note,
        parse_checkpoint_note,
    )
    from secondbox_scheduler.infrastructure.audit.verify import parse_checkpoint

    def note_of(path: str, what: str) -> Any:
        try:
            return parse_checkpoint_note(read_text(path, what))
        except NoteError as error:
            fail(f"{what} {shown(path)}: {shown(error)}")

    def key_of(text: str, what: str) -> Any:
        try:
            return load_verifier(text)
        except NoteError as error:
            fail(f"{what}: {shown(error)}")

    checks = MerkleChecks(
        log_key=None if log_key is None else key_of(log_key, "--log-key"),
        witnesses=[key_of(k, "--witness") for k in witness_keys],
    )
    expected = None
    if checkpoint is not None:
        if os.path.isfile(checkpoint) or looks_like_note(checkpoint):
            if os.path.isfile(checkpoint):
                checks.signed.append(note_of(checkpoint, "checkpoint"))
            else:
                checks.signed.append(parse_checkpoint_note(checkpoint))
        else:
            with reported_errors():
                expected = parse_checkpoint(checkpoint)
    if since is not None:
        checks.since = note_of(since, "--since checkpoint")
    if since_state is not None:
        try:
            with open(since_state, "rb") as file:
                checks.since_state = file.read()
        except OSError as error:
            fail(f"--since-state {shown(since_state)}: {shown(error.strerror or error)}")
    return expected, checks


def write_state(path: str, state: bytes | None) -> None:
    """The fold state ``audit verify --save-state`` sealed, written to ``path``."""
    if state is None:
        fail("no fold state to save: a verify cut by time seals none (cut by position)")
    try:
        with open(path, "wb") as file:
            file.write(state)
    except OSError as error:
        fail(f"--save-state {shown(path)}: {shown(error.strerror or error)}")
