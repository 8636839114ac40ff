"""Array parameters whose element type is known, dumped whole without psycopg's work per
element.

A plain Python list passed as a binary parameter (``%b``) makes psycopg look at its
elements on every execution (the types of all of them, then the dumper of the last
one and, for integers, the smallest integer type that holds them), then dump each
element through that type's dumper, a few Python calls per element: a batch's save
passes four arrays of its events and four of its snapshots, about 130 elements for a
batch of ten placements (the largest part of the save's Python in a profile). The
lists below are plain lists (``list`` subclasses, equal to the same list) whose dumper
names its PostgreSQL array type up front and writes the whole array in PostgreSQL's
binary array format (``array_send``: dimensions, element oid, then each element's
length and bytes) in one pass. The statements cast every such parameter to the same
type (``%b::uuid[]``, ``%b::bigint[]``, ...), so the server receives the same array;
only the oid on the wire of an integer array can differ (``int8[]`` where psycopg
chose ``int2[]`` for small values), which the casts absorb. Their elements are never
None (ids, versions, topics and states of stored events); text is encoded in the
connection's encoding, as psycopg's own dumper does.

The dumpers are registered on psycopg's global adapters when this module is imported
(before any connection of the store is made): they apply to these classes only.
``tests/test_typed_arrays.py`` compares every one with psycopg's dump of the same list.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any
from uuid import UUID

import psycopg
from psycopg.adapt import Buffer, Dumper
from psycopg.postgres import types
from psycopg.pq import Format


class UUIDArray(list[UUID]):
    """A ``uuid[]`` parameter."""


class BigintArray(list[int]):
    """A ``bigint[]`` parameter."""


class TextArray(list[str]):
    """A ``text[]`` parameter."""


class ByteaArray(list[bytes]):
    """A ``bytea[]`` parameter."""


_HEAD = struct.Struct("!iIIii").pack  # one dimension, no null, element oid, length, from 1
_EMPTY = struct.Struct("!iII").pack  # no dimension
_LENGTH = struct.Struct("!i").pack
_UUID_LENGTH = _LENGTH(16)
_BIGINT = struct.Struct("!iq").pack  # its length (8), then the value


class _ArrayDumper(Dumper):
    format = Format.BINARY
    element_oid = 0

    def dump(self, obj: Any) -> Buffer | None:
        if not obj:
            return _EMPTY(0, 0, self.element_oid)
        return _HEAD(1, 0, self.element_oid, len(obj), 1) + self.elements(obj)

    def elements(self, obj: Any) -> bytes:
        raise NotImplementedError


class _UUIDArrayDumper(_ArrayDumper):
    oid, element_oid = types["uuid"].array_oid, types["uuid"].oid

    def elements(self, obj: Any) -> bytes:
        return b"".join([_UUID_LENGTH + value.bytes for value in obj])


class _BigintArrayDumper(_ArrayDumper):
    oid, element_oid = types["int8"].array_oid, types["int8"].oid

    def elements(self, obj: Any) -> bytes:
        return b"".join([_BIGINT(8, value) for value in obj])


class _ByteaArrayDumper(_ArrayDumper):
    oid, element_oid = types["bytea"].array_oid, types["bytea"].oid

    def elements(self, obj: Any) -> bytes:
        parts: list[bytes] = []
        for value in obj:
            parts.append(_LENGTH(len(value)))
            parts.append(value)
        return b"".join(parts)


class _TextArrayDumper(_ArrayDumper):
    oid, element_oid = types["text"].array_oid, types["text"].oid

    def __init__(self, cls: type, context: Any = None) -> None:
        super().__init__(cls, context)
        connection = self.connection
        self._encoding = connection.info.encoding if connection is not None else "utf-8"

    def elements(self, obj: Any) -> bytes:
        parts: list[bytes] = []
        encoding = self._encoding
        for value in obj:
            encoded = value.encode(encoding)
            parts.append(_LENGTH(len(encoded)))
            parts.append(encoded)
        return b"".join(parts)


for _cls, _dumper in (
    (UUIDArray, _UUIDArrayDumper),
    (BigintArray, _BigintArrayDumper),
    (TextArray, _TextArrayDumper),
    (ByteaArray, _ByteaArrayDumper),
):
    psycopg.adapters.register_dumper(_cls, _dumper)


def ids_array(ids: Iterable[Any]) -> list[Any]:
    """Originator ids as a ``uuid[]`` parameter when they are UUIDs (the store's default
    id type), else as a plain list (psycopg finds their type, as before)."""
    values = list(ids)
    if values and all(type(value) is UUID for value in values):
        return UUIDArray(values)
    return values
