"""The Merkle tree's table and ``<events>_merkle_extend`` by name, and the statements
that create them with the events' tables (:mod:`.chained_sqlite`,
:mod:`.chained_postgres`); the tree itself is :mod:`.merkle_tree`."""

from __future__ import annotations

from psycopg.sql import SQL, Composed, Identifier

MAX_EXTEND = 1_000_000  # the most leaves one call of <events>_merkle_extend adds


def tree_table(events_table: str) -> str:
    return f"{events_table}_merkle"


def extend_function(events_table: str) -> str:
    return f"{events_table}_merkle_extend"


EXTEND_ARGUMENTS = "bigint"  # the function's signature


def sqlite_create_statement(events_table: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {tree_table(events_table)} (level INTEGER NOT NULL, "
        "idx INTEGER NOT NULL, hash BLOB NOT NULL, PRIMARY KEY (level, idx)) WITHOUT ROWID"
    )


def postgres_create_statements(schema: str, events_table: str) -> list[Composed]:
    """The tree table and ``<events>_merkle_extend``, created with the events' tables."""
    names = {
        "schema": Identifier(schema),
        "events": Identifier(events_table),
        "tree": Identifier(tree_table(events_table)),
        "extend": Identifier(extend_function(events_table)),
    }
    # every statement run with EXECUTE: planned for the range at hand each time (a
    # generic plan of a few new leaves hashed or scanned whole tables)
    prefix = "convert_to('secondbox-leaf-v1', 'UTF8') || int8send(p)"
    leaves = (
        "$q$INSERT INTO {schema}.{tree} (level, idx, hash) "
        "SELECT 0, e.notification_id - 1, sha256(decode('00', 'hex') || "
        + prefix.replace("int8send(p)", "int8send(e.notification_id)")
        + " || decode('01', 'hex') || uuid_send(e.originator_id) "
        "|| int8send(e.originator_version::bigint) "
        "|| int8send(octet_length(convert_to(e.topic, 'UTF8'))::bigint) "
        "|| convert_to(e.topic, 'UTF8') || int8send(octet_length(e.state)::bigint) "
        "|| e.state) FROM {schema}.{events} e "
        "WHERE e.notification_id > $1 AND e.notification_id <= $2$q$"
    )
    gaps = (
        "$q$INSERT INTO {schema}.{tree} (level, idx, hash) "
        "SELECT 0, g.p - 1, sha256(decode('00', 'hex') || "
        + prefix.replace("int8send(p)", "int8send(g.p)")
        + " || decode('00', 'hex')) FROM generate_series($1 + 1, $2) AS g(p) "
        "WHERE NOT EXISTS (SELECT FROM {schema}.{events} e WHERE e.notification_id = g.p)$q$"
    )
    nodes = (
        "$q$INSERT INTO {schema}.{tree} (level, idx, hash) "
        "SELECT $1, l.idx / 2, sha256(decode('01', 'hex') || l.hash || r.hash) "
        "FROM {schema}.{tree} l JOIN {schema}.{tree} r ON r.level = $1 - 1 AND r.idx = l.idx + 1 "
        "WHERE l.level = $1 - 1 AND l.idx >= $2 AND l.idx < $3 AND l.idx % 2 = 0$q$"
    )
    return [
        SQL(
            "CREATE TABLE IF NOT EXISTS {schema}.{tree} (level smallint NOT NULL, "
            "idx bigint NOT NULL, hash bytea NOT NULL, PRIMARY KEY (level, idx))"
        ).format(**names),
        SQL(
            "CREATE OR REPLACE FUNCTION {schema}.{extend}(max_leaves bigint) RETURNS bigint "
            "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $BODY$\n"
            "DECLARE\n"
            "  size bigint; target bigint; lvl smallint := 1; added bigint;\n"
            "BEGIN\n"
            "  IF max_leaves IS NULL OR max_leaves < 1 OR max_leaves > " + str(MAX_EXTEND) + " "
            "THEN\n"
            "    RAISE EXCEPTION 'secondbox: max_leaves is 1 to " + str(MAX_EXTEND) + "';\n"
            "  END IF;\n"
            "  LOCK TABLE {schema}.{tree} IN SHARE ROW EXCLUSIVE MODE;\n"
            "  SELECT coalesce(max(t.idx) + 1, 0) INTO size FROM {schema}.{tree} t "
            "WHERE t.level = 0;\n"
            "  SELECT coalesce(max(e.notification_id), 0) INTO target FROM {schema}.{events} e;\n"
            "  target := least(target, size + max_leaves);\n"
            "  IF target <= size THEN RETURN size; END IF;\n"
            "  EXECUTE " + leaves + " USING size, target;\n"
            "  GET DIAGNOSTICS added = ROW_COUNT;\n"
            "  IF added < target - size THEN\n"  # positions the sequence skipped
            "    EXECUTE " + gaps + " USING size, target;\n"
            "  END IF;\n"
            "  WHILE (target >> lvl) > (size >> lvl) LOOP\n"
            "    EXECUTE " + nodes + " USING lvl, 2 * (size >> lvl), 2 * (target >> lvl);\n"
            "    lvl := lvl + 1;\n"
            "  END LOOP;\n"
            "  RETURN target;\n"
            "END;$BODY$"
        ).format(**names),
    ]
