"""The PostgreSQL statements that the chained recorder (:mod:`.chained_postgres`) and the
sealed snapshots (:mod:`.sealed_postgres`) share: the insert of stored events from
unnested arrays, the chain digests of (id, version) pairs, a snapshot's seal and digest,
and how a statement is rendered once and its arrays passed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventsourcing.persistence import StoredEvent
from eventsourcing.postgres import PostgresAggregateRecorder
from psycopg.sql import SQL, Composed, Identifier, Literal

from secondbox_scheduler.infrastructure.store.typed_arrays import (
    BigintArray,
    ByteaArray,
    TextArray,
    ids_array,
)

MAX_IDENTIFIER_LENGTH = 63  # PostgreSQL's NAMEDATALEN - 1


def quoted(identifier: str) -> str:
    """``identifier`` quoted as PostgreSQL quotes a name (in a function's signature)."""
    return '"' + identifier.replace('"', '""') + '"'


def unnested_insert(recorder: PostgresAggregateRecorder, returning: bool) -> Composed:
    """The recorder's INSERT of stored events from four arrays (ids, versions, topics,
    states) instead of one array of its composite type: psycopg dumps plain arrays
    in binary (``%b``), where the composite array was dumped as text with
    regular-expression escaping of every field (0.7 ms of a batched placement's 2.4 ms
    of Python in a profile)."""
    id_type = SQL(recorder.datastore.originator_id_type)
    statement = SQL(
        "INSERT INTO {schema}.{table} (originator_id, originator_version, topic, state) "
        "SELECT * FROM unnest(%b::{id_type}[], %b::bigint[], %b::text[], %b::bytea[])"
    ).format(
        schema=Identifier(recorder.datastore.schema),
        table=Identifier(recorder.events_table_name),
        id_type=id_type,
    )
    return statement + SQL(" RETURNING notification_id") if returning else statement


def chain_digests_statement(names: dict[str, Identifier]) -> Composed:
    """The chain digest of each (originator id, version) of two arrays, each event found
    through the primary key and its link through the position (``OFFSET 0`` keeps the
    planner from hashing the whole events table when it has no statistics yet)."""
    return SQL(
        "SELECT e.originator_id, e.originator_version, c.digest "
        "FROM unnest(%b::uuid[], %b::bigint[]) AS v(id, version) CROSS JOIN LATERAL "
        "(SELECT originator_id, originator_version, notification_id FROM {schema}.{events} "
        "WHERE originator_id = v.id AND originator_version = v.version OFFSET 0) AS e "
        "CROSS JOIN LATERAL (SELECT digest FROM {schema}.{chain} "
        "WHERE position = e.notification_id OFFSET 0) AS c"
    ).format(**names)


def seal_and_digest(names: dict[str, Identifier], alias: str) -> Composed:
    """A snapshot's seal and the chain digest of the event it was taken at, each read
    through a primary key (correlated subqueries: no plan joins whole tables first)."""
    return SQL(
        "(SELECT g.seal FROM {schema}.{seals} g WHERE g.originator_id = {alias}.originator_id "
        "AND g.originator_version = {alias}.originator_version) AS seal, "
        "(SELECT c.digest FROM {schema}.{events} e JOIN {schema}.{chain} c "
        "ON c.position = e.notification_id WHERE e.originator_id = {alias}.originator_id "
        "AND e.originator_version = {alias}.originator_version) AS digest"
    ).format(alias=Identifier(alias), **names)


def positive_positions_statement(schema: str, events_table: str) -> Composed:
    """``CHECK (notification_id > 0)`` on the events table, added when missing: at the
    table's creation, and by the owner's next start to a table of an earlier release.
    A table that already holds a position <= 0 gets it ``NOT VALID`` (enforced for
    every new row; the rows there stay, as evidence for ``audit verify``, which names
    them) with a warning."""
    name = f"{events_table}_position_positive"
    table = SQL("{}.{}").format(Identifier(schema), Identifier(events_table))
    return SQL(
        "DO $BODY$BEGIN\n"
        "IF NOT EXISTS (SELECT FROM pg_constraint WHERE conrelid = to_regclass({qualified}) "
        "AND conname = {name_literal}) THEN\n"
        "  BEGIN\n"
        "    ALTER TABLE {table} ADD CONSTRAINT {name} CHECK (notification_id > 0);\n"
        "  EXCEPTION WHEN check_violation THEN\n"
        "    ALTER TABLE {table} ADD CONSTRAINT {name} CHECK (notification_id > 0) NOT VALID;\n"
        "    RAISE WARNING '%: positions <= 0 are stored (hidden from the log: run audit "
        "verify)', {qualified};\n"
        "  END;\n"
        "END IF;\n"
        "END$BODY$"
    ).format(
        qualified=Literal(f"{quoted(schema)}.{quoted(events_table)}"),
        name_literal=Literal(name),
        table=table,
        name=Identifier(name),
    )


def compiled(statement: Composed) -> bytes:
    """A statement rendered once, to execute many times."""
    return statement.as_bytes(None)


def unnested(stored_events: Sequence[StoredEvent]) -> tuple[list[Any], ...]:
    """The four arrays (ids, versions, topics, states) of ``stored_events``, each typed
    (:mod:`.typed_arrays`)."""
    return (
        ids_array(s.originator_id for s in stored_events),
        BigintArray([s.originator_version for s in stored_events]),
        TextArray([s.topic for s in stored_events]),
        ByteaArray([s.state for s in stored_events]),
    )


def insert_unnested(curs: Any, statement: bytes, stored_events: Sequence[StoredEvent]) -> None:
    curs.execute(statement, unnested(stored_events), prepare=True)
