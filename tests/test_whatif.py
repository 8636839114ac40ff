"""What-if replay: identity on simulated and stored histories, changes, invariants, CLI.

With no change the replay must reproduce every recorded decision (it doubles as a
determinism check of a history); changes confined to a pool no request targets change
nothing; the replay is deterministic; no counterfactual state oversubscribes a runner or
reserves on a draining or removed one; a hand-built history moves exactly the
placements a drain must move.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from secondbox_scheduler.domain.errors import InvalidRequestError, NoCompatibleRunnerError
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.placement.evidence import RunnerEvaluation
from secondbox_scheduler.domain.placement.ranking import SEED, BinPacking, RankingPolicy, Spread
from secondbox_scheduler.domain.placement.rules import checked_dimensions, decide, select_runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Capacity, Requirements, RunnerSnapshot
from secondbox_scheduler.domain.whatif.changes import WhatIfChanges
from secondbox_scheduler.domain.whatif.engine import WhatIf
from secondbox_scheduler.domain.whatif.fleet import Fleet, FleetRunner, capacity_of
from secondbox_scheduler.domain.whatif.pools import PoolView
from secondbox_scheduler.domain.whatif.report import (
    MOVED,
    PLACED_TO_REFUSED,
    REFUSED_TO_PLACED,
    WhatIfReport,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.whatif_replay import (
    changes_from,
    load_changes,
    resolve_policy,
    whatif,
)
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.tools.simulation import SimulationConfig, run_simulation
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import read_pages
from secondbox_scheduler.testing import SchedulerMachine, sqlite_store
from tests.conftest import Clock, PostgresSchema
from tests.factories import capacity, create_sandbox, register, requirements, schedule_request
from tests.histories import HISTORY_0_1, copy_history, copy_sqlite, stored_rows
from tests.test_projections import fresh_store

HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
SIM_START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def replay(url: str, changes: WhatIfChanges | dict[str, Any] | None = None) -> WhatIfReport:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        wanted = changes_from(changes) if isinstance(changes, dict) else changes
        return whatif(app, wanted).report
    finally:
        app.close()


def assert_identity(report: WhatIfReport) -> None:
    assert report.decisions > 0
    assert report.reproduced == report.decisions, report.first_difference
    assert report.changed == report.evidence_changed == 0
    assert report.first_difference is None
    assert report.invariant_violations == []
    assert report.lifecycle_skipped == report.held_to_end == 0


def decisions_in(app: SchedulerApplication) -> tuple[int, int]:
    """(decisions, create refusals without requirements) counted from the stored rows."""
    decisions = kept = 0
    for notification in app.recorder.select_notifications(start=1, limit=1_000_000):
        name = notification.topic.rsplit(":", 1)[1]
        if name in ("Sandbox.Created", "Sandbox.AssignmentFenced"):
            decisions += 1
        elif name == "RefusalLog.Refused":
            state = json.loads(notification.state)
            if state["operation"] == "create_sandbox" and state.get("requirements") is None:
                kept += 1
            else:
                decisions += 1
    return decisions, kept


# -- identity ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_no_change_reproduces_every_decision_of_random_simulated_histories(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    schema: PostgresSchema | None = None
    if kind == "postgres":
        schema = request.getfixturevalue("postgres_schema")

    @settings(max_examples=3, deadline=None, suppress_health_check=HEALTH)
    @given(
        seed=st.integers(0, 10_000),
        runners=st.integers(3, 7),
        sandboxes=st.integers(1, 9),
        cycles=st.integers(1, 2),
    )
    def check(seed: int, runners: int, sandboxes: int, cycles: int) -> None:
        # each example on a fresh SQLite file; on PostgreSQL the runs accumulate in the
        # schema (the simulation prefixes its ids), and the whole log is replayed
        url = schema.url() if schema else f"sqlite:///{tmp_path / uuid.uuid4().hex}.db"
        config = SimulationConfig(url, seed=seed, runners=runners, sandboxes=sandboxes,
                                  cycles=cycles)  # fmt: skip
        run_simulation(config)
        report = replay(url)
        assert_identity(report)
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
        try:
            assert (report.decisions, report.kept) == (decisions_in(app)[0], 0)
            assert report.events == app.event_count()
        finally:
            app.close()

    check()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_no_change_reproduces_the_release_0_1_history(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The committed fixture (release 0.1 topics), copied to either store. Its refused
    creations were recorded without their requirements: kept as recorded, and checked
    against the replayed fleet as far as their record allows."""
    if kind == "sqlite":
        url = f"sqlite:///{copy_sqlite(HISTORY_0_1, tmp_path)}"
    else:
        schema: PostgresSchema = request.getfixturevalue("postgres_schema")
        app = SchedulerApplication(env=schema.env())
        copy_history(HISTORY_0_1, app)
        app.close()
        url = schema.url()
    report = replay(url)
    assert_identity(report)
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        decisions, kept = decisions_in(app)
    finally:
        app.close()
    assert (report.decisions, report.kept) == (decisions, kept)
    assert kept > 0
    assert report.kept_consistent == kept
    assert report.events == len(stored_rows(HISTORY_0_1, "stored_events"))


