"""The Merkle tree over the log (domain/audit/merkle.py, infrastructure/store/merkle_tree.py)
checked against RFC 9162 written again here, sharing no code with the producer.

The reference below is RFC 9162's text turned into Python as plainly as it reads: the
tree hash ``MTH`` by its recursive definition (section 2.1.1), and the verification of an
inclusion proof (section 2.1.3.2) and of a consistency proof (section 2.1.4.2), step by
step. It imports nothing of the project; the leaf data is rebuilt from the stored rows
with ``struct`` as docs/audit.md describes it.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import struct
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from hypothesis import given
from hypothesis import strategies as st

from secondbox_scheduler.domain.audit import merkle
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.store.merkle_tree import MerkleTree
from tests.conftest import T0, Store
from tests.factories import create_sandbox, register

# -- RFC 9162, independently ---------------------------------------------------------


def rfc_hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def rfc_mth(leaves: Sequence[bytes]) -> bytes:
    """Section 2.1.1: MTH({}) = SHA-256(); MTH({d0}) = SHA-256(0x00 || d0); else split at
    the largest power of two k < n."""
    n = len(leaves)
    if n == 0:
        return rfc_hash(b"")
    if n == 1:
        return rfc_hash(b"\x00" + leaves[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return rfc_hash(b"\x01" + rfc_mth(leaves[:k]) + rfc_mth(leaves[k:]))


def rfc_verify_inclusion(
    leaf_index: int, tree_size: int, leaf: bytes, path: Sequence[bytes], root: bytes
) -> bool:
    """Section 2.1.3.2, step by step (``leaf`` is the leaf entry, hashed in step 3)."""
    if leaf_index >= tree_size:  # 1
        return False
    fn, sn = leaf_index, tree_size - 1  # 2
    r = rfc_hash(b"\x00" + leaf)  # 3
    for p in path:  # 4
        if sn == 0:  # 4a
            return False
        if fn % 2 == 1 or fn == sn:  # 4b
            r = rfc_hash(b"\x01" + p + r)  # 4b i
            if fn % 2 == 0:  # 4b ii
                while not (fn % 2 == 1 or fn == 0):
                    fn //= 2
                    sn //= 2
        else:
            r = rfc_hash(b"\x01" + r + p)  # 4b otherwise
        fn //= 2  # 4c
        sn //= 2
    return sn == 0 and r == root  # 5


def rfc_verify_consistency(
    first: int, second: int, first_hash: bytes, second_hash: bytes, path: Sequence[bytes]
) -> bool:
    """Section 2.1.4.2, step by step."""
    if not path:  # 1
        return False
    items = list(path)
    if first & (first - 1) == 0:  # 2: first is an exact power of 2
        items = [first_hash, *items]
    fn, sn = first - 1, second - 1  # 3
    if fn % 2 == 1:  # 4
        while fn % 2 == 1:
            fn //= 2
            sn //= 2
    fr = sr = items[0]  # 5
    for c in items[1:]:  # 6
        if sn == 0:  # 6a
            return False
        if fn % 2 == 1 or fn == sn:  # 6b
            fr = rfc_hash(b"\x01" + c + fr)  # 6b i
            sr = rfc_hash(b"\x01" + c + sr)
            if fn % 2 == 0:  # 6b ii
                while not (fn % 2 == 1 or fn == 0):
                    fn //= 2
                    sn //= 2
        else:
            sr = rfc_hash(b"\x01" + sr + c)  # 6b otherwise
        fn //= 2  # 6c
        sn //= 2
    return fr == first_hash and sr == second_hash and sn == 0  # 7


def documented_leaf(position: int, row: tuple[Any, ...] | None) -> bytes:
    """docs/audit.md's leaf data, from a stored row (originator id, version, topic,
    state), or of a position that holds none."""
    head = b"secondbox-leaf-v1" + struct.pack(">Q", position)
    if row is None:
        return head + b"\x00"
    originator_id, version, topic, state = row
    topic_bytes = str(topic).encode()
    state_bytes = bytes(state)
    return (
        head
        + b"\x01"
        + uuid.UUID(str(originator_id)).bytes
        + struct.pack(">Q", version)
        + struct.pack(">Q", len(topic_bytes))
        + topic_bytes
        + struct.pack(">Q", len(state_bytes))
        + state_bytes
    )


# -- the producer's algorithms over a store in memory ---------------------------------


class Memory:
    """Every complete subtree of a list of leaf entries, as the store keeps them."""

    def __init__(self, leaves: Sequence[bytes]) -> None:
        self.nodes: dict[merkle.Node, bytes] = {}
        for size, leaf in enumerate(leaves):
            found = {n: self.nodes[n] for n in merkle.frontier(size)}
            self.nodes.update(merkle.extend(size, found, [merkle.leaf_hash(leaf)]))

    def read(self, nodes: Any) -> dict[merkle.Node, bytes]:
        return {n: self.nodes[n] for n in nodes if n in self.nodes}


LEAVES = [f"leaf {i}".encode() for i in range(70)]
MEMORY = Memory(LEAVES)


@given(st.integers(1, 70), st.data())
def test_inclusion_proofs_verify_by_rfc_9162(size: int, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, size - 1))
    root = merkle.root(size, MEMORY.read)
    assert root == rfc_mth(LEAVES[:size])
    path = merkle.inclusion_path(index, size, MEMORY.read)
    assert rfc_verify_inclusion(index, size, LEAVES[index], path, root)
    assert merkle.verify_inclusion(index, size, merkle.leaf_hash(LEAVES[index]), path, root)
    assert not rfc_verify_inclusion(index, size, LEAVES[index] + b"x", path, root)


@given(st.integers(1, 70), st.data())
def test_consistency_proofs_verify_by_rfc_9162(new: int, data: st.DataObject) -> None:
    old = data.draw(st.integers(1, new))
    old_root, new_root = rfc_mth(LEAVES[:old]), rfc_mth(LEAVES[:new])
    path = merkle.consistency_path(old, new, MEMORY.read)
    assert merkle.verify_consistency(old, new, old_root, new_root, path)
    if old < new:
        assert rfc_verify_consistency(old, new, old_root, new_root, path)
        assert not rfc_verify_consistency(old, new, rfc_mth(LEAVES[: old - 1]), new_root, path)
    else:
        assert path == []


def test_a_one_byte_change_anywhere_is_refused() -> None:
    size, index, old = 45, 17, 13
    root = merkle.root(size, MEMORY.read)
    path = merkle.inclusion_path(index, size, MEMORY.read)
    leaf = LEAVES[index]
    for i in range(len(leaf)):
        changed = bytearray(leaf)
        changed[i] ^= 1
        assert not rfc_verify_inclusion(index, size, bytes(changed), path, root)
    for j in range(len(path)):
        for i in (0, 31):
            bent = [bytearray(p) for p in path]
            bent[j][i] ^= 0x80
            assert not rfc_verify_inclusion(index, size, leaf, [bytes(p) for p in bent], root)
            assert not merkle.verify_inclusion(
                index, size, merkle.leaf_hash(leaf), [bytes(p) for p in bent], root
            )
    bad_root = bytes([root[0] ^ 1]) + root[1:]
    assert not rfc_verify_inclusion(index, size, leaf, path, bad_root)
    consistency = merkle.consistency_path(old, size, MEMORY.read)
    old_root = merkle.root(old, MEMORY.read)
    for j in range(len(consistency)):
        proof = list(consistency)
        proof[j] = bytes([proof[j][0] ^ 1]) + proof[j][1:]
        assert not rfc_verify_consistency(old, size, old_root, root, proof)
        assert not merkle.verify_consistency(old, size, old_root, root, proof)
    assert not merkle.verify_consistency(old, size, old_root, bad_root, consistency)


# -- the stored tree, on both stores ---------------------------------------------------


def history(app: SchedulerApplication, runners: int = 3, sandboxes: int = 4) -> None:
    for r in range(runners):
        register(app, f"runner-{r}", at=T0)
    for s in range(sandboxes):
        create_sandbox(app, f"sbx-{s}")
    app.record_heartbeat(runner_id="runner-0", at=T0 + timedelta(seconds=1))


def conninfo(store: Store) -> str:
    env = store.env
    return (
        f"host={env['POSTGRES_HOST']} port={env['POSTGRES_PORT']} "
        f"user={env['POSTGRES_USER']} dbname={env['POSTGRES_DBNAME']}"
    )


def stored_rows(store: Store, app: SchedulerApplication) -> dict[int, tuple[Any, ...]]:
    """Every stored event by position, read with SQL (not through the project)."""
    table = app.recorder.events_table_name  # type: ignore[attr-defined]
    if store.kind == "sqlite":
        with sqlite3.connect(store.env["SQLITE_DBNAME"]) as conn:
            rows = conn.execute(
                f"SELECT rowid, originator_id, originator_version, topic, state FROM {table}"
            ).fetchall()
    else:
        schema = store.env["POSTGRES_SCHEMA"]
        with psycopg.connect(conninfo(store)) as conn:
            rows = conn.execute(
                f"SELECT notification_id, originator_id, originator_version, topic, state "
                f'FROM "{schema}"."{table}"'
            ).fetchall()
    return {int(r[0]): tuple(r[1:]) for r in rows}


def test_the_stored_tree_is_rfc_9162s_over_the_documented_leaves(store: Store) -> None:
    app = store.open()
    history(app)
    tree = MerkleTree(app.recorder)
    first = tree.update()
    if store.kind == "postgres":  # a position the sequence skips (a save rolled back)
        with psycopg.connect(conninfo(store)) as conn:
            table = f'"{store.env["POSTGRES_SCHEMA"]}"."{app.recorder.events_table_name}"'  # type: ignore[attr-defined]
            conn.execute(f"SELECT nextval(pg_get_serial_sequence('{table}', 'notification_id'))")
    for s in range(3):
        create_sandbox(app, f"later-{s}")
    size = tree.update()  # incrementally, from the first size
    assert 0 < first < size == tree.log_size()
    rows = stored_rows(store, app)
    assert store.kind == "sqlite" or len(rows) == size - 1  # the gap is a leaf too
    leaves = [documented_leaf(p, rows.get(p)) for p in range(1, size + 1)]
    for n in (1, first, size - 1, size):
        assert merkle.root(n, tree.read) == rfc_mth(leaves[:n])
    for index in (0, first - 1, size - 1):
        path = merkle.inclusion_path(index, size, tree.read)
        assert rfc_verify_inclusion(index, size, leaves[index], path, rfc_mth(leaves))
    path = merkle.consistency_path(first, size, tree.read)
    assert rfc_verify_consistency(first, size, rfc_mth(leaves[:first]), rfc_mth(leaves), path)
    assert tree.rebuild() == size
    assert merkle.root(size, tree.read) == rfc_mth(leaves)
    tree.truncate(first)  # forgotten past the first size, computed again from the log
    assert tree.size() == first
    assert merkle.root(first, tree.read) == rfc_mth(leaves[:first])
    assert tree.update(size - 1) == size - 1
    assert tree.update() == size
    assert merkle.root(size, tree.read) == rfc_mth(leaves)


def test_docs_audit_md_rebuilds_the_leaf_hash_as_the_tree_does() -> None:
    """The snippet of docs/audit.md ("The tree") is the leaf hash of the producer and of
    the layout written again above."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "audit.md").read_text()
    code = next(
        block
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
        if "secondbox-leaf-v1" in block
    )
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    stream = uuid.uuid4()
    row = (stream, 3, "module:Runner.Registered", b'{"a":1}')
    expected = rfc_hash(b"\x00" + documented_leaf(7, row))
    assert namespace["leaf"](7, *row) == expected
    assert merkle.leaf_hash(merkle.leaf_data(7, *row)) == expected
