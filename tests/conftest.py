"""Shared fixtures: a controllable clock and the two stores every application test runs on.

``store`` is parametrised over SQLite (a file in the test's tmp_path) and PostgreSQL
(a schema of its own in the server's database, dropped afterwards), so each test is
isolated and tests run in any order.

Hypothesis runs under one of two profiles, chosen by ``SECONDBOX_HYPOTHESIS_PROFILE``:
``ci`` (the default: derandomized, so every run of the suite tries the same examples
and a bug it catches is caught in every run) and ``deep`` (random, and the state
machine and other property tests try many more examples: for a longer local hunt).
See docs/verification.md.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from hypothesis import settings

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.store.encoding import EventMapper
from secondbox_scheduler.testing.builders import T0 as T0
from secondbox_scheduler.testing.builders import Clock as Clock
from tests.postgres_server import PostgresServer, ThrowawayCluster, from_environment

HYPOTHESIS_PROFILE = os.environ.get("SECONDBOX_HYPOTHESIS_PROFILE", "ci")
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("deep", deadline=None, print_blob=True)
settings.load_profile(HYPOTHESIS_PROFILE)

# Every event the suite saves through the orjson path is also encoded with json and the
# two compared (infrastructure/store/encoding.py): a domain event whose state orjson
# would write differently fails the test that saved it.
EventMapper.check = True


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = from_environment()
    if server is not None:
        yield server
        return
    try:
        cluster = ThrowawayCluster()
    except Exception as error:  # no binaries, or they failed to start
        pytest.fail(f"{error}", pytrace=False)
    try:
        yield cluster.server
    finally:
        cluster.stop()


@dataclass
class PostgresSchema:
    server: PostgresServer
    name: str

    def env(self) -> dict[str, str]:
        return {**self.server.env(), "POSTGRES_SCHEMA": self.name}

    def url(self) -> str:
        return self.server.url(self.name)


@pytest.fixture
def postgres_schema(postgres_server: PostgresServer) -> Iterator[PostgresSchema]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    try:
        yield PostgresSchema(postgres_server, name)
    finally:
        with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@dataclass
class Store:
    """Opens applications (scheduler replicas) on one isolated store."""

    kind: str
    env: dict[str, str]
    clock: Clock
    opened: list[SchedulerApplication] = field(default_factory=list)

    def open(
        self, now: Callable[[], datetime] | None = None, **kwargs: object
    ) -> SchedulerApplication:
        app = SchedulerApplication(env=dict(self.env), now=now or self.clock, **kwargs)  # type: ignore[arg-type]
        self.opened.append(app)
        return app

    def close(self) -> None:
        for app in self.opened:
            app.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[Store]:
    if request.param == "sqlite":
        env = {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": str(tmp_path / "s.db"),
        }
    else:
        schema: PostgresSchema = request.getfixturevalue("postgres_schema")
        env = schema.env()
    opened = Store(request.param, env, clock)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def app(store: Store) -> SchedulerApplication:
    return store.open()