# -- one simulated history, many changes ---------------------------------------------------


@dataclass(frozen=True)
class History:
    url: str
    idle: tuple[str, ...]  # runners of a pool that no request targets
    runners: tuple[str, ...]  # the simulation's runners


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    """A simulation on a store that already holds an idle pool (its ids are prefixed)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('whatif') / 'sim.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=lambda: SIM_START)
    idle = ("idle-1", "idle-2")
    for runner_id in idle:
        register(app, runner_id, at=SIM_START, pool_name="idle")
    app.close()
    run_simulation(SimulationConfig(url, seed=5, runners=10, sandboxes=24, cycles=2, fresh=False))
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    runners = tuple(r.id for r in app.runner_snapshots() if r.pool_name != "idle")
    app.close()
    return History(url, idle, runners)


moments = st.integers(0, 20 * 60).map(lambda s: SIM_START + timedelta(seconds=s))


def idle_changes(idle: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    runner = st.sampled_from(idle)
    at = st.none() | moments.map(datetime.isoformat)
    return st.fixed_dictionaries(
        {},
        optional={
            "drain": st.lists(st.fixed_dictionaries({"runner": runner, "at": at}), max_size=2),
            "remove": st.lists(st.fixed_dictionaries({"runner": runner, "at": at}), max_size=2),
            "allocatable": st.lists(
                st.fixed_dictionaries(
                    {
                        "runner": runner,
                        "at": at,
                        "capacity": st.fixed_dictionaries({"instances": st.integers(0, 50)}),
                    }
                ),
                max_size=2,
            ),
            "add": st.lists(
                st.fixed_dictionaries({"source": runner, "at": at, "ids": st.just(["idle-9"])}),
                max_size=1,
            ),
        },
    )


@settings(max_examples=15, deadline=None, suppress_health_check=HEALTH)
@given(data=st.data())
def test_a_change_confined_to_a_pool_no_request_targets_changes_nothing(
    history: History, data: st.DataObject
) -> None:
    changes = data.draw(idle_changes(history.idle))
    report = replay(history.url, changes)
    assert report.reproduced == report.decisions > 0
    assert report.first_difference is None
    identity = replay(history.url)
    assert {k: v for k, v in report.utilisation["after"].items() if k != "idle"} == {
        k: v for k, v in identity.utilisation["after"].items() if k != "idle"
    }


def fleet_changes(runners: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    runner = st.sampled_from(runners)
    at = st.none() | moments.map(datetime.isoformat)
    return st.fixed_dictionaries(
        {},
        optional={
            "drain": st.lists(st.fixed_dictionaries({"runner": runner, "at": at}), max_size=3),
            "remove": st.lists(st.fixed_dictionaries({"runner": runner, "at": at}), max_size=2),
            "allocatable": st.lists(
                st.fixed_dictionaries(
                    {
                        "runner": runner,
                        "at": at,
                        "capacity": st.fixed_dictionaries(
                            {},
                            optional={
                                "instances": st.integers(0, 30),
                                "vcpu_count": st.integers(0, 64),
                            },
                        ),
                    }
                ).filter(lambda c: bool(c["capacity"])),
                max_size=3,
            ),
            "add": st.lists(
                st.fixed_dictionaries({"source": runner, "at": at, "ids": st.just(["extra-1"])}),
                max_size=1,
            ),
            "heartbeat_timeout_seconds": st.sampled_from([5, 30, 300]),
            "policy": st.sampled_from(["seed", "binpack", "spread"]),
        },
    )


def decoded_events(url: str) -> Iterator[tuple[int, Any]]:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
    try:
        decode = EventDecoder(app.mapper)
        for page in read_pages(app.recorder):
            for notification in page:
                yield notification.id, decode(notification)
    finally:
        app.close()


def assert_counterfactual_invariants(engine: WhatIf) -> None:
    """Independent of the engine's own check: every runner's reserved is the sum of the
    assignments it holds and fits its allocatable on every checked dimension."""
    holding: dict[str, dict[str, int]] = {}
    for sandbox in engine.sandboxes.values():
        for generation in sandbox.holding:
            runner_id = sandbox.assignments[generation]
            sums = holding.setdefault(runner_id, dict.fromkeys(Capacity.DIMENSIONS, 0))
            for dim, amount in sandbox.capacity.items():
                sums[dim] += amount
    for runner in engine.fleet.runners.values():
        assert runner.reserved == holding.get(runner.runner_id, dict.fromkeys(runner.reserved, 0))
        for dim in checked_dimensions(runner.capabilities):
            assert 0 <= runner.reserved[dim] <= runner.allocatable[dim], (runner.runner_id, dim)


@settings(max_examples=8, deadline=None, suppress_health_check=HEALTH)
@given(data=st.data())
def test_every_counterfactual_state_keeps_the_invariants(
    history: History, data: st.DataObject
) -> None:
    changes = changes_from(data.draw(fleet_changes(history.runners)))
    engine = WhatIf(changes)
    for position, event in decoded_events(history.url):
        before = {(s.sandbox_id, g) for s in engine.sandboxes.values() for g in s.holding}
        engine.apply(position, event)
        for sandbox in engine.sandboxes.values():
            for generation in sandbox.holding - {g for s, g in before if s == sandbox.sandbox_id}:
                runner = engine.fleet.runners[sandbox.assignments[generation]]
                assert runner.drain_phase == "active"
                assert runner.visible
        assert_counterfactual_invariants(engine)
    report = engine.report()
    assert report.invariant_violations == []
    assert report.decisions == report.reproduced + report.evidence_changed + report.changed


def test_the_replay_is_deterministic(history: History) -> None:
    changes = {"drain": [{"runner": history.runners[0], "at": "2026-01-05T09:03:00Z"}],
               "policy": "spread"}  # fmt: skip
    first, second = replay(history.url, changes), replay(history.url, changes)
    assert first.to_dict() == second.to_dict()
    assert first.changed > 0


def test_bin_packing_homes_each_sandbox_on_the_least_free_compatible_runner(
    history: History,
) -> None:
    """The seed ranking prefers the runner with the most free instances; bin-packing,
    the one with the fewest: every home decision it changes chose a runner with no more
    free instances than any other compatible runner it lists."""
    report = replay(history.url, {"policy": "binpack"})
    assert report.changes == ["ranking policy binpack"]
    assert report.invariant_violations == []
    homes = [c for c in report.changed_decisions
             if c.operation == "create_sandbox" and c.after.runner_id]  # fmt: skip
    assert homes
    for change in homes:
        free = {line["runner_id"]: line["rank"]["free_instances"]
                for line in change.after.candidates if line["rank"]}  # fmt: skip
        assert free[change.after.runner_id] == min(free.values())
        if change.before.runner_id in free:
            assert free[change.after.runner_id] <= free[change.before.runner_id]


def test_the_replay_writes_nothing(history: History) -> None:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": history.url})
    try:
        head, count = app.head_position(), app.event_count()
        whatif(app, changes_from({"drain": [{"runner": history.runners[0]}], "policy": "binpack"}))
        assert (app.head_position(), app.event_count()) == (head, count)
    finally:
        app.close()


def test_a_window_replays_only_its_decisions(history: History) -> None:
    whole = replay(history.url)
    half = whole.position // 2
    later = replay(history.url, {"window": {"from": half + 1}})
    earlier = replay(history.url, {"window": {"until": half}})
    assert later.reproduced == later.decisions > 0
    assert earlier.reproduced == earlier.decisions > 0
    assert earlier.position <= half < later.position
    assert later.decisions + earlier.decisions == whole.decisions
    # bounded by times, every event is decoded (their times are needed): the same replay
    by_time = replay(history.url, {"window": {"until": "2100-01-01T00:00:00Z"}})
    assert by_time.to_dict() | {"window": None} == whole.to_dict() | {"window": None}
    # a drain from the window's start, not before: the earlier decisions are kept
    drained = replay(
        history.url, {"window": {"from": half + 1}, "drain": [{"runner": history.runners[0]}]}
    )
    assert drained.decisions == later.decisions


def test_a_window_ending_at_a_time_stops_the_replay_there(history: History) -> None:
    """A window bounded by a time inside the history: the replay stops at the first
    event after it and reports the decisions before it."""
    whole = replay(history.url)
    cut = replay(history.url, {"window": {"until": (SIM_START + timedelta(minutes=5)).isoformat()}})
    assert 0 < cut.decisions < whole.decisions
    assert cut.reproduced == cut.decisions
    assert cut.position < whole.position


def test_lifecycle_events_count_the_same_decoded_or_not(history: History) -> None:
    """Every runner drained from the start: no generation is placed, so the lifecycle
    events of the recorded ones are skipped and counted, the same whether the reader
    skips decoding them (no time bound) or decodes every event (a window bounded by a
    time after the history)."""
    drained = {"drain": [{"runner": runner_id} for runner_id in history.runners]}
    undecoded = replay(history.url, drained)
    decoded = replay(history.url, {**drained, "window": {"until": "2100-01-01T00:00:00Z"}})
    assert undecoded.lifecycle_skipped > 0
    assert undecoded.to_dict() | {"window": None} == decoded.to_dict() | {"window": None}


def test_the_result_reports_its_rate_to_a_tenth(history: History) -> None:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": history.url})
    try:
        result = whatif(app)
    finally:
        app.close()
    shown = result.to_dict()
    assert shown["events_per_second"] == round(result.report.events / result.seconds, 1)
    assert shown["seconds"] == round(result.seconds, 3)


# -- a hand-built history ----------------------------------------------------------------


@dataclass
class Built:
    url: str
    drain_at: datetime
    positions: dict[str, int]


def last_fence_position(app: SchedulerApplication, sandbox_id: str) -> int:
    """The position of the sandbox's latest AssignmentFenced in the log."""
    stream = sandbox_uuid(sandbox_id)
    return max(
        n.id
        for n in app.recorder.select_notifications(start=1, limit=100_000)
        if n.originator_id == stream and n.topic.endswith(":Sandbox.AssignmentFenced")
    )


