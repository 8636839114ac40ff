"""Array parameters whose element type is known, dumped without psycopg's search for it.

A plain Python list passed as a binary parameter (``%b``) makes psycopg look at its
elements on every execution: the types of all of them, then the dumper of the last
one and, for integers, the smallest integer type that holds them, before dumping
(``ListBinaryDumper.get_key`` and ``upgrade``, 6 to 7% of a batched placement's
Python in a profile: every save passes four to eight such arrays, every load two).
The lists below are lists (``list`` subclasses, equal to the same plain list) whose
dumper names its PostgreSQL array type up front: psycopg takes it as it is and dumps
each element with the element type's own binary dumper. The statements cast every
such parameter to the same type (``%b::uuid[]``, ``%b::bigint[]``, ...), so what the
server receives is the same array; only the oid on the wire of an integer array can
differ (``int8[]`` where psycopg chose ``int2[]`` for small values), which the casts
absorb.

The dumpers are registered on psycopg's global adapters when this module is imported
(before any connection of the store is made): they apply to these classes only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from uuid import UUID

import psycopg
from psycopg.postgres import types
from psycopg.types.array import ListBinaryDumper


class UUIDArray(list[UUID]):
    """A ``uuid[]`` parameter."""


class BigintArray(list[int]):
    """A ``bigint[]`` parameter."""


class TextArray(list[str]):
    """A ``text[]`` parameter."""


class ByteaArray(list[bytes]):
    """A ``bytea[]`` parameter."""


def _dumper(name: str, element: str) -> type[ListBinaryDumper]:
    info = types[element]
    attributes = {"oid": info.array_oid, "element_oid": info.oid}
    return type(f"{name}BinaryDumper", (ListBinaryDumper,), attributes)


for _cls, _element in (
    (UUIDArray, "uuid"),
    (BigintArray, "int8"),
    (TextArray, "text"),
    (ByteaArray, "bytea"),
):
    psycopg.adapters.register_dumper(_cls, _dumper(_cls.__name__, _element))


def ids_array(ids: Iterable[Any]) -> list[Any]:
    """Originator ids as a ``uuid[]`` parameter when they are UUIDs (the store's default
    id type), else as a plain list (psycopg finds their type, as before)."""
    values = list(ids)
    if values and all(type(value) is UUID for value in values):
        return UUIDArray(values)
    return values
