"""The chain cannot be poisoned (docs/audit.md, "Tamper evidence"): one link planted far
ahead of the log by someone with write access to the chain table (the schema owner, a
superuser) makes every later save link to it (the head of the chain is the link of the
highest position). ``audit verify`` names the planted link as a finding of its own,
reports nothing "deleted" that is not, and goes on checking every later event's digest
against its stored link: an edit of an event saved after the plant is still reported.
"""

from __future__ import annotations

from typing import Any

import pytest

from secondbox_scheduler.domain.audit.chain import Chain, ChainedEvent, ChainVerifier, Link
from secondbox_scheduler.infrastructure.audit.verify import verify
from tests.conftest import Clock, PostgresSchema, Store
from tests.factories import create_sandbox, register, schedule_request
from tests.postgres_server import PostgresServer

FAR = 10**9


def _execute(
    store: Store, server: PostgresServer | None, statement: str, *params: object
) -> list[tuple[Any, ...]]:
    """Raw SQL on the store's tables, behind the application's back (on PostgreSQL as
    the administrator, who may write the chain table)."""
    if store.kind == "sqlite":
        import sqlite3
        from contextlib import closing

        with closing(sqlite3.connect(store.env["SQLITE_DBNAME"])) as lite, lite:
            text = statement.format(events="stored_events", p="rowid", chain="stored_events_chain")
            return lite.execute(text, params).fetchall()
    import psycopg

    assert server is not None
    schema = store.env["POSTGRES_SCHEMA"]
    text = statement.format(
        events=f'"{schema}".schedulerapplication_events',
        p="notification_id",
        chain=f'"{schema}".schedulerapplication_events_chain',
    ).replace("?", "%s")
    with psycopg.connect(server.conninfo(), autocommit=True) as connection:
        cursor = connection.execute(text, params)
        return cursor.fetchall() if cursor.description else []


def _server(store: Store, request: pytest.FixtureRequest) -> PostgresServer | None:
    if store.kind == "sqlite":
        return None
    schema: PostgresSchema = request.getfixturevalue("postgres_schema")
    return schema.server


def _placements(app: object, clock: Clock, names: list[str]) -> None:
    for name in names:
        assert create_sandbox(app, name) == "r1"  # type: ignore[arg-type]
        app.schedule(schedule_request(name, clock()))  # type: ignore[attr-defined]
        clock.advance(seconds=1)


def test_a_link_planted_far_ahead_is_reported_and_later_edits_still_are(
    store: Store, clock: Clock, request: pytest.FixtureRequest
) -> None:
    server = _server(store, request)
    app = store.open()
    register(app, "r1", at=clock())
    _placements(app, clock, ["s1", "s2"])
    planted_after = app.head_position()
    _execute(store, server, "INSERT INTO {chain} VALUES (?, ?, ?)", FAR, FAR - 1, b"\x01" * 32)
    _placements(app, clock, ["s3", "s4"])  # every later save links to the planted link
    # the first event of every later save links to the planted link: edit the last one
    linked = _execute(store, server, "SELECT position FROM {chain} WHERE previous = ?", FAR)
    assert len(linked) >= 2, linked
    edited = max(int(row[0]) for row in linked)
    assert edited > planted_after
    rows = _execute(store, server, "SELECT {p}, state FROM {events} WHERE {p} = ?", edited)
    state = bytes(rows[0][1]) + b" "  # still decodes: only the chain can tell
    _execute(store, server, "UPDATE {events} SET state = ? WHERE {p} = ?", state, edited)
    report = verify(app, measure_raw=False)
    found = {(v.position, v.rule) for v in report.violations}
    assert (FAR, "chain-stray-link") in found, report.violations
    assert (edited, "chain-edited") in found, report.violations
    assert not [v for v in report.violations if v.rule == "chain-deleted"], report.violations
    assert len(report.violations) == 2, report.violations


def test_a_planted_link_alone_is_one_finding_naming_its_position(
    store: Store, clock: Clock, request: pytest.FixtureRequest
) -> None:
    server = _server(store, request)
    app = store.open()
    register(app, "r1", at=clock())
    _placements(app, clock, ["s1"])
    _execute(store, server, "INSERT INTO {chain} VALUES (?, ?, ?)", FAR, FAR - 1, b"\x01" * 32)
    _placements(app, clock, ["s2", "s3"])
    report = verify(app, measure_raw=False)
    assert [(v.position, v.rule) for v in report.violations] == [(FAR, "chain-stray-link")]
    assert str(FAR) in report.violations[0].detail


# -- the verifier alone (pure) ------------------------------------------------------


def _event(position: int) -> ChainedEvent:
    return ChainedEvent(position, f"stream-{position}", 1, "topic", b"state %d" % position)


def _log(chain: Chain, count: int) -> tuple[list[ChainedEvent], list[Link]]:
    events = [_event(p) for p in range(1, count + 1)]
    return events, chain.links(None, events)


def test_the_verifier_checks_every_digest_after_a_missing_link() -> None:
    chain = Chain()
    events, links = _log(chain, 8)
    verifier = ChainVerifier(chain)
    # position 3: event and link deleted; position 6: its state edited afterwards
    edited = ChainedEvent(6, "stream-6", 1, "topic", b"edited")
    for event, link in zip(events, links, strict=True):
        if event.position == 3:
            continue
        verifier.feed(edited if event.position == 6 else event, link)
    verifier.finish()
    kinds = [(f.position, f.kind) for f in verifier.findings]
    assert kinds == [(3, "deleted"), (6, "edited")]


def test_the_verifier_tells_a_deleted_event_from_a_stray_link() -> None:
    chain = Chain()
    events, links = _log(chain, 5)
    deleted = ChainVerifier(chain)  # the event at 3 deleted, its link left
    for event, link in zip(events, links, strict=True):
        deleted.feed(None if event.position == 3 else event, link)
    deleted.finish()
    assert [(f.position, f.kind) for f in deleted.findings] == [(3, "deleted")]
    # a link inserted at an unused position (a gap of the sequence): no event deleted
    stray = Link(35, 3, b"\x02" * 32)
    gapped = [ChainedEvent(p if p <= 3 else p * 10, "s", p, "t", b"x") for p in range(1, 6)]
    gapped_links = chain.links(None, gapped)
    planted = ChainVerifier(chain)
    for event, link in zip(gapped, gapped_links, strict=True):
        if event.position == 40:
            planted.feed(None, stray)
        planted.feed(event, link)
    planted.finish()
    assert [(f.position, f.kind) for f in planted.findings] == [(35, "stray-link")]