def test_draining_one_runner_moves_exactly_the_placements_known_in_advance(
    tmp_path: Path,
) -> None:
    """r1 (10 instances) ranks above r2 (4) for every sandbox; s1..s4 are homed and
    placed on r1. Drained from between s2 and s3: s3 and s4 are homed and placed on r2
    instead, and s1's restart after the drain is refused (its home drains)."""
    clock = Clock(SIM_START)
    url = f"sqlite:///{tmp_path / 'built.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    register(app, "r1", at=clock(), allocatable=capacity(instances=10, vcpu_count=64))
    register(app, "r2", at=clock(), allocatable=capacity(instances=4, vcpu_count=64))
    positions: dict[str, int] = {}
    tokens: dict[str, bytes] = {}
    drain_at = SIM_START

    def start(sandbox_id: str, generation: int) -> None:
        request = schedule_request(sandbox_id, clock(), heartbeat_timeout=timedelta(hours=1))
        app.schedule(request)
        positions[f"{sandbox_id}/g{generation}"] = last_fence_position(app, sandbox_id)
        tokens[sandbox_id] = request.fencing_token

    for index in range(1, 5):
        clock.advance(seconds=10)
        if index == 3:
            drain_at = clock.advance(seconds=1)
        app.create_sandbox(
            sandbox_id=f"s{index}", workspace_id=f"workspace-s{index}",
            profile_revision_id="profile-1", requirements=requirements(),
            heartbeat_timeout=timedelta(hours=1),
        )  # fmt: skip
        positions[f"s{index}"] = app.head_position()
        start(f"s{index}", 1)
    clock.advance(seconds=10)
    app.release("s1", 1, tokens["s1"], {"stopped": "yes"})
    app.advance_generation("s1", 1)
    start("s1", 2)
    app.close()

    identity = replay(url)
    assert_identity(identity)
    report = replay(url, {"drain": [{"runner": "r1", "at": drain_at.isoformat()}]})
    changed = {(c.position, c.kind, c.before.runner_id, c.after.runner_id)
               for c in report.changed_decisions}  # fmt: skip
    assert changed == {
        (positions["s3"], MOVED, "r1", "r2"),
        (positions["s3/g1"], MOVED, "r1", "r2"),
        (positions["s4"], MOVED, "r1", "r2"),
        (positions["s4/g1"], MOVED, "r1", "r2"),
        (positions["s1/g2"], PLACED_TO_REFUSED, "r1", None),
    }
    assert report.changed == len(changed)
    refused = next(c for c in report.changed_decisions if c.kind == PLACED_TO_REFUSED)
    assert refused.after.error == "HomeRunnerUnavailableError"
    assert [line["reasons"] for line in refused.after.candidates] == [[{"code": "draining"}]]
    assert report.refusals["after"]["schedule"] == {"HomeRunnerUnavailableError": 1}
    # 14 instances offered; 1, 2, 3, then 4 held from 10, 20, 31 and 41 s to the end at
    # 51 s, in both worlds (s1's second start, refused in the replay, comes at the end)
    mean = round((1 * 10 + 2 * 11 + 3 * 10 + 4 * 10) / 51 / 14, 4)
    for side in ("before", "after"):
        assert report.utilisation[side]["pool-a"]["instances"] == {
            "peak": round(4 / 14, 4), "mean": mean}  # fmt: skip


