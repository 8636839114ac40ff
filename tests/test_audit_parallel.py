"""``audit verify --workers N`` finds what the serial verify finds: the same list of
violations in the same order, the same chain and Merkle reports, over clean and
tampered histories on both stores (the tamper operations of ``tests/test_tamper.py``)."""

from __future__ import annotations

import json
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from secondbox_scheduler.domain.audit.chain import Checkpoint
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit import parallel_verify, snapshot_check
from secondbox_scheduler.infrastructure.audit.parallel_verify import can_fork
from secondbox_scheduler.infrastructure.audit.verify import AuditReport, checkpoint, verify
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.store.chain_reads import snapshot_rows
from tests.test_tamper import (
    EDITS,
    OPERATIONS,
    Copy,
    copy_of,
    simulated,
    tamper,
)

__all__ = ["copy_of", "simulated"]  # the fixtures, from tests/test_tamper.py


def _compared(report: AuditReport) -> dict[str, Any]:
    """Everything a verify reports but its timings."""
    found = report.to_dict()
    for rate in ("seconds", "raw_seconds", "events_per_second", "raw_events_per_second"):
        found.pop(rate, None)
    found.pop("ratio_to_raw_read", None)
    return found


def _all_ways(
    copy: Copy, against: Checkpoint | None = None, until: int | None = None
) -> list[dict[str, Any]]:
    """The reports of the serial verify and of 2 and 3 processes, in that order."""
    reports = []
    for workers in (1, 2, 3):
        app = copy.open()
        try:
            assert can_fork(app)  # else the parallel runs would be serial ones
            report = verify(app, until, measure_raw=False, checkpoint=against, workers=workers)
            reports.append(_compared(report))
        finally:
            app.close()
    return reports


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parallel_verify_finds_what_the_serial_verify_finds_after_tampering(
    kind: str, operation: str, data: st.DataObject, copy_of: Callable[[str], Copy]
) -> None:
    copy = copy_of(kind)
    app = copy.open()
    try:
        _, mark = tamper(copy.raw, operation, data, app)
    finally:
        app.close()
    serial, two, three = _all_ways(copy, mark)
    assert serial["violations"], "a tampered history has findings"
    assert two == serial
    assert three == serial


