"""The ``secondbox-scheduler`` command line on SQLite: simulate, runners, assignments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.settings import DATABASE_URL
from secondbox_scheduler.infrastructure.tools.simulation import (
    FULL_CAPABILITIES,
    OPERATOR,
    POOLS,
    SimulationConfig,
    plan_fleet,
    run_simulation,
)

SMALL = ["--runners", "12", "--sandboxes", "30"]
TINY = ["--runners", "6", "--sandboxes", "10"]


def url_for(directory: Path, name: str = "x.db") -> str:
    return f"sqlite:///{directory / name}"  # three slashes and an absolute path


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def invoke_json(*args: str) -> Any:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def without_run_details(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_seconds", "database_url")}


@dataclass(frozen=True)
class Simulated:
    url: str
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    url = url_for(tmp_path_factory.mktemp("sim"))
    summary = invoke_json("simulate", "--database-url", url, *SMALL)
    return Simulated(url, summary)


# -- simulate ----------------------------------------------------------------------------


def test_simulate_places_and_refuses(simulated: Simulated) -> None:
    summary = simulated.summary
    assert summary["placements"] > 0
    assert summary["releases"] > 0
    assert summary["replays"] > 0
    assert summary["sandboxes_created"] > 0
    schedule_reasons = summary["refusal_reasons"]["schedule"]
    assert schedule_reasons["heartbeat_stale"] > 0
    assert schedule_reasons["draining"] > 0
    assert summary["refusals"]["schedule"]["HomeRunnerUnavailableError"] > 0
    assert summary["drained_runner"]
    assert summary["stale_runner"]
    assert summary["drained_runner"] != summary["stale_runner"]
    assert summary["ledger_matches_store"] is True
    heartbeats = summary["heartbeats"]
    assert heartbeats["recorded"] > 0
    assert heartbeats["coalesced"] > 0
    assert heartbeats["sent"] == heartbeats["recorded"] + heartbeats["coalesced"] + heartbeats.get(
        "stale", 0
    )
    # one process, one thread: no placement can lose a race (>= 0 held whatever happened)
    assert summary["contention_retries"] == 0
    assert summary["contention_errors"] == 0
    assert summary["wall_seconds"] > 0
    assert {pool["pool_name"] for pool in summary["pools"]} == {p.name for p in POOLS}
    assert len(summary["runner_use"]) == 12


def test_simulate_reconciles_and_releases_by_hand(simulated: Simulated) -> None:
    summary = simulated.summary
    reconcile = summary["reconcile"]
    actions = reconcile["actions"]
    assert summary["starts_unreported"] > 0
    assert actions["deadline_exceeded"] > 0
    assert actions["uncertain"] > 0
    assert (
        actions["deadline_exceeded"] == reconcile["redeliveries"] + reconcile["terminal_failures"]
    )
    assert reconcile["rounds"] > 0
    assert reconcile["passes"] >= reconcile["rounds"]
    assert (
        reconcile["reconciled"] == sum(actions.values()) == sum(reconcile["reconciled_by"].values())
    )
    assert set(reconcile["reconciled_by"]) == {"simulator-reconciler", "simulator-peer"}
    assert reconcile["held_by_others"] > 0  # the scripted peer won the claim race
    assert reconcile["claims_lost"] > 0  # the paused peer's late commit was refused
    manual = summary["manual_releases"]
    assert manual > 0
    assert manual == sum(summary["manual_releases_by_state"].values())
    assert summary["manual_releases_by_state"]["uncertain"] > 0
    states = summary["assignment_states"]
    assert list(states) == ["assigned", "running", "released", "failed", "uncertain"]
    assert sum(states.values()) == summary["placements"]
    assert states["released"] == summary["releases"] + manual == summary["generations_advanced"]
    assert summary["ledger_matches_store"] is True


def test_manual_releases_carry_the_operators_proof(simulated: Simulated) -> None:
    app = SchedulerApplication(env={DATABASE_URL: simulated.url})
    try:
        read_models = app.current_read_models()
        assert read_models is not None
        released = read_models.assignments.by_state("released")
        by_hand = [a for a in released if a.release_proof.get("operator") == OPERATOR]
        assert len(by_hand) == simulated.summary["manual_releases"]
        assert all(a.release_proof["reason"] for a in by_hand)
        for state, count in simulated.summary["assignment_states"].items():
            assert len(read_models.assignments.by_state(state)) == count
    finally:
        app.close()


def test_events_written_are_what_the_store_holds(simulated: Simulated) -> None:
    app = SchedulerApplication(env={DATABASE_URL: simulated.url})
    try:
        assert app.event_count() == simulated.summary["events_written"]
        assert simulated.summary["events_in_store"] == simulated.summary["events_written"]
        assert len(app.runner_snapshots()) == 12
    finally:
        app.close()


def test_same_seed_gives_the_same_summary(simulated: Simulated, tmp_path: Path) -> None:
    again = invoke_json("simulate", "--database-url", url_for(tmp_path), *SMALL)
    assert without_run_details(again) == without_run_details(simulated.summary)
    for key in ("reconcile", "manual_releases_by_state", "assignment_states"):
        assert again[key] == simulated.summary[key]


def test_a_rerun_replaces_the_database_simulate_created(tmp_path: Path) -> None:
    url = url_for(tmp_path)
    first = invoke_json("simulate", "--database-url", url, *TINY)
    second = invoke_json("simulate", "--database-url", url, *TINY)
    assert second["events_in_store"] == second["events_written"] == first["events_written"]


def test_append_adds_under_a_run_prefix(tmp_path: Path) -> None:
    url = url_for(tmp_path)
    first = invoke_json("simulate", "--database-url", url, *TINY)
    second = invoke_json("simulate", "--database-url", url, *TINY, "--append")
    assert second["events_written"] > 0
    assert second["events_in_store"] == first["events_written"] + second["events_written"]
    prefix = f"run{first['events_written']}-"
    assert all(use["runner_id"].startswith(prefix) for use in second["runner_use"])
    runners = invoke_json("runners", "--database-url", url)
    assert len(runners) == 12


def test_simulate_prints_a_human_summary(tmp_path: Path) -> None:
    result = invoke("simulate", "--database-url", url_for(tmp_path), *TINY)
    assert result.exit_code == 0, result.output
    for text in (
        "placements",
        "replays",
        "heartbeat_stale",
        "draining",
        "events written",
        "contention retries",
        "reconcile passes",
        "assignments reconciled",
        "deadline_exceeded",
        "uncertain",
        "held by another reconciler",
        "manual releases",
        "assignments by state",
        "ledger check",
        "wall time",
        "Utilisation per pool",
        "general-01",
    ):
        assert text in result.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.stdout)


def test_simulate_honours_the_environment_url(tmp_path: Path) -> None:
    url = url_for(tmp_path, "env.db")
    result = invoke("simulate", *TINY, "--json", env={DATABASE_URL: url})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["database_url"] == url
    assert (tmp_path / "env.db").exists()


def test_run_simulation_is_usable_without_the_cli(tmp_path: Path) -> None:
    config = SimulationConfig(database_url=url_for(tmp_path), seed=3, runners=6, sandboxes=10)
    result = run_simulation(config)
    assert result.placements > 0
    assert result.ledger_matches_store
    assert result.counts()["seed"] == 3
    assert "wall_seconds" not in result.counts()


def test_fleet_plan_is_mixed_and_mostly_capable() -> None:
    fleet = plan_fleet(36)
    assert len(fleet) == 36
    assert {plan.architecture for plan in fleet} == {"x86_64", "aarch64"}
    assert {plan.pool_name for plan in fleet} == {pool.name for pool in POOLS}
    capable = [p for p in fleet if set(FULL_CAPABILITIES) <= set(p.capabilities)]
    assert len(fleet) - 6 <= len(capable) < len(fleet)
    assert any(plan.egress_contexts for plan in fleet)
    assert any("physical-storage-admission" in plan.capabilities for plan in fleet)
    for pool in POOLS:
        first_two = [p for p in fleet if p.pool_name == pool.name][:2]
        assert all(set(FULL_CAPABILITIES) <= set(p.capabilities) for p in first_two)


@pytest.mark.parametrize("value", ["0", "2"])
def test_simulate_refuses_too_few_runners(tmp_path: Path, value: str) -> None:
    result = invoke("simulate", "--database-url", url_for(tmp_path), "--runners", value)
    assert result.exit_code == 2
    assert "--runners" in result.output


# -- runners -------------------------------------------------------------------------------


def test_runners_lists_every_runner(simulated: Simulated) -> None:
    runners = invoke_json("runners", "--database-url", simulated.url)
    assert len(runners) == 12
    assert [r["id"] for r in runners] == sorted(r["id"] for r in runners)
    by_id = {r["id"]: r for r in runners}
    stale = by_id[simulated.summary["stale_runner"]]
    live = [r for r in runners if r["id"] != stale["id"]]
    assert all(stale["last_heartbeat_at"] < r["last_heartbeat_at"] for r in live)
    assert all(r["reserved"]["instances"] <= r["allocatable"]["instances"] for r in runners)

    table = invoke("runners", "--database-url", simulated.url)
    assert table.exit_code == 0, table.output
    for runner in runners:
        assert runner["id"] in table.stdout


def test_runners_of_one_pool(simulated: Simulated) -> None:
    runners = invoke_json("runners", "--database-url", simulated.url, "--pool", "edge")
    assert runners
    assert {r["pool_name"] for r in runners} == {"edge"}
    assert invoke_json("runners", "--database-url", simulated.url, "--pool", "nowhere") == []


def test_runners_without_a_database_fails_in_one_line(tmp_path: Path) -> None:
    result = invoke("runners", "--database-url", url_for(tmp_path, "missing.db"))
    assert result.exit_code == 4  # the store is unavailable
    assert "no database" in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "missing.db").exists()


def test_a_bad_database_url_is_one_line() -> None:
    result = invoke("runners", "--database-url", "mysql://host/db", "--json")
    assert result.exit_code == 2
    assert "SECONDBOX_DATABASE_URL" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert result.stdout == ""


# -- assignments ---------------------------------------------------------------------------


def busy_runner(url: str) -> str:
    runners = invoke_json("runners", "--database-url", url)
    busy = [r["id"] for r in runners if r["reserved"]["instances"] > 0]
    assert busy
    return str(busy[0])


def test_assignments_of_a_runner(simulated: Simulated) -> None:
    runner_id = busy_runner(simulated.url)
    found = invoke_json("assignments", "--runner", runner_id, "--database-url", simulated.url)
    assert found
    for assignment in found:
        assert assignment["runner_id"] == runner_id
        assert assignment["state"] in ("assigned", "running", "failed", "uncertain")  # holding
        assert len(bytes.fromhex(assignment["fencing_token"])) == 32
    table = invoke("assignments", "--runner", runner_id, "--database-url", simulated.url)
    assert table.exit_code == 0, table.output
    assert found[0]["sandbox_id"] in table.stdout


def test_assignments_of_a_sandbox(simulated: Simulated) -> None:
    runner_id = busy_runner(simulated.url)
    held = invoke_json("assignments", "--runner", runner_id, "--database-url", simulated.url)
    sandbox_id = held[0]["sandbox_id"]
    found = invoke_json("assignments", "--sandbox", sandbox_id, "--database-url", simulated.url)
    assert [a["generation"] for a in found] == list(range(1, len(found) + 1))
    assert len({a["fencing_token"] for a in found}) == len(found)
    assert all(a["state"] == "released" and a["release_proof"] for a in found[:-1])
    assert found[-1]["fencing_token"] == held[0]["fencing_token"]


@pytest.mark.parametrize(
    "args", [[], ["--sandbox", "sbx-0001", "--runner", "general-01"]], ids=["neither", "both"]
)
def test_assignments_needs_exactly_one_of_sandbox_or_runner(
    simulated: Simulated, args: list[str]
) -> None:
    result = invoke("assignments", *args, "--database-url", simulated.url)
    assert result.exit_code != 0
    assert "exactly one of --sandbox" in result.output


def test_assignments_of_an_unknown_sandbox_is_one_line_exit_3(simulated: Simulated) -> None:
    result = invoke("assignments", "--sandbox", "no-such", "--database-url", simulated.url)
    assert result.exit_code == 3  # refused by a rule: the sandbox must exist
    assert "not found" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


# -- help ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["simulate", "runners", "assignments"])
def test_every_command_has_teaching_help(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Examples" in result.stdout
    assert f"secondbox-scheduler {command}" in result.stdout
    assert "--database-url" in result.stdout
    assert "--json" in result.stdout


@pytest.mark.parametrize("json_output", [False, True], ids=["table", "json"])
def test_simulate_exits_1_when_the_ledger_differs_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, json_output: bool
) -> None:
    """A run whose reservations differ from the store is a failed run, not a summary."""
    import dataclasses

    from secondbox_scheduler.infrastructure.cli import simulate as simulate_cli

    real = run_simulation

    def differing(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(real(*args, **kwargs), ledger_matches_store=False)

    monkeypatch.setattr(simulate_cli, "run_simulation", differing)
    args = ["simulate", "--database-url", url_for(tmp_path), *TINY]
    result = invoke(*args, *(["--json"] if json_output else []))
    assert result.exit_code == 1, (result.exit_code, result.output)
    if json_output:  # (was `"DIFFER" in output or json_output`: nothing checked in JSON)
        assert json.loads(result.stdout)["ledger_matches_store"] is False
    else:
        assert "DIFFER" in result.stdout + result.stderr
