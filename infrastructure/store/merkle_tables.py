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
    leaf = (
        "sha256(decode('00', 'hex') || convert_to('secondbox-leaf-v1', 'UTF8') "
        "|| int8send(g.p) || CASE WHEN e.notification_id IS NULL THEN decode('00', 'hex') "
        "ELSE decode('01', 'hex') || uuid_send(e.originator_id) "
        "|| int8send(e.originator_version::bigint) "
        "|| int8send(octet_length(convert_to(e.topic, 'UTF8'))::bigint) "
        "|| convert_to(e.topic, 'UTF8') || int8send(octet_length(e.state)::bigint) "
        "|| e.state END)"
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
            "  size bigint; target bigint; lvl int := 1;\n"
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
            "  INSERT INTO {schema}.{tree} (level, idx, hash) "
            "SELECT 0, g.p - 1, " + leaf + " FROM generate_series(size + 1, target) AS g(p) "
            "LEFT JOIN {schema}.{events} e ON e.notification_id = g.p;\n"
            "  WHILE (target >> lvl) > (size >> lvl) LOOP\n"
            "    INSERT INTO {schema}.{tree} (level, idx, hash) "
            "SELECT lvl, l.idx / 2, sha256(decode('01', 'hex') || l.hash || r.hash) "
            "FROM {schema}.{tree} l JOIN {schema}.{tree} r "
            "ON r.level = lvl - 1 AND r.idx = l.idx + 1 "
            "WHERE l.level = lvl - 1 AND l.idx >= 2 * (size >> lvl) "
            "AND l.idx < 2 * (target >> lvl) AND l.idx % 2 = 0;\n"
            "    lvl := lvl + 1;\n"
            "  END LOOP;\n"
            "  RETURN target;\n"
            "END;$BODY$"
        ).format(**names),
    ]