@pytest.mark.parametrize("edit", ["fencing token digit", "delete mid-stream LivenessRenewed",
                                  "swap two renewals", "refusal summary"])  # fmt: skip
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_parallel_verify_finds_what_the_serial_verify_finds_after_an_edit(
    kind: str, edit: str, copy_of: Callable[[str], Copy]
) -> None:
    copy = copy_of(kind)
    EDITS[edit](copy.raw)
    serial, two, three = _all_ways(copy)
    assert serial["violations"]
    assert two == serial
    assert three == serial


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_several_kinds_of_tampering_at_once_and_a_cut(
    kind: str, copy_of: Callable[[str], Copy]
) -> None:
    copy = copy_of(kind)
    raw = copy.raw
    app = copy.open()
    try:
        mark = checkpoint(app)
    finally:
        app.close()
    positions = raw.positions()
    EDITS["fencing token digit"](raw)
    raw.delete(positions[len(positions) // 3], link=True)  # events deleted with their links
    raw.delete(positions[len(positions) // 2])  # a link without its event
    for stream, version, state in raw.rows(  # a few snapshots forged
        "SELECT originator_id, originator_version, state FROM {snapshots} "
        "ORDER BY originator_version LIMIT 3"
    ):
        raw.rows(
            "UPDATE {snapshots} SET state = ? WHERE originator_id = ? AND originator_version = ?",
            bytes(state) + b" ",
            stream,
            version,
        )
    raw.rows(  # a link planted past the log's end
        "INSERT INTO {chain} (position, previous, digest) VALUES (?, ?, ?)",
        positions[-1] + 5,
        positions[1],
        bytes(32),
    )
    serial, two, three = _all_ways(copy, mark)
    rules = {violation["rule"] for violation in serial["violations"]}
    assert {"chain-edited", "chain-deleted", "chain-stray-link", "snapshot"} <= rules
    assert two == serial
    assert three == serial
    cut = positions[len(positions) * 2 // 3]
    serial, two, three = _all_ways(copy, until=cut)
    assert serial["position"] <= cut
    assert two == serial
    assert three == serial


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_clean_history_verifies_the_same_in_parallel(
    kind: str, copy_of: Callable[[str], Copy]
) -> None:
    serial, two, three = _all_ways(copy_of(kind))
    assert serial["ok"]
    assert serial["chain"]["links_checked"] > 0
    assert serial["chain"]["snapshots_checked"] > 0
    assert two == serial
    assert three == serial


def test_a_child_that_fails_has_its_part_run_in_this_process(
    copy_of: Callable[[str], Copy], monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = copy_of("sqlite")
    EDITS["fencing token digit"](copy.raw)
    serial = _all_ways(copy)[0]

    def dies(connection: Any, env: dict[str, str], arguments: tuple[Any, ...]) -> None:
        connection.close()  # no answer: the parent reads the end of the pipe

    monkeypatch.setattr(parallel_verify, "_child", dies)
    app: SchedulerApplication = copy.open()
    try:
        report = verify(app, measure_raw=False, workers=2)
    finally:
        app.close()
    assert _compared(report) == serial


def test_the_cli_verifies_with_the_workers_it_is_given(copy_of: Callable[[str], Copy]) -> None:
    copy = copy_of("sqlite")
    EDITS["delete mid-stream LivenessRenewed"](copy.raw)
    url = f"sqlite:///{copy.open().env['SQLITE_DBNAME']}"
    found = []
    for workers in ("1", "3"):
        result = CliRunner().invoke(
            cli, ["audit", "verify", "--database-url", url, "--json", "--workers", workers]
        )
        assert result.exit_code == 1, result.output
        found.append(json.loads(result.output)["violations"])
    assert found[0]
    assert found[0] == found[1]
    refused = CliRunner().invoke(cli, ["audit", "verify", "--database-url", url, "--workers", "0"])
    assert refused.exit_code == 2


def test_snapshot_chunks_read_ahead_find_what_chunks_read_in_turn_find(
    copy_of: Callable[[str], Copy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL the snapshot check reads the next chunk of states in a thread while
    the events reach the current one; the findings are those of reading each in turn."""
    copy = copy_of("postgres")
    raw = copy.raw
    for stream, version, state in raw.rows(  # a few snapshots forged
        "SELECT originator_id, originator_version, state FROM {snapshots} "
        "ORDER BY originator_version DESC LIMIT 4"
    ):
        raw.rows(
            "UPDATE {snapshots} SET state = ? WHERE originator_id = ? AND originator_version = ?",
            bytes(state).replace(b'"reserved"', b'"reserveD"', 1) + b" ",
            stream,
            version,
        )
    raw.delete(raw.positions()[40])
    monkeypatch.setattr(snapshot_check, "STATE_CHUNK_ROWS", 2)  # several chunks a page
    threads: list[str] = []
    reads = snapshot_rows

    def recorded(recorder: Any, keys: list[Any]) -> Any:
        threads.append(threading.current_thread().name)
        return reads(recorder, keys)

    monkeypatch.setattr(snapshot_check, "snapshot_rows", recorded)
    ahead = _all_ways(copy)
    assert any(name.startswith("snapshot-read-ahead") for name in threads)
    monkeypatch.setattr(snapshot_check, "SealedPostgresSnapshots", type("Other", (), {}))
    threads.clear()
    in_turn = _all_ways(copy)
    assert threads
    assert not any(name.startswith("snapshot-read-ahead") for name in threads)
    assert "snapshot" in {violation["rule"] for violation in in_turn[0]["violations"]}
    assert ahead == in_turn


def test_an_error_of_the_fold_is_the_verify_s_and_leaves_no_child(
    copy_of: Callable[[str], Copy], monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = copy_of("sqlite")

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the fold failed")

    monkeypatch.setattr(parallel_verify, "fold_part", fails)
    app = copy.open()
    try:
        with pytest.raises(RuntimeError, match="the fold failed"):
            verify(app, measure_raw=False, workers=3)
    finally:
        app.close()
    assert multiprocessing.active_children() == []
