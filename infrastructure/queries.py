"""The scheduler's queries: assignments and runners, from the read models or folded
from the aggregates.

Queries read the read models (``projections/``) when this process keeps them current,
caught up first (``SECONDBOX_READ_MODELS=on``), or trust another process to keep them
(``external``); with ``off`` they fold the aggregates, which are the authority the read
models must equal (invariant 7). The ``fold_*`` queries always fold.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from secondbox_scheduler.domain.assignment import AssignmentRecord, to_durable_assignment
from secondbox_scheduler.domain.assignment_history import assignment_history
from secondbox_scheduler.domain.errors import RunnerNotFoundError, SandboxNotFoundError
from secondbox_scheduler.domain.ids import lease_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement.evidence import Unlisted
from secondbox_scheduler.domain.placement.rules import PlacementDecision
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    DurableAssignment,
    Requirements,
    RunnerSnapshot,
    require_text,
)
from secondbox_scheduler.infrastructure.home_check import checked_home_decision
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication
from secondbox_scheduler.projections.candidates import home_candidates
from secondbox_scheduler.projections.read_models import ReadModels
from secondbox_scheduler.projections.runner_index import RunnerIndex
from secondbox_scheduler.projections.unmatched import unmatched_candidates

RUNNER_SNAPSHOTS = "runner_snapshots"  # the view a home decision reads


class SchedulerQueries:
    """The read side of one application: aggregates loaded or read models caught up."""

    def __init__(
        self,
        store: StoredApplication,
        read_models: ReadModels | None,
        *,
        catch_up_inline: bool,
    ) -> None:
        self.store = store
        self.read_models = read_models
        self.catch_up_inline = catch_up_inline
        self.runner_index = RunnerIndex(store.recorder, store.mapper)

    # -- aggregates --------------------------------------------------------------

    def runner(self, runner_id: str, *, copy: bool = True) -> Runner:
        runner = self.store.load(runner_uuid(runner_id), Runner, copy=copy)
        if runner is None:
            raise RunnerNotFoundError(runner_id)
        if runner.deregistered:
            raise RunnerNotFoundError(runner_id, "deregistered")
        return runner

    def lease(self, runner_id: str, *, copy: bool = True) -> RunnerLease:
        lease = self.store.load(lease_uuid(runner_id), RunnerLease, copy=copy)
        if lease is None:
            raise RunnerNotFoundError(runner_id)
        return lease

    def sandbox(self, sandbox_id: str, *, copy: bool = True) -> Sandbox:
        sandbox = self.store.load(sandbox_uuid(sandbox_id), Sandbox, copy=copy)
        if sandbox is None:
            raise SandboxNotFoundError(sandbox_id)
        return sandbox

    def home_candidates(
        self,
        requirements: Requirements,
        now: datetime,
        heartbeat_timeout: timedelta,
        *,
        catch_up: bool = True,
    ) -> tuple[list[RunnerSnapshot], Unlisted]:
        """The runners to evaluate for a home decision, and counts of the pool's others:
        with the read model, the pool's prefiltered candidates a page at a time
        (:func:`secondbox_scheduler.projections.candidates.home_candidates`); without it,
        every runner of the pool, folded from the aggregates. When no runner of the pool
        may match, the candidates and counts of the refusal a full scan would give,
        without reading the pool (:mod:`secondbox_scheduler.projections.unmatched`).
        The runner the rules choose among the read model's candidates is checked
        against its aggregates first (:mod:`.home_check`): the home recorded is always
        true by the aggregates. ``catch_up=False``: the caller caught the read models up
        for this decision already (a creation batch, once for all its creations)."""
        runners, unlisted, _ = self.home_decision(
            requirements, now, heartbeat_timeout, catch_up=catch_up
        )
        return runners, unlisted

    def home_decision(
        self,
        requirements: Requirements,
        now: datetime,
        heartbeat_timeout: timedelta,
        *,
        catch_up: bool = True,
    ) -> tuple[list[RunnerSnapshot], Unlisted, PlacementDecision | None]:
        """:meth:`home_candidates`, and the placement rules' decision over them
        (``decide(requirements, runners, now, heartbeat_timeout, unlisted)``) when the
        home check made it already (None: the caller decides)."""
        read_models = self.current_read_models() if catch_up else self.read_models
        if read_models is None:
            return self.fold_runner_snapshots(requirements.pool_name), Unlisted(), None
        unmatched = unmatched_candidates(read_models.runners, requirements, now, heartbeat_timeout)
        if unmatched is not None:  # none may match: the refusal's evidence, and no more
            return (*unmatched, None)
        candidates, unlisted, floor, decided = home_candidates(
            read_models.runners, requirements, now, heartbeat_timeout
        )
        return checked_home_decision(
            requirements,
            candidates,
            unlisted,
            now,
            heartbeat_timeout,
            floor=floor,
            fold_runner=self.fold_runner,
            fold_pool=self.fold_runner_snapshots,
            decided=decided,
        )

    # -- assignments and runners ---------------------------------------------------

    def get_assignment(
        self, sandbox_id: str, generation: int | None = None
    ) -> DurableAssignment | None:
        """The assignment of the current generation, or of ``generation``: a past one is
        read from the assignments read model when it is kept current here, else folded
        from the sandbox's events (the aggregate keeps only the current generation)."""
        require_text("sandbox_id", sandbox_id)
        sandbox = self.store.load(sandbox_uuid(sandbox_id), Sandbox, copy=False)
        if sandbox is None:
            return None
        if generation is None or generation >= sandbox.generation:
            record = sandbox.assignment(generation)
            return None if record is None else to_durable_assignment(record)
        if self.read_models is not None and self.catch_up_inline:
            return self.read_models_now().assignments.of_generation(sandbox_id, generation)
        record = self._assignment_history(sandbox_id).get(generation)
        return None if record is None else to_durable_assignment(record)

    def _assignment_history(self, sandbox_id: str) -> dict[int, AssignmentRecord]:
        return assignment_history(self.store.events.get(sandbox_uuid(sandbox_id)))

    def assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        """Every generation's assignment of one sandbox, oldest first."""
        require_text("sandbox_id", sandbox_id)
        read_models = self.current_read_models()
        if read_models is not None:
            found = read_models.assignments.by_sandbox(sandbox_id)
            if not found and self.store.load(sandbox_uuid(sandbox_id), Sandbox, copy=False) is None:
                raise SandboxNotFoundError(sandbox_id)
            return found
        return self.fold_assignments(sandbox_id)

    def runner_assignments(self, runner_id: str) -> list[DurableAssignment]:
        """The assignments that hold a reservation on one runner."""
        require_text("runner_id", runner_id)
        read_models = self.current_read_models()
        if read_models is not None:
            self.get_runner(runner_id)  # refuses unknown and deregistered runners
            return read_models.assignments.by_runner(runner_id)
        return self.fold_runner_assignments(runner_id)

    def sandbox_home(self, sandbox_id: str) -> str:
        return self.sandbox(sandbox_id, copy=False).home_runner_id

    def runner_snapshots(self, pool_name: str | None = None) -> list[RunnerSnapshot]:
        """Every registered runner (of one pool), sorted by id, from the read model."""
        if pool_name is not None:
            require_text("pool_name", pool_name)
        read_models = self.current_read_models()
        if read_models is not None:
            return read_models.runners.snapshots(pool_name)
        return self.fold_runner_snapshots(pool_name)

    def get_runner(self, runner_id: str) -> RunnerSnapshot:
        require_text("runner_id", runner_id)
        read_models = self.current_read_models()
        if read_models is None:
            return self.fold_runner(runner_id)
        snapshot = read_models.runners.snapshot(runner_id)
        if snapshot is None:
            raise RunnerNotFoundError(runner_id)
        return snapshot

    # -- read models ----------------------------------------------------------

    def read_models_now(self) -> ReadModels:
        """The read models, caught up (only when this application keeps them)."""
        read_models = self.current_read_models()
        assert read_models is not None
        return read_models

    def current_read_models(self) -> ReadModels | None:
        """The read models, caught up first unless another process maintains them."""
        if self.read_models is not None and self.catch_up_inline:
            self.read_models.catch_up()
        return self.read_models

    def runner_snapshots_now(self) -> ReadModels | None:
        """The read models, the runner snapshots caught up first (what a home decision
        reads) unless another process maintains them; the other views catch up at
        their own next query."""
        if self.read_models is not None and self.catch_up_inline:
            self.read_models.catch_up(views=(RUNNER_SNAPSHOTS,))
        return self.read_models

    def wait_for(self, position: int, timeout: float = 5.0) -> None:
        """Read-your-writes: block until the read models have applied ``position``."""
        if self.read_models is not None:
            self.read_models.wait(position, timeout)

    # -- folds of the aggregates (the authority the read models must equal) ----

    def fold_runner(self, runner_id: str) -> RunnerSnapshot:
        return self.runner(runner_id, copy=False).snapshot(self.lease(runner_id, copy=False))

    def fold_runner_snapshots(self, pool_name: str | None = None) -> list[RunnerSnapshot]:
        snapshots = []
        for runner_id in self.runner_index.runner_ids(pool_name):
            runner = self.store.load(runner_uuid(runner_id), Runner, copy=False)
            if runner is None or runner.deregistered:
                continue
            snapshots.append(runner.snapshot(self.lease(runner_id, copy=False)))
        return snapshots

    def fold_assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        self.sandbox(sandbox_id, copy=False)  # refuses an unknown sandbox
        history = self._assignment_history(sandbox_id)
        return [to_durable_assignment(history[generation]) for generation in sorted(history)]

    def fold_runner_assignments(self, runner_id: str) -> list[DurableAssignment]:
        runner = self.runner(runner_id)
        found = []
        for held in runner.reservations.values():
            assignment = self.get_assignment(held["sandbox_id"], held["generation"])
            if assignment is not None:
                found.append(assignment)
        return sorted(found, key=lambda a: (a.sandbox_id, a.generation))
