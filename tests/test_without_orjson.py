"""orjson is optional (the ``[fast]`` extra): without it the standard library's json
encodes and decodes the events, and the two read each other's histories.

The three modules that use orjson fall back when it is missing (``orjson = None``, as
their import guard leaves it): the event mapper (infrastructure/store/encoding.py), the
replay decoder (projections/event_decoder.py) and the what-if requirement keys
(domain/whatif/decisions.py). A history written either way replays, audits clean and
folds to the same state the other way. (A real install without orjson runs README's
example: tests/test_packaging.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

import secondbox_scheduler.domain.whatif.decisions as decisions
import secondbox_scheduler.infrastructure.store.encoding as encoding
import secondbox_scheduler.projections.event_decoder as event_decoder
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
from secondbox_scheduler.infrastructure.audit.whatif_replay import whatif
from tests.conftest import Clock
from tests.factories import create_sandbox, register, schedule_request


def without_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (encoding, event_decoder, decisions):
        monkeypatch.setattr(module, "orjson", None)


def history(url: str, clock: Clock) -> dict[str, object]:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    try:
        register(app, "r1", at=clock())
        create_sandbox(app, "s1")
        assignment, _ = app.schedule(schedule_request("s1", clock()))
        app.mark_running("s1", assignment.generation, assignment.fencing_token)
        app.release("s1", assignment.generation, assignment.fencing_token, {"stopped": "yes"})
        return state(app)
    finally:
        app.close()


def state(app: SchedulerApplication) -> dict[str, object]:
    return {
        "runner": app.fold_runner("r1").model_dump(),
        "assignments": [a.model_dump() for a in app.fold_assignments("s1")],
        "read_model": [r.model_dump() for r in app.runner_snapshots()],
    }


def reopened(url: str, clock: Clock) -> tuple[dict[str, object], bool, int]:
    """The state, whether the audit is clean, and the decisions an identity what-if
    replay reproduced (each must)."""
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    try:
        report = whatif(app).report
        assert report.identical, report.to_dict()
        return state(app), verify(app, measure_raw=False).ok, report.reproduced
    finally:
        app.close()


@pytest.mark.parametrize("written_without", [True, False], ids=["json-then-orjson", "reverse"])
def test_each_way_reads_the_others_history(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, written_without: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    if written_without:
        without_orjson(monkeypatch)
    written = history(url, clock)
    if written_without:
        monkeypatch.undo()
    else:
        without_orjson(monkeypatch)
    found, clean, decided = reopened(url, clock)
    assert found == written
    assert clean
    assert decided >= 2  # the home decision and the placement, decided again


def test_without_orjson_the_lean_paths_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    without_orjson(monkeypatch)
    app = SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})
    try:
        mapper = app.mapper
        assert isinstance(mapper, encoding.EventMapper)
        assert mapper._lean is False
        assert event_decoder.EventDecoder(mapper).lean is False
    finally:
        app.close()
