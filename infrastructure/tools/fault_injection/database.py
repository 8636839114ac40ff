"""The fault-injection run's own PostgreSQL database: created fresh, dropped afterwards."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import psycopg


def fault_run_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("verify needs a postgresql:// URL (replicas coordinate through it)")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}", query=""))


def drop_database(url: str, name: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