def test_a_refused_creation_is_replayed_from_its_recorded_requirements(tmp_path: Path) -> None:
    """A creation refused for capacity records its requirements; with a clone of the
    full runner added, the replay places it (refused -> placed)."""
    clock = Clock(SIM_START)
    url = f"sqlite:///{tmp_path / 'refused.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    register(app, "only", at=clock(), allocatable=capacity(instances=1))
    create_sandbox(app, "first")
    app.schedule(schedule_request("first", clock()))
    with pytest.raises(NoCompatibleRunnerError):
        create_sandbox(app, "second")
    refusal: Any = list(app.events.get(_refusal_stream("second")))[-1]
    assert refusal.requirements == requirements().to_record()
    app.close()

    assert_identity(replay(url))
    report = replay(url, {"add": [{"source": "only", "ids": ["only-2"]}]})
    assert report.by_kind == {REFUSED_TO_PLACED: 1}
    assert report.changed_decisions[0].after.runner_id == "only-2"
    assert report.refusals["after"]["create_sandbox"] == {}


def _refusal_stream(sandbox_id: str) -> uuid.UUID:
    from secondbox_scheduler.domain.ids import refusal_log_uuid

    return refusal_log_uuid(sandbox_id)


# -- ranking policies -------------------------------------------------------------------


