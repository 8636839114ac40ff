"""Hypothesis strategies for the scheduler's inputs, and histories of commands.

- :func:`runner_snapshots` and :func:`fleets`: runner views that fail each placement
  rule now and then (another pool, draining, a stale or missing heartbeat, a missing
  capability or materialization, a guest-protocol range that misses, short capacity on
  any dimension, an egress context it lacks), for properties of ``select_runner``;
- :func:`placement_cases`: requirements and runners built from them on purpose, each to
  pass every rule or to fail chosen rules by a near miss, with what each was built to
  fail (a :class:`PlacementCase`): placeable in about 79 of 100 draws, where
  :func:`fleets` with :func:`requirements` are in 2 to 6 of 100;
  :func:`case_requirements`, :func:`compatible_runners` and :func:`fail_rule_sets` are
  its parts;
- :func:`requirements` and :func:`capacities`: what a ProfileRevision asks for;
- :func:`histories` and :func:`run_history`: random sequences of every command of
  ``SchedulerApplication`` (refusals are part of a history), for properties of a whole
  store such as "the read models equal a rebuild".

All of them draw from small sets of values on purpose: ties, exact fits and boundaries
are what find bugs here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from secondbox_scheduler.domain import (
    DRAIN_PHASE_ACTIVE,
    DRAIN_PHASE_DRAINING,
    Capacity,
    EgressContextUnavailableError,
    MaterializationSnapshot,
    NoCompatibleRunnerError,
    Requirements,
    RunnerSnapshot,
    SchedulerError,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.testing.builders import (
    CLIENT_SELECTED_IMAGE,
    COMPUTE,
    NEAR_MISSES,
    PHYSICAL_STORAGE_ADMISSION,
    PLACEMENT_RULES,
    RUNTIME,
    T0,
    TICK,
    TOOLCHAIN,
    Clock,
    capacity,
    check_placeable,
    create_sandbox,
    materialization,
    near_miss_runner,
    register,
    schedule_request,
    token,
)

GIB = 2**30
POOL = "pool-a"
PREREQUISITES = ("network-policy", "storage", "cleanup", "local-workspace")
BASE_CAPABILITIES = frozenset({"compute", *PREREQUISITES, "snapshot-restore"})
RUNNER_IDS = tuple(f"runner-{n}" for n in range(8))


def _materialization(**overrides: str) -> MaterializationSnapshot:
    return materialization().model_copy(update=overrides)


def capacities(
    *,
    vcpu_count: Sequence[int] = (0, 1, 2),
    memory_bytes: Sequence[int] = (0, 4 * GIB),
    disk_bytes: Sequence[int] = (0, 10 * GIB),
    instances: Sequence[int] = (0, 1),
    operations: Sequence[int] = (0, 1),
) -> st.SearchStrategy[Capacity]:
    """Capacities drawn per dimension from the given values (a request, by default)."""
    return st.builds(
        Capacity,
        vcpu_count=st.sampled_from(vcpu_count),
        memory_bytes=st.sampled_from(memory_bytes),
        disk_bytes=st.sampled_from(disk_bytes),
        instances=st.sampled_from(instances),
        operations=st.sampled_from(operations),
    )


def requirements() -> st.SearchStrategy[Requirements]:
    """Requirements of pool-a/x86_64 needing ``snapshot-restore``; the capacity, egress
    context and guest-protocol generation (0 included, which nothing may take) vary.
    With :func:`fleets` placeable in only 2 to 6 of 100 draws (7 to 17 of 300
    measured), with one :func:`runner_snapshots` in under 1 of 100: for cases that
    place, use :func:`placement_cases`."""
    return st.builds(
        Requirements,
        pool_name=st.just(POOL),
        architecture=st.just("x86_64"),
        required_capabilities=st.just(frozenset({"snapshot-restore"})),
        capacity=capacities(),
        guest_protocol_generation=st.integers(0, 3),
        preferred_artifact_digests=st.just((RUNTIME, TOOLCHAIN)),
        egress_context=st.sampled_from([None, "public", "private"]),
    )


@st.composite
def runner_snapshots(
    draw: st.DrawFn, runner_id: str | None = None, now: datetime = T0
) -> RunnerSnapshot:
    """One runner as placement sees it at ``now``, failing any rule now and then (so
    often that with :func:`requirements` it is chosen in under 1 of 100 draws: 0 to 9
    of 1,000 measured; :func:`placement_cases` builds runners that pass on purpose)."""
    allocatable = Capacity(
        vcpu_count=draw(st.sampled_from([0, 2, 4, 8])),
        memory_bytes=draw(st.sampled_from([0, 4 * GIB, 8 * GIB])),
        disk_bytes=draw(st.sampled_from([0, 10 * GIB, 100 * GIB])),
        instances=draw(st.integers(0, 3)),
        operations=draw(st.integers(0, 2)),
    )
    reserved = Capacity(
        **{dim: draw(st.integers(0, amount)) for dim, amount in allocatable.as_dict().items()}
    )
    optional_caps = draw(
        st.frozensets(
            st.sampled_from(
                ["compute", *PREREQUISITES, "snapshot-restore", "physical-storage-admission"]
            )
        )
    )
    heartbeat_age = draw(st.one_of(st.none(), st.integers(-5, 60)))
    return RunnerSnapshot(
        id=runner_id if runner_id is not None else draw(st.sampled_from(RUNNER_IDS)),
        pool_name=draw(st.sampled_from([POOL, POOL, POOL, "pool-b"])),
        backend_kind="firecracker",
        architecture="x86_64",
        drain_phase=draw(st.sampled_from([DRAIN_PHASE_ACTIVE] * 4 + [DRAIN_PHASE_DRAINING])),
        last_heartbeat_at=None if heartbeat_age is None else now - timedelta(seconds=heartbeat_age),
        capabilities=draw(st.sampled_from([BASE_CAPABILITIES] * 3 + [optional_caps])),
        allocatable=allocatable,
        reserved=reserved,
        artifact_digests=tuple(
            draw(st.lists(st.sampled_from([RUNTIME, TOOLCHAIN, "sha256:x"]), unique=True))
        ),
        materializations=draw(
            st.sampled_from([(materialization(),)] * 3 + [(), (_materialization(digest=""),)])
        ),
        supported_egress_contexts=tuple(
            draw(st.lists(st.sampled_from(["public", "private"]), unique=True))
        ),
        guest_protocol_minimum=draw(st.integers(0, 3)),
        guest_protocol_maximum=draw(st.integers(1, 4)),
    )


@st.composite
def fleets(draw: st.DrawFn, now: datetime = T0) -> list[RunnerSnapshot]:
    """Up to eight runners with distinct ids (none at all, too)."""
    ids = draw(st.lists(st.sampled_from(RUNNER_IDS), unique=True, max_size=len(RUNNER_IDS)))
    return [draw(runner_snapshots(runner_id, now)) for runner_id in ids]


# -- placement cases: compatible runners and near misses, built on purpose -------------

# A case's heartbeat timeouts: shorter and longer than the builders' 30 s.
HEARTBEAT_TIMEOUTS = (timedelta(seconds=1), timedelta(seconds=30), timedelta(minutes=5))


@dataclass(frozen=True)
class PlacementCase:
    """Requirements, runners built from them, and the rules each runner was built to fail.

    ``failing[i]`` is the set of reason codes (:data:`PLACEMENT_RULES`) that
    ``runners[i]`` was built to fail, one near miss per code; an empty set: built to
    pass every rule. Pass ``now`` and ``heartbeat_timeout`` to ``select_runner``.
    """

    requirements: Requirements
    runners: tuple[RunnerSnapshot, ...]
    now: datetime
    heartbeat_timeout: timedelta
    failing: tuple[frozenset[str], ...]

    @property
    def passing(self) -> tuple[RunnerSnapshot, ...]:
        """The runners built to pass every rule (the only ones select_runner may choose)."""
        return tuple(r for r, rules in zip(self.runners, self.failing, strict=True) if not rules)

    @property
    def placeable(self) -> bool:
        """Some runner was built to pass every rule."""
        return not all(self.failing)

    def built_to_fail(self, runner_id: str) -> frozenset[str]:
        """The reason codes the runner ``runner_id`` was built to fail."""
        for runner, rules in zip(self.runners, self.failing, strict=True):
            if runner.id == runner_id:
                return rules
        raise KeyError(runner_id)

    @property
    def expected_refusal(
        self,
    ) -> type[NoCompatibleRunnerError] | type[EgressContextUnavailableError] | None:
        """The error ``select_runner`` must raise (None: it must choose a passing
        runner): EgressContextUnavailableError when some runner fails only ``egress``."""
        if self.placeable:
            return None
        if any(rules == {"egress"} for rules in self.failing):
            return EgressContextUnavailableError
        return NoCompatibleRunnerError


def fail_rule_sets(max_size: int = 3) -> st.SearchStrategy[frozenset[str]]:
    """What one runner of :func:`placement_cases` is built to fail: nothing (built to
    pass), one rule, or two to ``max_size`` rules, each about a third of the draws (a
    runner alone is placeable in about a third of them; see :func:`placement_cases`
    for whole cases). ``max_size`` is at least 1."""
    if max_size < 1:
        raise InvalidArgument(f"max_size must be at least 1, got {max_size}")
    rules = st.sampled_from(PLACEMENT_RULES)
    branches = [st.just(frozenset[str]()), st.frozensets(rules, min_size=1, max_size=1)]
    if max_size >= 2:
        branches.append(st.frozensets(rules, min_size=2, max_size=max_size))
    return st.one_of(branches)


def case_requirements(failing: frozenset[str] = frozenset()) -> st.SearchStrategy[Requirements]:
    """Requirements for which a runner can fail each rule of ``failing`` alone: an
    egress context when ``egress`` is in it, a required capability besides the
    prerequisites for ``capability``, no ``client-selected-image`` for
    ``materialization``. Every request takes at least one instance, and every draw
    admits a compatible runner (a placement case with :func:`compatible_runners`: 100
    of 100)."""
    return _case_requirements(
        "capability" in failing, "materialization" in failing, "egress" in failing
    )


@functools.cache
def _case_requirements(
    capability: bool, materialization: bool, egress: bool
) -> st.SearchStrategy[Requirements]:
    extra = ["snapshot-restore", "gpu"] + ([] if materialization else [CLIENT_SELECTED_IMAGE])
    contexts: list[str | None] = ["public", "private"] + ([] if egress else [None])
    return st.builds(
        Requirements,
        pool_name=st.just(POOL),
        architecture=st.sampled_from(["x86_64", "aarch64"]),
        required_capabilities=st.frozensets(st.sampled_from(extra), min_size=int(capability)),
        capacity=capacities(instances=(1, 2)),
        guest_protocol_generation=st.integers(1, 4),
        preferred_artifact_digests=st.just((RUNTIME, TOOLCHAIN)),
        egress_context=st.sampled_from(contexts),
    )


# What compatible_runners draws from, built once; few draws per runner (each draw costs
# Hypothesis about 0.2 ms): sets as bit masks, a dimension's reserved and slack as one.
_BACKENDS = st.sampled_from(["firecracker", "cloud-hypervisor"])
_EXTRA_CAPABILITIES = ("snapshot-restore", "gpu", PHYSICAL_STORAGE_ADMISSION, CLIENT_SELECTED_IMAGE)
_CONTEXTS = ("public", "private", "default")
_FOUR_BITS = st.integers(0, 15)
_THREE_BITS = st.integers(0, 7)
_NINE = st.integers(0, 8)
_THREE = st.integers(0, 2)
_FOUR = st.integers(0, 3)
_BOOLEANS = st.booleans()


def _chosen(names: Sequence[str], mask: int) -> frozenset[str]:
    return frozenset(name for bit, name in enumerate(names) if mask >> bit & 1)


@st.composite
def compatible_runners(
    draw: st.DrawFn,
    requirements: Requirements,
    runner_id: str = "runner-0",
    now: datetime = T0,
    heartbeat_timeout: timedelta = timedelta(seconds=30),
) -> RunnerSnapshot:
    """A runner that passes every placement rule for ``requirements``, its pass drawn
    at the boundaries: a heartbeat exactly ``heartbeat_timeout`` old (or fresh, or a
    second ahead of ``now``), per dimension nothing or some reserved and free capacity
    exactly the request or a little more (no free disk at all with
    ``physical-storage-admission``, which leaves disk unchecked), a guest-protocol range
    that may start or end at the generation, a decoy materialization before the right
    one, extra capabilities and egress contexts, artifact locality from none to both
    preferred digests. Placeable in every draw (``select_runner`` chooses it alone:
    tests/test_testing_kit.py checks each runner it draws). ValueError: requirements
    no runner can pass (:func:`check_placeable`)."""
    check_placeable(requirements)
    runtime, toolchain = requirements.preferred_artifact_digests
    generation = requirements.guest_protocol_generation
    backend = draw(_BACKENDS)
    extras = _chosen(_EXTRA_CAPABILITIES, draw(_FOUR_BITS))
    capabilities = frozenset({COMPUTE, *PREREQUISITES, *requirements.required_capabilities})
    requested = requirements.capacity.as_dict()
    reserved: dict[str, int] = {}
    allocatable: dict[str, int] = {}
    for dim, amount in requested.items():
        used, slack = divmod(draw(_NINE), 3)
        reserved[dim] = (0, 1, amount)[used]
        allocatable[dim] = reserved[dim] + amount + (0, 1, amount + 2)[slack]
    if PHYSICAL_STORAGE_ADMISSION in extras and draw(_BOOLEANS):
        allocatable["disk_bytes"] = reserved["disk_bytes"]  # unchecked: nothing free is fine
    ages = (heartbeat_timeout, timedelta(0), heartbeat_timeout - TICK, -timedelta(seconds=1))
    match = MaterializationSnapshot(
        backend_kind=backend,
        architecture=requirements.architecture,
        runtime_digest=runtime,
        toolchain_digest=toolchain,
        digest="sha256:materialized",
    )
    decoy = match.model_copy(update={"runtime_digest": "sha256:stale-runtime"})
    cached = _chosen((runtime, toolchain, "sha256:x"), draw(_THREE_BITS))
    contexts = _chosen(_CONTEXTS, draw(_THREE_BITS)) | set(
        filter(None, [requirements.egress_context])
    )
    return RunnerSnapshot(
        id=runner_id,
        pool_name=requirements.pool_name,
        backend_kind=backend,
        architecture=requirements.architecture,
        capabilities=capabilities | extras,
        allocatable=Capacity(**allocatable),
        reserved=Capacity(**reserved),
        drain_phase=DRAIN_PHASE_ACTIVE,
        last_heartbeat_at=now - ages[draw(_FOUR)],
        artifact_digests=tuple(sorted(cached)),
        materializations=(decoy, match) if draw(_BOOLEANS) else (match,),
        supported_egress_contexts=tuple(sorted(contexts)),
        guest_protocol_minimum=max(0, generation - draw(_THREE)),
        guest_protocol_maximum=min(generation + draw(_THREE), 2**32 - 1),
    )


def placement_cases(
    *,
    min_runners: int = 1,
    max_runners: int = 8,
    fail_rules: st.SearchStrategy[frozenset[str]] | None = None,
    placeable: bool | None = None,
    now: datetime = T0,
) -> st.SearchStrategy[PlacementCase]:
    """Placement cases built on purpose: requirements, then ``min_runners`` to
    ``max_runners`` runners (distinct ids, in no particular order), each drawn by
    :func:`compatible_runners` and then, for the rules ``fail_rules`` draws for it
    (default :func:`fail_rule_sets`), made to fail each of them by a near miss of
    :func:`near_miss_runner` (a heartbeat one tick past the timeout, one unit short
    on one dimension, a guest protocol just out of range, ...). ``placeable=True``:
    at least one runner is built to pass (one drawn rule set is emptied if needed);
    ``False``: none is (an empty rule set gets one drawn rule). The heartbeat timeout
    is drawn from :data:`HEARTBEAT_TIMEOUTS`.

    With the defaults a case is placeable in about 79 of 100 draws (measured: 772,
    784 and 817 of three runs of 1,000 random draws; 273 of the 300 derandomized draws
    of tests/test_testing_kit.py, which fails below a third); in the other draws the
    two refusals, NoCompatibleRunnerError and EgressContextUnavailableError, both
    occur, and every rule is failed alone now and then. With ``placeable=True`` every
    draw is placeable, with ``False`` none is.

    An embedder's property::

        from hypothesis import given
        from secondbox_scheduler import (
            EgressContextUnavailableError, NoCompatibleRunnerError, select_runner,
        )
        from secondbox_scheduler.testing import placement_cases

        @given(case=placement_cases())
        def test_admission_places_on_a_runner_built_to_pass(case):
            try:
                chosen = select_runner(
                    case.requirements, case.runners, case.now, case.heartbeat_timeout
                )
            except (NoCompatibleRunnerError, EgressContextUnavailableError) as refusal:
                assert type(refusal) is case.expected_refusal
            else:
                assert chosen in case.passing
    """
    if not 0 <= min_runners <= max_runners:
        raise InvalidArgument(
            f"need 0 <= min_runners <= max_runners, got {min_runners}, {max_runners}"
        )
    if placeable and max_runners < 1:
        raise InvalidArgument("a placeable case needs max_runners >= 1")
    min_runners = max(min_runners, 1) if placeable else min_runners
    return _placement_cases(
        counts=st.integers(min_runners, max_runners),
        fail_rules=fail_rule_sets() if fail_rules is None else fail_rules,
        placeable=placeable,
        now=now,
        ids=st.permutations([f"runner-{n}" for n in range(max(8, max_runners))]),
    )


_RULES = st.sampled_from(PLACEMENT_RULES)
_WAYS = {rule: st.integers(0, len(NEAR_MISSES[rule]) - 1) for rule in PLACEMENT_RULES}
_TIMEOUTS = st.sampled_from(HEARTBEAT_TIMEOUTS)


@st.composite
def _placement_cases(
    draw: st.DrawFn,
    *,
    counts: st.SearchStrategy[int],
    fail_rules: st.SearchStrategy[frozenset[str]],
    placeable: bool | None,
    now: datetime,
    ids: st.SearchStrategy[list[str]],
) -> PlacementCase:
    count = draw(counts)
    failing = [frozenset(draw(fail_rules)) for _ in range(count)]
    for rules in failing:
        if not rules <= set(PLACEMENT_RULES):
            raise InvalidArgument(f"unknown placement rules {sorted(rules - set(PLACEMENT_RULES))}")
    if placeable is True and all(failing):
        failing[draw(st.integers(0, count - 1))] = frozenset()
    if placeable is False:
        failing = [rules or frozenset({draw(_RULES)}) for rules in failing]
    requirements = draw(case_requirements(frozenset().union(*failing)))
    heartbeat_timeout = draw(_TIMEOUTS)
    runners = []
    for runner_id, rules in zip(draw(ids), failing, strict=False):
        runner = draw(compatible_runners(requirements, runner_id, now, heartbeat_timeout))
        if rules:
            ways = {rule: draw(_WAYS[rule]) for rule in PLACEMENT_RULES if rule in rules}
            runner = near_miss_runner(
                requirements, rules, now=now, heartbeat_timeout=heartbeat_timeout,
                base=runner, ways=ways,
            )  # fmt: skip
        runners.append(runner)
    return PlacementCase(requirements, tuple(runners), now, heartbeat_timeout, tuple(failing))


# -- histories of commands --------------------------------------------------------------

HISTORY_RUNNERS = ("r1", "r2", "r3")
HISTORY_SANDBOXES = ("s1", "s2", "s3", "s4")
COMMANDS = (
    "heartbeat", "drain", "cancel", "allocatable", "create", "schedule", "running",
    "release", "fail", "claim", "advance", "deregister", "tick",
)  # fmt: skip
Command = tuple[str, int, int]


def histories(max_size: int = 40) -> st.SearchStrategy[list[Command]]:
    """Sequences of ``(command, a, b)``: ``a`` picks a runner (and varies the command),
    ``b`` a sandbox. :func:`run_history` applies one."""
    return st.lists(
        st.tuples(st.sampled_from(COMMANDS), st.integers(0, 3), st.integers(0, 3)),
        max_size=max_size,
    )


def run_history(app: SchedulerApplication, clock: Clock, history: Sequence[Command]) -> None:
    """Register :data:`HISTORY_RUNNERS` (room for 1, 2 and 3 instances), then apply every
    command of ``history``; refusals (``SchedulerError``) are part of a history. Stale
    fences, early advances and double releases happen by chance."""
    tokens: dict[tuple[str, int], bytes] = {}
    for index, runner_id in enumerate(HISTORY_RUNNERS):
        register(app, runner_id, at=clock(), allocatable=capacity(instances=1 + index))
    for name, a, b in history:
        runner_id = HISTORY_RUNNERS[a % len(HISTORY_RUNNERS)]
        sandbox_id = HISTORY_SANDBOXES[b % len(HISTORY_SANDBOXES)]
        with contextlib.suppress(SchedulerError):
            _apply(app, clock, tokens, name, a, b, runner_id, sandbox_id)


def _apply(
    app: SchedulerApplication,
    clock: Clock,
    tokens: dict[tuple[str, int], bytes],
    name: str,
    a: int,
    b: int,
    runner_id: str,
    sandbox_id: str,
) -> Any:
    if name == "heartbeat":
        return app.record_heartbeat(
            runner_id=runner_id, at=clock(), artifact_digests=[RUNTIME] * (a % 2 + 1),
            materializations=[materialization()],
        )  # fmt: skip
    if name == "drain":
        return app.start_drain(runner_id)
    if name == "cancel":
        return app.cancel_drain(runner_id)
    if name == "allocatable":
        return app.change_allocatable(runner_id, capacity(instances=b + 1))
    if name == "create":
        return create_sandbox(app, sandbox_id)
    if name == "deregister":
        return app.deregister_runner(runner_id)
    if name == "tick":
        return clock.advance(seconds=7 * (a + 1))
    current = app.get_assignment(sandbox_id)
    generation = current.generation if current else 1
    if name == "schedule":
        assignment, _ = app.schedule(
            schedule_request(sandbox_id, clock(), fencing_token=token(), retry_limit=1)
        )
        tokens[(sandbox_id, assignment.generation)] = assignment.fencing_token
        return assignment
    held = tokens.get((sandbox_id, generation), b"\0" * 32)
    if name == "running":
        return app.mark_running(sandbox_id, generation, held)
    if name == "release":
        return app.release(sandbox_id, generation, held, {"proof": str(a)})
    if name == "fail":
        return app.fail(sandbox_id, generation, held, ["transport", "admission"][a % 2])
    if name == "claim":
        return app.claim_reconcile(
            sandbox_id, generation, f"owner-{a}", clock() + timedelta(seconds=10)
        )
    if name == "advance":
        return app.advance_generation(sandbox_id, generation)
    raise ValueError(f"unknown command {name!r}")
