"""What SQLite keeps beside the runner snapshots so that a refusal over a large pool does
not read it twice (projections/runner_snapshots.py, projections/unmatched.py).

- The side table of materialization digests, kept by triggers: equal to the rows'
  materializations after registrations, heartbeats with evidence, deregistrations and a
  rebuild; filled from the rows when a store made before it opens; untouched by a
  placement (no trigger fires); compared by ``projections verify``.
- The index of each pool's registered runners by the columns the refusal compares:
  ``alike_in_pool`` answers from its first and last entries, and a refusal surveyed
  without the texts is the full scan's refusal.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import secondbox_scheduler.infrastructure.queries as queries
import secondbox_scheduler.projections.unmatched as unmatched
from secondbox_scheduler.domain.errors import PlacementError
from secondbox_scheduler.domain.values import MaterializationSnapshot
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.read_model_verify import DIGESTS, verify_read_models
from secondbox_scheduler.projections.read_models import ReadModels, rebuild
from secondbox_scheduler.projections.row_changes import Update
from secondbox_scheduler.projections.runner_snapshots import (
    MATERIALIZATION_DIGESTS,
    RESERVED,
    RunnerSnapshotsView,
)
from tests.conftest import Clock, PostgresSchema, Store
from tests.factories import (
    CAPABILITIES,
    RUNTIME,
    TOOLCHAIN,
    capacity,
    create_sandbox,
    materialization,
    register,
    schedule_request,
)

NOBODY = "sha256:toolchain-nobody-has"


def _read_models(app: SchedulerApplication) -> ReadModels:
    read_models = app.queries.current_read_models()
    assert read_models is not None
    return read_models


def _sql(view: RunnerSnapshotsView, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """Run ``sql`` on the view's database behind the application's back."""
    with view.datastore.transaction(commit=True) as cursor:  # type: ignore[attr-defined]
        cursor.execute(view._sql(view._format(sql)), params)
        return list(cursor.fetchall())


def _item(runtime: str, toolchain: str) -> MaterializationSnapshot:
    return MaterializationSnapshot(
        backend_kind="firecracker",
        architecture="x86_64",
        runtime_digest=runtime,
        toolchain_digest=toolchain,
        digest="sha256:m",
    )


@pytest.fixture
def sqlite_store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    """A SQLite store only (its side table and index)."""
    env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "s.db")}
    opened = Store("sqlite", env, clock)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def postgres_store(postgres_schema: PostgresSchema, clock: Clock) -> Iterator[Store]:
    """A PostgreSQL store only (its heap-only tuples)."""
    opened = Store("postgres", postgres_schema.env(), clock)
    try:
        yield opened
    finally:
        opened.close()


def test_the_side_table_follows_the_rows(sqlite_store: Store, clock: Clock) -> None:
    app = sqlite_store.open()
    register(app, "r1", at=clock())
    register(app, "r2", at=clock())
    register(app, "r3", at=clock(), heartbeat=False)
    view = _read_models(app).runners
    assert view.materialization_digests() == {
        "r1": [(RUNTIME, TOOLCHAIN)],
        "r2": [(RUNTIME, TOOLCHAIN)],
    }
    assert not view.materialized_nowhere(RUNTIME, TOOLCHAIN)
    assert view.materialized_nowhere(RUNTIME, NOBODY)
    app.record_heartbeat(
        runner_id="r1",
        at=clock(),
        artifact_digests=[RUNTIME],
        materializations=[_item(RUNTIME, NOBODY), _item("sha256:other", TOOLCHAIN)],
    )
    app.deregister_runner("r2")  # its row stays, and its materializations
    view = _read_models(app).runners
    expected = {"r1": sorted([(RUNTIME, NOBODY), ("sha256:other", TOOLCHAIN)])}
    expected["r2"] = [(RUNTIME, TOOLCHAIN)]
    assert view.materialization_digests() == expected
    assert not view.materialized_nowhere(RUNTIME, NOBODY)
    assert verify_read_models(app, _read_models(app)).equal
    rebuild(_read_models(app))  # the clear deletes the rows: the triggers their digests
    assert _read_models(app).runners.materialization_digests() == expected
    assert verify_read_models(app, _read_models(app)).equal


def test_a_store_made_before_the_side_table_gets_it_filled(
    sqlite_store: Store, clock: Clock
) -> None:
    app = sqlite_store.open()
    register(app, "r1", at=clock())
    register(app, "r2", at=clock(), heartbeat=False)
    view = _read_models(app).runners
    _sql(view, f"DROP TABLE {MATERIALIZATION_DIGESTS}")  # and its triggers with it
    app.close()
    reopened = sqlite_store.open()
    view = _read_models(reopened).runners
    assert view.materialization_digests() == {"r1": [(RUNTIME, TOOLCHAIN)]}
    register(reopened, "r3", at=clock())  # and the triggers are back
    assert _read_models(reopened).runners.materialization_digests() == {
        "r1": [(RUNTIME, TOOLCHAIN)],
        "r3": [(RUNTIME, TOOLCHAIN)],
    }


def test_a_placement_fires_no_trigger(sqlite_store: Store, clock: Clock) -> None:
    app = sqlite_store.open()
    register(app, "r1", at=clock())
    view = _read_models(app).runners
    side = f"SELECT rowid, runner_id FROM {MATERIALIZATION_DIGESTS} ORDER BY rowid"
    before = [tuple(row) for row in _sql(view, side)]
    create_sandbox(app, "s1")
    app.schedule(schedule_request("s1", clock()))
    view = _read_models(app).runners  # caught up
    reserved = _sql(view, "SELECT reserved_instances FROM {table} WHERE runner_id = 'r1'")
    assert [tuple(row) for row in reserved] == [(1,)]  # the placement reached the row
    assert [tuple(row) for row in _sql(view, side)] == before  # not deleted and re-inserted


def test_verify_names_a_tampered_side_table(sqlite_store: Store, clock: Clock) -> None:
    app = sqlite_store.open()
    register(app, "r1", at=clock())
    view = _read_models(app).runners
    _sql(view, f"DELETE FROM {MATERIALIZATION_DIGESTS} WHERE runner_id = 'r1'")
    _sql(view, f"INSERT INTO {MATERIALIZATION_DIGESTS} VALUES ('ghost', 'a', 'b')")
    report = verify_read_models(app, _read_models(app))
    found = {
        (d.key, d.field, str(d.read_model_value), str(d.folded_value)) for d in report.differences
    }
    assert found == {
        ("r1", DIGESTS, "[]", str([[RUNTIME, TOOLCHAIN]])),
        ("ghost", DIGESTS, str([["a", "b"]]), "None"),
    }


def test_alike_in_pool_answers_from_the_index_ends(store: Store, clock: Clock) -> None:
    app = store.open()
    for runner_id in ("r1", "r2", "r3"):
        register(app, runner_id, at=clock())
    view = _read_models(app).runners
    with view.reading() as query:
        known = view.alike_in_pool("pool-a", query)
        assert view.alike_in_pool("pool-nobody", query) is None
    assert known is not None
    assert dict(zip(RunnerSnapshotsView.ALIKE, known, strict=True))["backend_kind"] == (
        "firecracker"
    )
    register(app, "odd", at=clock(), capabilities=(*CAPABILITIES, "gpu"))
    view = _read_models(app).runners
    with view.reading() as query:
        assert view.alike_in_pool("pool-a", query) is None
    app.deregister_runner("odd")  # the index holds registered runners only
    view = _read_models(app).runners
    with view.reading() as query:
        assert view.alike_in_pool("pool-a", query) == known


def test_a_pool_of_long_texts_is_surveyed_with_them_on_postgres(store: Store, clock: Clock) -> None:
    """PostgreSQL's index holds rows of short texts only (a B-tree entry has at most
    about 2,700 bytes): a pool with a runner of longer ones is surveyed with its texts
    (``alike_in_pool`` None), and its refusal is the full scan's. SQLite indexes any."""
    app = store.open()
    long = (*CAPABILITIES, *(f"{index:02d}-" + "x" * 250 for index in range(10)))
    for runner_id in ("r1", "r2"):
        register(app, runner_id, at=clock(), capabilities=long)
    view = _read_models(app).runners
    with view.reading() as query:
        known = view.alike_in_pool("pool-a", query)
    assert (known is None) == (store.kind == "postgres")
    register(app, "r3", at=clock())  # short texts, another kind
    view = _read_models(app).runners
    with view.reading() as query:
        assert view.alike_in_pool("pool-a", query) is None
    assert _answer(app, "short", full_scan=False) == _answer(app, "full", full_scan=True)