def snapshot(runner_id: str, instances: int, reserved: int, **fields: Any) -> RunnerSnapshot:
    return RunnerSnapshot(
        id=runner_id, pool_name="pool-a", backend_kind="firecracker", architecture="x86_64",
        capabilities=frozenset({"compute", "network-policy", "storage", "cleanup",
                                "local-workspace"}),
        allocatable=capacity(instances=instances), reserved=capacity(
            instances=reserved, vcpu_count=0, memory_bytes=0, disk_bytes=0, operations=0),
        last_heartbeat_at=SIM_START, artifact_digests=("sha256:runtime",),
        materializations=(_materialization(),), guest_protocol_minimum=1,
        guest_protocol_maximum=3, **fields,
    )  # fmt: skip


def _materialization() -> Any:
    from tests.factories import materialization

    return materialization()


def test_ranking_policies_order_compatible_runners_and_never_admit_others() -> None:
    runners = [snapshot("big", 10, 0), snapshot("half", 10, 5), snapshot("small", 4, 0),
               snapshot("full", 4, 4)]  # fmt: skip
    wanted = requirements()

    def chosen(policy: RankingPolicy | None = None) -> str:
        return select_runner(wanted, runners, SIM_START, timedelta(seconds=30), policy=policy).id

    assert chosen() == chosen(SEED) == "big"  # most free instances
    assert chosen(BinPacking()) == "small"  # least free capacity ("full" has no room)
    assert chosen(Spread()) == "big"  # lowest share reserved, then most free
    assert Spread().key(wanted, runners[2]) < Spread().key(wanted, runners[1])

    class Last:
        name = "last"

        def key(self, requirements: Requirements, runner: RunnerSnapshot) -> tuple[Any, ...]:
            return (tuple(-ord(c) for c in runner.id),)

    assert chosen(Last()) == "small"
    with pytest.raises(NoCompatibleRunnerError):
        select_runner(wanted, [runners[3]], SIM_START, timedelta(seconds=30), policy=Last())


