"""The typed array parameters (infrastructure/store/typed_arrays.py) reach PostgreSQL as
the arrays psycopg's own dump of the same plain lists makes: the same bytes for ids,
topics and states, the same values for versions, in any client encoding."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from psycopg.adapt import PyFormat, Transformer

from secondbox_scheduler.infrastructure.store.typed_arrays import (
    BigintArray,
    ByteaArray,
    TextArray,
    UUIDArray,
    ids_array,
)
from tests.postgres_server import PostgresServer

IDS = [uuid.uuid4() for _ in range(5)]
VERSIONS = [1, 2, 255, 70_000, 2**40, 2**63 - 1]
TOPICS = ["secondbox_scheduler.domain.runner:Runner.CapacityReserved", "tøpic:Ünïcode", ""]
STATES = [b"{}", b"", bytes(range(256)) * 3, b"x" * 300_000]


def _dumped(conn: psycopg.Connection[Any], value: list[Any]) -> bytes:
    dumped = Transformer(conn).dump_sequence([value], [PyFormat.BINARY])[0]
    assert dumped is not None
    return bytes(dumped)


@pytest.mark.parametrize(
    ("typed", "plain"),
    [
        (UUIDArray(IDS), IDS),
        (TextArray(TOPICS), TOPICS),
        (ByteaArray(STATES), STATES),
        (UUIDArray([IDS[0]]), [IDS[0]]),
    ],
)
def test_the_same_bytes_as_psycopgs_dump(
    postgres_server: PostgresServer, typed: list[Any], plain: list[Any]
) -> None:
    with psycopg.connect(postgres_server.conninfo()) as conn:
        assert typed == plain
        assert _dumped(conn, typed) == _dumped(conn, plain)


@pytest.mark.parametrize(
    ("value", "cast"),
    [
        (UUIDArray(IDS), "uuid[]"),
        (BigintArray(VERSIONS), "bigint[]"),
        (TextArray(TOPICS), "text[]"),
        (ByteaArray(STATES), "bytea[]"),
        (UUIDArray(), "uuid[]"),
        (BigintArray(), "bigint[]"),
        (TextArray(), "text[]"),
        (ByteaArray(), "bytea[]"),
    ],
)
def test_the_server_reads_the_values_back(
    postgres_server: PostgresServer, value: list[Any], cast: str
) -> None:
    with psycopg.connect(postgres_server.conninfo()) as conn:
        row = conn.execute(f"SELECT %b::{cast}, cardinality(%b::{cast})", (value, value)).fetchone()
        assert row is not None
        assert row[0] == list(value)
        assert row[1] == len(value)


def test_text_in_the_connections_encoding(postgres_server: PostgresServer) -> None:
    with psycopg.connect(postgres_server.conninfo()) as conn:
        conn.execute("SET client_encoding TO 'LATIN1'")
        topics = ["tøpic:Ünïcode", "plain"]
        row = conn.execute("SELECT %b::text[]", (TextArray(topics),)).fetchone()
        assert row is not None
        assert row[0] == topics


def test_ids_that_are_not_uuids_stay_a_plain_list() -> None:
    assert type(ids_array(IDS)) is UUIDArray
    assert type(ids_array(["a", "b"])) is list
    assert type(ids_array([])) is list
