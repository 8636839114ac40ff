"""Row-level changes of a view, folded in memory into one net change per row.

A projection turns each event into :class:`Insert` and :class:`Update` values instead of
SQL statements. A :class:`NetChanges` folds a batch of them, in log order, into one
final change per row: an update of a row inserted in the same batch lands in the
inserted values, and successive updates of one row become one update (``set`` columns:
the last value wins; ``add`` columns: the deltas add up). The view then writes the
batch with one statement per shape (``executemany``), or ``COPY`` for many inserted
rows on PostgreSQL, instead of one statement per change. Values are kept as Python
values until then: a view's ``encoders`` (JSON, time text) run once per net row, not
once per change.

The fold gives the same rows as applying the changes one by one, provided that:

- an update names its row by one of the view's unique ``keys`` and changes no column
  of any key;
- updates of one row through *different* keys change disjoint columns (their order
  relative to each other is not kept across keys);
- an update of a row that does not exist changes nothing (as an SQL ``UPDATE`` does),
  so an update followed in the batch by the insert of its row is dropped; an insert of
  a row that already exists fails (unique key), as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, ...]
Encoders = Mapping[str, Callable[[Any], Any]]


@dataclass(slots=True)
class Insert:
    """Insert a row with these column values (a batch folds later updates of the row
    into this dictionary: give each change its own)."""

    values: dict[str, Any]


@dataclass(slots=True)
class Update:
    """Update the row whose ``key`` columns equal ``match``: ``set`` columns to values,
    ``add`` deltas to columns (a NULL column stays NULL, as in SQL)."""

    key: Key
    match: tuple[Any, ...]
    set: dict[str, Any] = field(default_factory=dict)
    add: dict[str, int] = field(default_factory=dict)


RowChange = Insert | Update


@dataclass(slots=True)
class PendingUpdate:
    """The net update of one existing row (not inserted in the batch)."""

    key: Key
    match: tuple[Any, ...]
    set: dict[str, Any]
    add: dict[str, int]

    def shape(self) -> tuple[Key, tuple[str, ...], tuple[str, ...]]:
        return self.key, tuple(self.set), tuple(self.add)


class NetChanges:
    """A batch of row changes folded into one net change per row."""

    __slots__ = ("inserts", "keys", "rows", "updates")

    def __init__(self, keys: tuple[Key, ...]) -> None:
        self.keys = keys
        self.inserts: list[dict[str, Any]] = []
        self.rows: dict[tuple[Key, tuple[Any, ...]], dict[str, Any]] = {}  # inserted, by key
        self.updates: dict[tuple[Key, tuple[Any, ...]], PendingUpdate] = {}

    def __len__(self) -> int:
        return len(self.inserts) + len(self.updates)

    def extend(self, changes: Iterable[RowChange]) -> NetChanges:
        for change in changes:
            if isinstance(change, Update):
                self.update(change)
            else:
                self.insert(change)
        return self

    def insert(self, change: Insert) -> None:
        row = change.values  # the fold updates it in place: a change is used once
        self.inserts.append(row)
        for key in self.keys:
            alias = (key, tuple(row[column] for column in key))
            self.rows[alias] = row
            self.updates.pop(alias, None)  # it updated a row that did not exist yet

    def update(self, change: Update) -> None:
        alias = (change.key, change.match)
        row = self.rows.get(alias)
        if row is not None:
            row.update(change.set)
            for column, delta in change.add.items():
                value = row[column]
                row[column] = None if value is None else value + delta
            return
        pending = self.updates.get(alias)
        if pending is None:
            self.updates[alias] = PendingUpdate(
                change.key, change.match, dict(change.set), dict(change.add)
            )
            return
        for column, value in change.set.items():
            pending.set[column] = value
            pending.add.pop(column, None)
        for column, delta in change.add.items():
            if column in pending.set:
                value = pending.set[column]
                pending.set[column] = None if value is None else value + delta
            else:
                pending.add[column] = pending.add.get(column, 0) + delta

    def insert_groups(self, encoders: Encoders) -> dict[tuple[str, ...], list[tuple[Any, ...]]]:
        """Inserted rows grouped by their columns, as value tuples in insertion order,
        with ``encoders`` applied to their columns' values (not to NULLs)."""
        groups: dict[tuple[str, ...], list[tuple[Any, ...]]] = {}
        for row in self.inserts:
            groups.setdefault(tuple(row), []).append(tuple(row.values()))
        return {
            columns: _encoded(columns, rows, encoders, len(columns))
            for columns, rows in groups.items()
        }

    def update_groups(
        self, encoders: Encoders
    ) -> dict[tuple[Key, tuple[str, ...], tuple[str, ...]], list[tuple[Any, ...]]]:
        """Net updates grouped by shape (key, set columns, add columns), as parameter
        tuples: set values (encoded), add deltas, then the key values."""
        groups: dict[tuple[Key, tuple[str, ...], tuple[str, ...]], list[tuple[Any, ...]]] = {}
        for pending in self.updates.values():
            params = (*pending.set.values(), *pending.add.values(), *pending.match)
            groups.setdefault(pending.shape(), []).append(params)
        return {
            shape: _encoded(shape[1], rows, encoders, len(shape[1]))
            for shape, rows in groups.items()
        }


def _encoded(
    columns: tuple[str, ...], rows: list[tuple[Any, ...]], encoders: Encoders, width: int
) -> list[tuple[Any, ...]]:
    """``rows`` with their first ``width`` values (of ``columns``) encoded."""
    coded = [(index, encoders[column]) for index, column in enumerate(columns[:width])
             if column in encoders]  # fmt: skip
    if not coded:
        return rows
    result = []
    for row in rows:
        values = list(row)
        for index, encode in coded:
            value = values[index]
            if value is not None:
                values[index] = encode(value)
        result.append(tuple(values))
    return result


__all__ = ["Encoders", "Insert", "Key", "NetChanges", "PendingUpdate", "RowChange", "Update"]