class ReverseIds:
    """A user's own policy, loaded by name (package.module:attribute)."""

    name = "reverse-ids"

    def key(self, requirements: Requirements, runner: RunnerSnapshot) -> tuple[Any, ...]:
        return (tuple(-ord(c) for c in runner.id),)


def test_a_users_policy_plugs_in_by_object_or_by_name(history: History) -> None:
    by_name = resolve_policy("tests.test_whatif:ReverseIds")
    assert by_name.name == "reverse-ids"
    report = replay(history.url, WhatIfChanges(policy=ReverseIds()))
    assert report.policy == "reverse-ids"
    assert report.to_dict() == replay(history.url, {"policy": "tests.test_whatif:ReverseIds"}
                                      ).to_dict()  # fmt: skip
    rules = {
        "nowhere": "use one of ['binpack', 'seed', 'spread'] or package.module:attribute",
        "tests.test_whatif:Missing": "cannot load 'tests.test_whatif:Missing'",
        "json:dumps": "needs `name` and `key(requirements, runner)`",
    }
    for name, rule in rules.items():
        with pytest.raises(InvalidRequestError) as refused:
            resolve_policy(name)
        assert (refused.value.field, refused.value.value) == ("policy", name)
        assert refused.value.rule.startswith(rule)


# -- the pool view equals decide() ---------------------------------------------------------


class _Registered:
    def __init__(self, runner_id: str, instances: int, caps: tuple[str, ...]) -> None:
        self.runner_id, self.pool_name, self.backend_kind = runner_id, "pool-a", "firecracker"
        self.architecture, self.capabilities = "x86_64", caps
        self.allocatable = capacity(instances=instances).as_dict()
        self.supported_egress_contexts: tuple[str, ...] = ()
        self.guest_protocol_minimum, self.guest_protocol_maximum = 1, 3


operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release", "drain", "cancel", "beat", "leave", "decide"]),
        st.integers(0, 5),
        st.integers(0, 40),  # seconds forward (or back, for "decide" below 5)
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=operations, policy=st.sampled_from([None, BinPacking(), Spread()]))
def test_a_pool_view_decides_as_decide_over_the_whole_pool(
    ops: list[tuple[str, int, int]], policy: RankingPolicy | None
) -> None:
    fleet = Fleet()
    fleet.usage.at(SIM_START)
    full = ("cleanup", "compute", "local-workspace", "network-policy", "storage")
    for index in range(6):
        fleet.register(FleetRunner(_Registered(f"r{index}", 1 + index % 3, full[: 3 + index % 3])))
        lease = fleet.open_lease(f"r{index}")
        lease.heartbeat, lease.digests = SIM_START, ("sha256:runtime",)
        lease.materializations = (_materialization(),)
        fleet.lease_changed(lease, 2)
    wanted = requirements(capacity=capacity(instances=1, vcpu_count=1, memory_bytes=1,
                                            disk_bytes=1, operations=1))  # fmt: skip
    pool = fleet.pools["pool-a"]
    view = PoolView(pool, wanted, timedelta(seconds=30), policy)
    fleet.watch("pool-a", view.dirty)
    now = SIM_START
    one = capacity_of(dict.fromkeys(Capacity.DIMENSIONS, 1)).as_dict()
    for op, index, seconds in ops:
        runner = fleet.runners[f"r{index}"]
        if (
            op == "reserve"
            and runner.visible
            and runner.fits({d: runner.allocatable[d] - 1 for d in runner.allocatable})
        ):
            fleet.reserve(runner, one, "test")
        elif op == "release" and runner.held:
            fleet.release(runner, one)
        elif op in ("drain", "cancel"):
            fleet.drain(runner, op == "drain")
        elif op == "beat" and runner.lease is not None:
            runner.lease.heartbeat = now + timedelta(seconds=seconds)
            fleet.lease_changed(runner.lease, 3 + seconds)
        elif op == "leave":
            fleet.leave(runner)
        elif op == "decide":
            now += timedelta(seconds=seconds - 5)
            view.at(now)
            snapshots = [r.snapshot() for r in pool]
            expected = decide(wanted, snapshots, now, timedelta(seconds=30), policy=policy)
            found = view.chosen()
            assert (found.runner_id if found else None) == (
                expected.chosen.id if expected.chosen else None
            )
            assert view.size == len(snapshots)
            assert view.compatible == expected.compatible_count
            evaluations, ranks = view.evaluations()
            assert [verdict(e) for e in evaluations] == [verdict(e) for e in expected.evaluations]
            assert ranks == list(expected.ranks)