def _answer(app: SchedulerApplication, sandbox_id: str, *, full_scan: bool) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        if full_scan:
            patch.setattr(queries, "unmatched_candidates", lambda *args: None)
        try:
            return create_sandbox(app, sandbox_id, preferred_artifact_digests=(RUNTIME, NOBODY))
        except PlacementError as error:
            # the counts as the Refused event records them (without zero counts)
            return type(error), str(error), error.evaluations, error.unlisted.to_record()


# per odd runner: whether the index shows the pool alike, whether every runner passes
# the prefilter, whether all share their artifact digests (on SQLite)
ODD = {
    None: (True, True, True),
    "arm64": (False, False, True),
    "draining": (True, False, True),
    "digests": (True, True, False),
}


@pytest.mark.parametrize("odd", sorted(ODD, key=str))
def test_a_refusal_read_through_the_indexes_is_the_full_scans(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch, odd: str | None
) -> None:
    """A pool of alike runners (SQLite: surveyed without the texts, the first runners
    read without the prefilter's test and the locality term); a runner of another
    architecture (the index ends differ: the texts compared; the prefilter tested); a
    draining one (alike still; the prefilter tested); one with more artifact digests
    (ranked first by locality: the locality term kept). Each refusal is the full scan's."""
    app = store.open()
    for index in range(12):
        register(app, f"r{index:02d}", at=clock(), allocatable=capacity(instances=1 + index % 3))
    if odd == "arm64":
        register(app, "odd", at=clock(), architecture="arm64")
    elif odd == "draining":
        app.start_drain("r03")
    elif odd == "digests":
        app.record_heartbeat(
            runner_id="r05",
            at=clock(),
            artifact_digests=[RUNTIME, RUNTIME],
            materializations=[materialization()],
        )
    surveys: list[bool] = []
    bests: list[tuple[bool, bool]] = []
    survey, best = unmatched._Sql.alike_survey, unmatched._Sql.best

    def watched_survey(self: Any, collate: str, **kwargs: Any) -> Any:
        surveys.append(kwargs.get("texts", True))
        return survey(self, collate, **kwargs)

    def watched_best(self: Any, limit: int, **kwargs: Any) -> Any:
        bests.append((kwargs.get("everyone_passes", False), kwargs.get("one_locality", False)))
        return best(self, limit, **kwargs)

    monkeypatch.setattr(unmatched._Sql, "alike_survey", watched_survey)
    monkeypatch.setattr(unmatched._Sql, "best", watched_best)
    answer = _answer(app, "short", full_scan=False)
    alike, everyone, one_locality = ODD[odd]
    assert surveys == [not alike]
    if store.kind == "sqlite":
        assert bests == [(everyone, one_locality)]
    else:  # the first runners read beside the survey, before it
        assert bests == [(False, False)]
    assert answer == _answer(app, "full", full_scan=True)
    assert "without the materialization" in answer[1]
    if odd == "digests":
        assert answer[2][0].runner_id == "r05"  # the most local first


def test_a_placement_and_a_heartbeat_stay_hot_updates_on_postgres(
    postgres_store: Store, clock: Clock
) -> None:
    """The indexes read no column a placement, a release or a heartbeat sets, so
    PostgreSQL updates such a row in place (HOT: no index entry written)."""
    app = postgres_store.open()
    register(app, "r1", at=clock())
    view = _read_models(app).runners
    (row,) = view.query("SELECT stream_id, lease_id FROM {table} WHERE runner_id = 'r1'")
    placement = Update(
        ("stream_id",), (row["stream_id"],), {"version": 9}, dict.fromkeys(RESERVED, 1)
    )
    heartbeat = Update(
        ("lease_id",),
        (row["lease_id"],),
        {"last_heartbeat_at": clock(), "lease_version": 9},
    )
    with view.datastore.transaction(commit=False) as cursor:  # type: ignore[attr-defined]
        for change in (placement, heartbeat):
            view._write(cursor, view.net([change]))
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
            "WHERE relid = %s::regclass",
            (view._format("{table}"),),
        )
        counts = cursor.fetchone()
    assert (counts["n_tup_upd"], counts["n_tup_hot_upd"]) == (2, 2)
