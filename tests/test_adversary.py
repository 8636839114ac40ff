"""The adversarial actors and the insider phase of `verify --profile adversarial`, run
in-process: clean on the scheduler as it is, and failing with each of the five
weakenings of docs/verification.md (section "Planted weakenings") monkeypatched in."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from secondbox_scheduler.domain.limits import DEFAULT_CLOCK_TOLERANCE
from secondbox_scheduler.domain.placement import ranking, rules
from secondbox_scheduler.domain.placement.evidence import HEARTBEAT_STALE, RuleFailure
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication, settings
from secondbox_scheduler.infrastructure.store.sealed_snapshots import SealedSnapshots
from secondbox_scheduler.infrastructure.tools.fault_injection.actors import (
    Actors,
    Clock,
    ranking_check,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.config import FaultRunConfig
from secondbox_scheduler.infrastructure.tools.fault_injection.database import (
    drop_database,
    fault_run_database,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import setup_fleet
from secondbox_scheduler.infrastructure.tools.fault_injection.insider import (
    REFUSED,
    REPORTED,
    InsiderPhase,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.insider_writes import OwnerForgery
from secondbox_scheduler.infrastructure.tools.fault_injection.probes import Probe
from tests.conftest import T0


def _actors(tmp_path: Path) -> list[Probe]:
    clock = Clock(T0)
    app = SchedulerApplication(
        env={"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(tmp_path / "a.db")},
        now=clock,
    )
    try:
        return [*Actors(app, clock).run(), *ranking_check(app)]
    finally:
        app.close()


def _failed(probes: list[Probe]) -> dict[str, str]:
    return {probe.name: probe.detail for probe in probes if not probe.ok}


def test_the_actors_hold_on_the_scheduler_as_it_is(tmp_path: Path) -> None:
    probes = _actors(tmp_path)
    assert _failed(probes) == {}
    names = {probe.name for probe in probes}
    assert "actor: heartbeat exactly at the boundary, placed" in names
    assert "actor: heartbeat one tick past the boundary, refused as home" in names
    assert "actor: a forged token at the current generation (release)" in names
    assert "actor: lying clock, a request the tolerance and a second ahead" in names
    assert "ranking: each home is the first by the spec's ranking" in names


def test_plant_a_any_token_for_the_current_generation_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def weakened(self: Sandbox, generation: int, fencing_token: bytes) -> Any:
        return self._current(generation)  # the token is not compared

    monkeypatch.setattr(Sandbox, "_fenced", weakened)
    failed = _failed(_actors(tmp_path))
    assert "actor: a forged token at the current generation (release)" in failed
    assert "actor: an earlier generation's token at the current generation (running)" in failed


def test_plant_b_the_staleness_boundary_moved_by_one_tick_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def weakened(ctx: Any, runner: Any) -> RuleFailure | None:
        seen = runner.last_heartbeat_at
        if seen is not None and seen > ctx.stale_before:  # > instead of >=
            return None
        return RuleFailure(HEARTBEAT_STALE, "planted")

    checks = tuple(
        (code, weakened if code == HEARTBEAT_STALE else check) for code, check in rules.CHECKS
    )
    monkeypatch.setattr(rules, "CHECKS", checks)
    failed = _failed(_actors(tmp_path))
    assert "actor: heartbeat exactly at the boundary, chosen as home" in failed


def test_plant_c_the_ranking_memory_order_reversed_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = ranking.rank_key_for

    def weakened(preferred: frozenset[str], runner: Any) -> Any:
        key = original(preferred, runner)
        return (*key[:3], -key[3], key[4])  # free memory ascending

    monkeypatch.setattr(rules, "rank_key_for", weakened)
    failed = _failed(_actors(tmp_path))
    assert "actor: ranking, most free memory_bytes first" in failed
    assert "recorded" in failed["ranking: each home is the first by the spec's ranking"]


def test_plant_e_the_clock_tolerance_times_ten_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settings, "DEFAULT_CLOCK_TOLERANCE", DEFAULT_CLOCK_TOLERANCE * 10)
    failed = _failed(_actors(tmp_path))
    assert "actor: the clock tolerance is the documented default" in failed
    assert "actor: lying clock, a request the tolerance and a second ahead" in failed
    assert "actor: lying clock, a heartbeat the tolerance and a second ahead" in failed


@pytest.fixture
def fleet_database(postgres_server: Any) -> Iterator[tuple[str, list[str]]]:
    base = postgres_server.url()
    name = f"secondbox_adversary_{int(time.time() * 1000)}"
    url = fault_run_database(base, name)
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        config = FaultRunConfig(database_url=base, runners=3, sandboxes=6, profile="adversarial")
        runners, _ = setup_fleet(app, config)
    finally:
        app.close()
    try:
        yield url, runners
    finally:
        drop_database(base, name)


def test_plant_d_snapshot_seals_never_checked_fails(
    fleet_database: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, runners = fleet_database
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        forgery = OwnerForgery(url, app, runners)
        _, honest, _ = forgery.plant()
        assert honest  # the seal checked: the forged snapshot refused on load
        monkeypatch.setattr(SealedSnapshots, "refusal", lambda self, *args: "")
        assert not forgery.loads_honestly(runners[0])
    finally:
        app.close()


@pytest.mark.slow
def test_the_insider_phase_refuses_or_reports_each_attempt(
    fleet_database: tuple[str, list[str]],
) -> None:
    url, runners = fleet_database
    attempts = {attempt.name: attempt for attempt in InsiderPhase(url, runners).run()}
    outcomes = {name: attempt.outcome for name, attempt in attempts.items()}
    assert outcomes["hidden event (INSERT at notification_id 0)"] == REFUSED
    assert outcomes["forged snapshot (INSERT into the snapshots table)"] == REFUSED
    assert outcomes["forged snapshot (INSERT into the seals table)"] == REFUSED
    assert outcomes["forged snapshot (append function, at no event of the call)"] == REFUSED
    assert outcomes["held lock (<events>_lock())"] == REFUSED
    assert outcomes["held lock (a transaction left idle after an append)"] == REFUSED
    assert outcomes["idle transaction ended by the server"] == REFUSED
    tampered = [name for name in outcomes if name.startswith("tampered")]
    assert any("tracking" in name for name in tampered)
    assert len(tampered) >= 8
    assert all(outcomes[name] == REFUSED for name in tampered)
    for name, rule in [
        ("forged snapshot (append function, at an event of the call, false state)", "snapshot"),
        ("future heartbeat (append function, at a year ahead)", "clock"),
        ("forged snapshot row with no valid seal (owner's write access)", "snapshot"),
    ]:
        assert outcomes[name] == REPORTED, attempts[name]
        assert f"audit verify: {rule} at" in attempts[name].detail
    # a future event time too: the times along the log (rule time-order) report it
    consistent = attempts["future heartbeat (append function, at and event time a year ahead)"]
    assert consistent.outcome == REPORTED, consistent
    assert "audit verify: time-order at" in consistent.detail
    unexpected = [a for a in attempts.values() if a.name.startswith("unexpected")]
    assert unexpected == []