def verdict(evaluation: RunnerEvaluation) -> list[tuple[str, dict[str, int]]]:
    """What the replay compares of an evaluation (details are words, not compared)."""
    return [(failure.code, dict(failure.shortfall)) for failure in evaluation.failures]


def test_a_trusted_snapshot_equals_model_construct() -> None:
    fleet = Fleet()
    fleet.usage.at(SIM_START)
    runner = fleet.register(FleetRunner(_Registered("r1", 4, ("compute",))))
    built = runner.snapshot()
    fields = {name: getattr(built, name) for name in RunnerSnapshot.model_fields}
    expected = RunnerSnapshot.model_construct(**fields)
    assert built == expected
    assert built.model_dump() == expected.model_dump()
    assert built.model_fields_set == expected.model_fields_set
    assert built.free() == expected.free()


# -- changes: validation, files, command line ------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"drain": [{"runner": ""}]}, "drain.0.runner"),
        ({"allocatable": [{"runner": "r", "capacity": {"cpus": 1}}]}, "allocatable.0"),
        ({"allocatable": [{"runner": "r", "capacity": {"instances": -1}}]}, "allocatable.0"),
        ({"add": [{"source": "r", "ids": []}]}, "add.0"),
        ({"add": [{"source": "r", "ids": ["r"]}]}, "add.0"),
        ({"heartbeat_timeout_seconds": 0}, "heartbeat_timeout_seconds"),
        ({"heartbeat_timeout_seconds": True}, "heartbeat_timeout_seconds"),
        ({"policy": "fastest"}, "policy"),
        ({"policy": 3}, "policy"),
        ({"window": {"from": 10, "until": 5}}, "window"),
        ({"drain": [{"runner": "r", "at": "2026-01-05T09:00:00"}]}, "drain.0.at"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_changes_are_refused_naming_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        changes_from(data)
    assert refused.value.field.startswith(field), refused.value.field


def test_a_change_naming_an_unknown_runner_is_refused(history: History) -> None:
    with pytest.raises(InvalidRequestError, match="no runner 'nope'"):
        replay(history.url, {"drain": [{"runner": "nope"}]})
    with pytest.raises(InvalidRequestError, match="registered"):
        replay(history.url, {"add": [{"source": history.idle[0], "ids": [history.idle[1]]}]})


def test_changes_load_from_json_and_yaml(tmp_path: Path) -> None:
    shape = {"drain": [{"runner": "r1", "at": "2026-01-05T09:02:00Z"}], "policy": "binpack",
             "window": {"from": "2026-01-05T09:00:00Z", "until": 900}}  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(shape))
    (tmp_path / "c.yaml").write_text(
        "drain:\n  - runner: r1\n    at: 2026-01-05T09:02:00Z\npolicy: binpack\n"
        "window:\n  from: 2026-01-05T09:00:00Z\n  until: 900\n"
    )
    loaded = [changes_from(load_changes(tmp_path / name)) for name in ("c.json", "c.yaml")]
    assert loaded[0] == loaded[1] == changes_from(shape)
    (tmp_path / "bad.yaml").write_text("drain: [")
    (tmp_path / "list.json").write_text("[1]")
    rules = {
        "bad.yaml": "is not valid YAML: ",
        "list.json": "must hold a mapping of changes",
        "missing.json": "cannot read ",
    }
    for name, rule in rules.items():
        with pytest.raises(InvalidRequestError) as refused:
            load_changes(tmp_path / name)
        assert refused.value.field == "changes"
        assert rule in refused.value.rule
        assert name in refused.value.rule  # the file is named


def test_yaml_without_pyyaml_is_refused_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "c.yaml").write_text("policy: binpack\n")
    (tmp_path / "c.json").write_text('{"policy": "binpack"}')
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(InvalidRequestError, match=r"secondbox-scheduler\[yaml\]") as refused:
        load_changes(tmp_path / "c.yaml")
    assert refused.value.field == "changes"
    assert refused.value.rule.endswith("or give the changes as a .json file")
    assert load_changes(tmp_path / "c.json") == {"policy": "binpack"}


def whatif_cli(*args: str) -> Any:
    return CliRunner().invoke(cli, ["audit", "whatif", *args])


