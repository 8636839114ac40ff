"""The log as a Merkle tree for an outsider, end to end on both stores: signed checkpoints
(verified through ``cryptography`` directly), ``audit prove`` and the offline ``audit
check-proof`` (a one-byte change of a leaf, a path hash, a root or a signature refused),
the witness (a forked log refused), ``audit verify --since`` (the findings of a full
verify), and the ``/v1/audit`` routes. The proofs are also checked with the RFC 9162
verifier written again in tests/test_merkle_tree.py, which shares no code with the
producer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.fold_state import StateError
from secondbox_scheduler.infrastructure.audit.merkle_checks import MerkleChecks
from secondbox_scheduler.infrastructure.audit.merkle_log import consistency_proof, tree_head
from secondbox_scheduler.infrastructure.audit.signed_notes import (
    Note,
    SignedCheckpoint,
    Signer,
    parse_checkpoint_note,
)
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.http.app import create_app
from secondbox_scheduler.infrastructure.store.merkle_tree import MerkleTree
from tests.conftest import Clock, PostgresSchema, Store
from tests.factories import (
    RUNTIME,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
)
from tests.http_helpers import api_client
from tests.test_audit import append
from tests.test_merkle_tree import conninfo, rfc_verify_consistency, rfc_verify_inclusion
from tests.test_red_team import (
    Roles,
    _admin,
    _connect,
    _granted,
    _history,
    _projector,
    _url,
    roles,
)

INCLUSION_FIELDS = {"leaf_index", "tree_size", "leaf_data", "inclusion_path", "root_hash"}
CONSISTENCY_FIELDS = {"old_size", "new_size", "old_root", "new_root", "consistency_path"}


def url_of(store: Store) -> str:
    env = store.env
    if store.kind == "sqlite":
        return f"sqlite:///{env['SQLITE_DBNAME']}"
    return (
        f"postgresql://{env['POSTGRES_USER']}@{env['POSTGRES_HOST']}:{env['POSTGRES_PORT']}/"
        f"{env['POSTGRES_DBNAME']}?schema={env['POSTGRES_SCHEMA']}"
    )


def run(store: Store, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, ["audit", *args, "--database-url", url_of(store)])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result.stdout


def offline(*args: str) -> Any:
    return CliRunner().invoke(cli, ["audit", *args])


def beat(store: Store, app: SchedulerApplication, runner_id: str) -> None:
    """A heartbeat of ``runner_id`` a second later (the store's clock moves on)."""
    store.clock.advance(seconds=1)
    app.record_heartbeat(
        runner_id=runner_id,
        at=store.clock(),
        artifact_digests=[RUNTIME],
        materializations=[materialization()],
    )


def events(store: Store, app: SchedulerApplication, prefix: str, count: int = 3) -> None:
    for n in range(count):
        create_sandbox(app, f"{prefix}-{n}")
    beat(store, app, "r0")


def started(store: Store) -> SchedulerApplication:
    app = store.open()
    for r in range(2):
        register(app, f"r{r}", at=app.now(), allocatable=capacity(instances=4))
    events(store, app, "first")
    assignment, _ = app.schedule(schedule_request("first-0", app.now()))
    app.release("first-0", assignment.generation, assignment.fencing_token, {"exit": "clean"})
    beat(store, app, "r1")
    return app


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    made = {}
    for who, name in (("log", "scheduler.test/log"), ("witness", "witness.test/w1")):
        key = tmp_path / f"{who}.key"
        result = offline("keygen", "--name", name, "--out", str(key))
        assert result.exit_code == 0, result.stderr
        vkey = tmp_path / f"{who}.vkey"
        vkey.write_text(result.stdout)
        made[who], made[f"{who}.vkey"] = key, vkey
    return made


def rewrite_event(store: Store, app: SchedulerApplication, position: int) -> None:
    """An insider's edit of one stored event (a byte added to its state)."""
    table = app.recorder.events_table_name  # type: ignore[attr-defined]
    if store.kind == "sqlite":
        with sqlite3.connect(store.env["SQLITE_DBNAME"]) as conn:
            conn.execute(f"UPDATE {table} SET state = state || x'20' WHERE rowid = ?", (position,))
    else:
        with psycopg.connect(conninfo(store)) as conn:
            conn.execute(
                f'UPDATE "{store.env["POSTGRES_SCHEMA"]}"."{table}" '
                "SET state = state || '\\x20'::bytea WHERE notification_id = %s",
                (position,),
            )


def test_keygen_prints_the_c2sp_verifier_key_and_signatures_verify_with_cryptography(
    store: Store, keys: dict[str, Path], tmp_path: Path
) -> None:
    vkey = keys["log.vkey"].read_text().strip()
    found = re.fullmatch(r"(scheduler\.test/log)\+([0-9a-f]{8})\+([A-Za-z0-9+/=]+)", vkey)
    assert found, vkey
    raw = base64.b64decode(found.group(3))
    assert raw[0] == 0x01
    assert len(raw) == 33
    expected_hash = hashlib.sha256(found.group(1).encode() + b"\n" + raw).digest()[:4]
    assert found.group(2) == expected_hash.hex()
    assert oct(keys["log"].stat().st_mode & 0o777) == "0o600"
    assert offline("keygen", "--name", "x", "--out", str(keys["log"])).exit_code == 2

    app = started(store)
    note = run(store, "checkpoint", "--sign-key", str(keys["log"]))
    body, _, signatures = note.partition("\n\n")
    origin, size, root_b64 = body.split("\n")
    assert origin == "scheduler.test/log"
    assert int(size) == MerkleTree(app.recorder).log_size()
    assert len(base64.b64decode(root_b64)) == 32
    line = re.fullmatch(r"\u2014 scheduler\.test/log ([A-Za-z0-9+/=]+)\n", signatures)
    assert line, signatures
    blob = base64.b64decode(line.group(1))
    assert blob[:4] == expected_hash
    public = Ed25519PublicKey.from_public_bytes(raw[1:])
    public.verify(blob[4:], (body + "\n").encode())  # raises if it does not verify
    with pytest.raises(InvalidSignature):
        public.verify(blob[4:], (body.replace(size, str(int(size) + 1)) + "\n").encode())
    # the old form stays as it was
    assert re.fullmatch(r"\d+:[0-9a-f]{64}\n", run(store, "checkpoint"))
    # and the environment names the key too
    result = CliRunner().invoke(
        cli,
        ["audit", "checkpoint", "--database-url", url_of(store), "--json"],
        env={"SECONDBOX_CHECKPOINT_KEY": str(keys["log"])},
    )
    assert json.loads(result.stdout)["tree_size"] == int(size)


def _flip(text: str, at: int = 0) -> str:
    """base64 ``text`` with one byte of what it encodes changed."""
    data = bytearray(base64.b64decode(text))
    data[at] ^= 0x01
    return base64.b64encode(bytes(data)).decode()


def test_proofs_check_offline_and_any_changed_byte_is_refused(
    store: Store, keys: dict[str, Path], tmp_path: Path
) -> None:
    app = started(store)
    old_note = tmp_path / "old.txt"
    old_note.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    old_size = int(old_note.read_text().split("\n")[1])
    events(store, app, "second", 5)
    note = tmp_path / "cp.txt"
    note.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    size = int(note.read_text().split("\n")[1])
    position = 4
    inclusion = json.loads(run(store, "prove", "--position", str(position), "--json"))
    assert set(inclusion) == INCLUSION_FIELDS
    assert (inclusion["leaf_index"], inclusion["tree_size"]) == (position - 1, size)
    path = [base64.b64decode(h) for h in inclusion["inclusion_path"]]
    leaf = base64.b64decode(inclusion["leaf_data"])
    root = base64.b64decode(inclusion["root_hash"])
    assert rfc_verify_inclusion(position - 1, size, leaf, path, root)
    consistency = json.loads(run(store, "prove", "--from", str(old_size), "--json"))
    assert set(consistency) == CONSISTENCY_FIELDS
    assert rfc_verify_consistency(
        old_size,
        size,
        base64.b64decode(consistency["old_root"]),
        base64.b64decode(consistency["new_root"]),
        [base64.b64decode(h) for h in consistency["consistency_path"]],
    )

    def check(proof: dict[str, Any], checkpoint: Path = note, *extra: str) -> int:
        proof_file = tmp_path / "proof.json"
        proof_file.write_text(json.dumps(proof))
        args = ["--checkpoint", str(checkpoint), "--key", str(keys["log.vkey"])]
        result = offline("check-proof", *args, "--proof", str(proof_file), *extra)
        return int(result.exit_code)

    assert check(inclusion) == 0
    assert check(consistency, note, "--old-checkpoint", str(old_note)) == 0
    changed: list[dict[str, Any]] = []
    for at in (0, 20, len(leaf) - 1):
        changed.append({**inclusion, "leaf_data": _flip(inclusion["leaf_data"], at)})
    for index in range(len(inclusion["inclusion_path"])):
        bent = list(inclusion["inclusion_path"])
        bent[index] = _flip(bent[index], index % 32)
        changed.append({**inclusion, "inclusion_path": bent})
    changed.append({**inclusion, "root_hash": _flip(inclusion["root_hash"], 31)})
    changed.append({**inclusion, "leaf_index": position})  # another leaf's place
    for proof in changed:
        assert check(proof) == 1, proof
    for index in range(len(consistency["consistency_path"])):
        bent = list(consistency["consistency_path"])
        bent[index] = _flip(bent[index])
        assert check({**consistency, "consistency_path": bent}, note, "--old-checkpoint",
                     str(old_note)) == 1  # fmt: skip
    assert check({**consistency, "old_root": _flip(consistency["old_root"])}) == 1
    # a changed byte of the signature, or of the signed text, and the checkpoint is refused
    text = note.read_text()
    body, _, signature_line = text.partition("\n\n")
    prefix, encoded = signature_line.rstrip("\n").rsplit(" ", 1)
    forged = tmp_path / "forged.txt"
    forged.write_text(f"{body}\n\n{prefix} {_flip(encoded, 10)}\n")
    assert check(inclusion, forged) == 1
    forged.write_text(text.replace(inclusion["root_hash"], inclusion["root_hash"].lower(), 1))
    assert check(inclusion, forged) in (1, 2)  # no longer the signed text, or not base64


def test_the_witness_refuses_a_forked_log(
    store: Store, keys: dict[str, Path], tmp_path: Path
) -> None:
    app = started(store)
    state = tmp_path / "witness"

    def checkpoint_file(name: str) -> Path:
        path = tmp_path / name
        path.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
        return path

    def witness(path: Path, code: int) -> Any:
        result = CliRunner().invoke(
            cli,
            ["audit", "witness", "--state", str(state), "--key", str(keys["witness"]),
             "--checkpoint", str(path), "--log-key", str(keys["log.vkey"]),
             "--database-url", url_of(store)],
        )  # fmt: skip
        assert result.exit_code == code, (result.stdout, result.stderr)
        return result

    first = witness(checkpoint_file("cp1.txt"), 0)
    note, _ = parse_checkpoint_note(first.stdout)
    assert [s.name for s in note.signatures] == ["scheduler.test/log", "witness.test/w1"]
    events(store, app, "second")
    cosigned = tmp_path / "cp2-witnessed.txt"
    cosigned.write_text(witness(checkpoint_file("cp2.txt"), 0).stdout)
    accepted = int(cosigned.read_text().split("\n")[1])
    assert run(store, "verify", "--checkpoint", str(cosigned), "--witness",
               str(keys["witness.vkey"]), "--log-key", str(keys["log.vkey"]))  # fmt: skip
    # the witness's own signature is what --witness asks for
    plain = tmp_path / "cp2.txt"
    out = run(store, "verify", "--checkpoint", str(plain), "--witness",
              str(keys["witness.vkey"]), code=1)  # fmt: skip
    assert "checkpoint-witness" in out

    rewrite_event(store, app, 3)  # an earlier event, under both accepted checkpoints
    assert MerkleTree(app.recorder).rebuild() == accepted  # the forked log's own tree
    events(store, app, "third")
    refused = witness(checkpoint_file("cp3.txt"), 1)
    new_size = MerkleTree(app.recorder).log_size()
    assert (
        f"tree size {new_size} does not extend the last accepted tree size {accepted}"
        in refused.stderr
    )
    # the same size with another root is refused too, and so is a smaller one
    forked_same = checkpoint_file("cp-same.txt")
    assert int(forked_same.read_text().split("\n")[1]) == new_size
    witness(forked_same, 1)
    out = run(store, "verify", "--checkpoint", str(cosigned), code=1)
    assert "checkpoint-rewritten" in out
    assert "chain-edited" in out


def cycles(store: Store, app: SchedulerApplication, prefix: str, count: int) -> None:
    """Sandboxes placed on r1 and released (r1 passes its snapshot interval)."""
    for n in range(count):
        name = f"{prefix}-cycle-{n}"
        create_sandbox(app, name)
        home = app.sandbox_home(name)
        beat(store, app, home)
        assignment, _ = app.schedule(schedule_request(name, store.clock()))
        app.release(name, assignment.generation, assignment.fencing_token, {"exit": "clean"})


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_witness_asks_the_logs_http_service_for_the_proof(
    store: Store, keys: dict[str, Path], tmp_path: Path
) -> None:
    app = started(store)
    state = tmp_path / "witness"

    def witness(path: Path, url: str) -> Any:
        return CliRunner().invoke(
            cli,
            ["audit", "witness", "--state", str(state), "--key", str(keys["witness"]),
             "--checkpoint", str(path), "--log-url", url],
        )  # fmt: skip

    first = tmp_path / "cp1.txt"
    first.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    events(store, app, "second")
    second = tmp_path / "cp2.txt"
    second.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    size = int(second.read_text().split("\n")[1])
    # signed by the log's key, but not the log's tree: a fork shown to this witness only
    forged = tmp_path / "forged.txt"
    body = SignedCheckpoint("scheduler.test/log", size, hashlib.sha256(b"fork").digest())
    forged.write_text(str(Note(body.body()).signed(Signer.parse(keys["log"].read_text()))))
    with api_client(app) as client:
        url = str(client.base_url)
        assert witness(first, url).exit_code == 0
        refused = witness(forged, url)
        assert refused.exit_code == 1, refused.stderr
        assert f"tree size {size} does not extend" in refused.stderr
        assert witness(second, url).exit_code == 0
    events(store, app, "third")
    third = tmp_path / "cp3.txt"
    third.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    gone = witness(third, "http://127.0.0.1:9")  # nothing listens there: no proof, no co-sign
    assert gone.exit_code == 4, gone.stderr


def ghost_reservation(app: SchedulerApplication) -> int:
    return append(
        app, Runner.CapacityReserved, runner_uuid("r1"), timestamp=app.now(),
        reservation="ghost#1", assignment_id="ghost", sandbox_id="ghost", generation=1,
        capacity=capacity(instances=1, vcpu_count=0, memory_bytes=0, disk_bytes=0,
                          operations=0).as_dict(),
    )  # fmt: skip


@pytest.mark.parametrize("later", ["clean", "violations"])
def test_since_finds_what_a_full_verify_finds(
    store: Store, keys: dict[str, Path], tmp_path: Path, later: str
) -> None:
    app = started(store)
    ghost_reservation(app)  # a finding before the checkpoint: carried in the state
    cycles(store, app, "before", 6)  # r1's snapshots, before and after the checkpoint
    note = tmp_path / "cp.txt"
    note.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    state = tmp_path / "state.bin"
    run(store, "verify", "--checkpoint", str(note), "--save-state", str(state), code=1)
    checkpoint = parse_checkpoint_note(note.read_text())
    events(store, app, "second", 4)
    cycles(store, app, "after", 6)
    if later == "violations":
        ghost_reservation(app)
        tree = MerkleTree(app.recorder)
        rewrite_event(store, app, tree.update() - 2)  # the stored tree covered it
        beat(store, app, "r1")
    full = verify(app, measure_raw=False)
    since = verify(
        app,
        measure_raw=False,
        merkle=MerkleChecks(since=checkpoint, since_state=state.read_bytes()),
    )
    assert [v.to_dict() for v in since.violations] == [v.to_dict() for v in full.violations]
    rules = {v.rule for v in full.violations}
    assert "invariant-2" in rules
    if later == "violations":
        assert {"chain-edited", "merkle"} <= rules  # the stored tree predates the edit
    after = app.recorder.select_notifications(start=checkpoint[1].size + 1, limit=10_000)
    assert since.events == len(after) < full.events
    assert full.chain.snapshots_checked >= 2
    assert since.merkle.since == checkpoint[1].size
    assert since.chain.links_checked == full.chain.links_checked
    assert since.chain.snapshots_checked == full.chain.snapshots_checked
    assert since.merkle.root_hash == full.merkle.root_hash


def test_a_fold_state_changed_or_of_another_checkpoint_is_refused(
    store: Store, keys: dict[str, Path], tmp_path: Path
) -> None:
    app = started(store)
    note = tmp_path / "cp.txt"
    note.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    state = tmp_path / "state.bin"
    run(store, "verify", "--checkpoint", str(note), "--save-state", str(state))
    events(store, app, "second")
    later = tmp_path / "later.txt"
    later.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    data = state.read_bytes()
    changed = tmp_path / "changed.bin"
    changed.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    for checkpoint, fold in ((note, changed), (later, state)):
        result = CliRunner().invoke(
            cli,
            ["audit", "verify", "--since", str(checkpoint), "--since-state", str(fold),
             "--database-url", url_of(store)],
        )  # fmt: skip
        assert result.exit_code == 2, (result.stdout, result.stderr)
        assert "since-state" in result.stderr
    with pytest.raises(StateError, match="does not hash"):
        verify(app, merkle=MerkleChecks(since=parse_checkpoint_note(note.read_text()),
                                        since_state=changed.read_bytes()))  # fmt: skip
    assert verify(
        app,
        merkle=MerkleChecks(
            since=parse_checkpoint_note(note.read_text()), since_state=state.read_bytes()
        ),
    ).ok


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_since_a_checkpoint_past_the_end_of_a_cut_log_is_truncated(
    store: Store, keys: dict[str, Path], tmp_path: Path
) -> None:
    started(store)
    note = tmp_path / "cp.txt"
    note.write_text(run(store, "checkpoint", "--sign-key", str(keys["log"])))
    state = tmp_path / "state.bin"
    run(store, "verify", "--checkpoint", str(note), "--save-state", str(state))
    size = parse_checkpoint_note(note.read_text())[1].size
    with sqlite3.connect(store.env["SQLITE_DBNAME"]) as conn:  # the tail cut, links too
        for table in ("stored_events", "stored_events_chain"):
            key = "rowid" if table == "stored_events" else "position"
            conn.execute(f"DELETE FROM {table} WHERE {key} > ?", (size - 3,))
    out = run(store, "verify", "--since", str(note), "--since-state", str(state), code=1)
    assert "checkpoint-truncated" in out
    assert "checkpoint-truncated" in run(store, "verify", "--checkpoint", str(note), code=1)


def test_the_audit_routes_answer_checkpoints_and_proofs(
    store: Store, keys: dict[str, Path]
) -> None:
    app = started(store)
    unsigned = TestClient(create_app(app))
    missing = unsigned.get("/v1/audit/checkpoint")
    assert missing.status_code == 404
    assert missing.json()["code"] == "no_checkpoint_key"
    signed_app = store.open()
    signed_app.env["SECONDBOX_CHECKPOINT_KEY"] = keys["log"].read_text()
    client = TestClient(create_app(signed_app))
    body = client.get("/v1/audit/checkpoint").json()
    _note, checkpoint = parse_checkpoint_note(body["checkpoint"])
    assert (body["tree_size"], base64.b64decode(body["root_hash"])) == (
        checkpoint.size,
        checkpoint.root,
    )
    events(store, app, "second")
    proof = client.get("/v1/audit/proofs/inclusion", params={"position": 2}).json()
    assert set(proof) == INCLUSION_FIELDS
    assert rfc_verify_inclusion(
        1,
        proof["tree_size"],
        base64.b64decode(proof["leaf_data"]),
        [base64.b64decode(h) for h in proof["inclusion_path"]],
        base64.b64decode(proof["root_hash"]),
    )
    old = client.get(
        "/v1/audit/proofs/inclusion", params={"position": 2, "size": checkpoint.size}
    ).json()
    assert base64.b64decode(old["root_hash"]) == checkpoint.root
    consistency = client.get(
        "/v1/audit/proofs/consistency", params={"from": checkpoint.size}
    ).json()
    assert set(consistency) == CONSISTENCY_FIELDS
    assert base64.b64decode(consistency["old_root"]) == checkpoint.root
    assert rfc_verify_consistency(
        checkpoint.size,
        consistency["new_size"],
        checkpoint.root,
        base64.b64decode(consistency["new_root"]),
        [base64.b64decode(h) for h in consistency["consistency_path"]],
    )
    beyond = client.get("/v1/audit/proofs/inclusion", params={"position": 10**9})
    assert beyond.status_code == 422
    assert beyond.json()["field"] == "position"
    wrong = client.get("/v1/audit/proofs/consistency", params={"from": 10**9})
    assert wrong.status_code == 422


__all__ = ["roles"]  # the fixture, from tests/test_red_team.py


def test_the_application_and_audit_roles_keep_the_tree_through_its_function_alone(
    postgres_schema: PostgresSchema, roles: Roles, clock: Clock
) -> None:
    """docs/operations.md: the roles write nothing but through the owner's functions; the
    tree's function computes it from the log and takes nothing else from its caller."""
    env = _granted(postgres_schema, roles)
    app = SchedulerApplication(env=env, now=clock)
    projector = _projector(postgres_schema, roles)
    auditor = SchedulerApplication(
        env={
            "SECONDBOX_DATABASE_URL": _url(postgres_schema, roles.auditor),
            "SECONDBOX_READ_MODELS": "off",
        },
        now=clock,
    )
    try:
        _history(app, projector, clock)
        size, head = tree_head(app)  # the application role brings the tree up to date
        assert size == MerkleTree(app.recorder).log_size() > 0
        register(app, "r2", at=clock())
        later, _ = tree_head(auditor)  # and so does the audit role
        assert later > size
        proof = consistency_proof(auditor, size)
        assert proof.old_root == head
        assert verify(auditor).merkle.stored_checked
        with _admin(postgres_schema) as admin:  # an audit role granted before the tree
            admin.execute(
                f'REVOKE EXECUTE ON FUNCTION "{postgres_schema.name}".'
                f'schedulerapplication_events_merkle_extend(bigint) FROM "{roles.auditor}"'
            )
        register(app, "r3", at=clock())
        report = verify(auditor)  # still verifies: the stored tree is read, not extended
        assert report.ok
        assert not report.merkle.stored_checked
        assert report.merkle.tree_size == MerkleTree(app.recorder).log_size()
    finally:
        app.close()
        projector.close()
        auditor.close()
    tree = f'"{postgres_schema.name}".schedulerapplication_events_merkle'
    extend = "schedulerapplication_events_merkle_extend"
    for role in (roles.app, roles.auditor):
        with _connect(postgres_schema, role) as conn:
            for statement in (
                f"INSERT INTO {tree} VALUES (0, 1000000, '\\x00'::bytea)",
                f"UPDATE {tree} SET hash = '\\x00'::bytea",
                f"DELETE FROM {tree}",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
    with (
        _connect(postgres_schema, roles.app) as conn,
        pytest.raises(psycopg.errors.RaiseException, match="max_leaves"),
    ):
        conn.execute(f'SELECT "{postgres_schema.name}".{extend}(0)')