def test_the_command_reports_identity_and_changes(history: History, tmp_path: Path) -> None:
    found = whatif_cli("--database-url", history.url, "--json")
    assert found.exit_code == 0, found.output
    report = json.loads(found.stdout)
    assert all(isinstance(report[k], int) for k in ("decisions", "reproduced", "changed"))
    assert report["reproduced"] == report["decisions"] > 0
    assert report["changed"] == 0

    (tmp_path / "changes.yaml").write_text("policy: spread\n")
    found = whatif_cli(
        "--database-url", history.url, "--changes", str(tmp_path / "changes.yaml"),
        "--drain", f"{history.runners[0]}@2026-01-05T09:04:00Z",
        "--allocatable", f"{history.runners[1]}=instances:2,vcpu_count:8",
        "--add", f"{history.runners[2]}@2026-01-05T09:01:00Z=extra-1,extra-2",
        "--remove", history.runners[3], "--heartbeat-timeout", "60", "--json",
    )  # fmt: skip
    assert found.exit_code == 0, found.output
    report = json.loads(found.stdout)
    assert report["policy"] == "spread"
    assert len(report["changes"]) == 6
    assert report["changed"] > 0
    assert report["changed"] == sum(report["changed_by_kind"].values())

    human = whatif_cli("--database-url", history.url, "--policy", "binpack")
    assert human.exit_code == 0, human.output
    assert "reproduced" in human.stdout
    assert "changed" in human.stdout
    assert "Utilisation per pool" in human.stdout


def test_a_history_that_does_not_reproduce_itself_exits_1_naming_the_first_difference(
    tmp_path: Path,
) -> None:
    """A home decision recorded over one designated runner (as the benchmark's setup
    makes them, with ``Sandbox.create``), while a better runner was in the pool."""
    clock = Clock(SIM_START)
    url = f"sqlite:///{tmp_path / 'designed.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    register(app, "big", at=clock(), allocatable=capacity(instances=10))
    register(app, "small", at=clock(), allocatable=capacity(instances=2))
    create_sandbox(app, "chosen")  # by create_sandbox: reproduced
    small = app.get_runner("small")
    app.save(
        Sandbox.create(
            sandbox_id="designed", workspace_id="workspace-designed",
            profile_revision_id="profile-1", requirements=requirements(), runners=[small],
            now=clock(), heartbeat_timeout=timedelta(seconds=30),
        )
    )  # fmt: skip
    position = app.head_position()
    app.close()
    found = whatif_cli("--database-url", url)
    assert found.exit_code == 1, found.output
    assert f"first difference: #{position} create_sandbox designed" in found.stdout
    report = json.loads(whatif_cli("--database-url", url, "--json").stdout)
    assert (report["decisions"], report["reproduced"], report["changed"]) == (2, 1, 1)
    assert report["first_difference"]["position"] == position


def test_the_command_refuses_bad_flags_in_one_line(history: History) -> None:
    for args in (
        ["--allocatable", "r1=instances:many"],
        ["--drain", "@2026-01-05T09:00:00Z"],
        ["--policy", "nope"],
        ["--drain", "general-01@yesterday"],
        ["--until", "soon"],
    ):
        found = whatif_cli("--database-url", history.url, *args)
        assert found.exit_code == 2, (args, found.output)
        assert len(found.output.strip().splitlines()) == 1, found.output
    assert "Examples" in whatif_cli("--help").output


# -- the state machine's histories --------------------------------------------------------


class WhatIfMachine(SchedulerMachine):
    """The state machine of ``secondbox_scheduler.testing`` (every command, refusals,
    deregistrations, allocatable changes, stale heartbeats), whose history must then
    reproduce itself."""

    def teardown(self) -> None:
        try:
            report = whatif(self.app).report
            assert report.reproduced == report.decisions, report.first_difference
            assert report.unknown_events == {}
        finally:
            super().teardown()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_no_change_reproduces_the_state_machines_histories(
    kind: str, request: pytest.FixtureRequest
) -> None:
    store: Any = sqlite_store
    if kind == "postgres":
        server = request.getfixturevalue("postgres_server")
        store = lambda: fresh_store("postgres", server)  # noqa: E731
    machine: type[WhatIfMachine] = type(
        f"WhatIfMachine_{kind}",
        (WhatIfMachine,),
        {"store": staticmethod(store), "transitions": Counter()},
    )
    machine.TestCase.settings = settings(
        max_examples=12 if kind == "sqlite" else 4,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=HEALTH,
    )
    machine.TestCase().runTest()
