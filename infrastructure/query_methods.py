"""The scheduler's reads on the application (docs/spec.md, section 5): each delegates to
:class:`.queries.SchedulerQueries`, where each is documented. A base class of
:class:`.application.SchedulerApplication`, so that the service's class holds its
commands and these stay one line each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from secondbox_scheduler.domain.values import DurableAssignment, RunnerSnapshot

if TYPE_CHECKING:
    from secondbox_scheduler.infrastructure.queries import SchedulerQueries
    from secondbox_scheduler.projections.read_models import ReadModels


class QueryMethods:
    """The reads of :class:`.queries.SchedulerQueries` on the application."""

    queries: SchedulerQueries

    def get_assignment(
        self, sandbox_id: str, generation: int | None = None
    ) -> DurableAssignment | None:
        """The assignment of the current generation, or of ``generation``."""
        return self.queries.get_assignment(sandbox_id, generation)

    def assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        return self.queries.assignments(sandbox_id)

    def runner_assignments(self, runner_id: str) -> list[DurableAssignment]:
        return self.queries.runner_assignments(runner_id)

    def sandbox_home(self, sandbox_id: str) -> str:
        return self.queries.sandbox_home(sandbox_id)

    def runner_snapshots(self, pool_name: str | None = None) -> list[RunnerSnapshot]:
        return self.queries.runner_snapshots(pool_name)

    def get_runner(self, runner_id: str) -> RunnerSnapshot:
        return self.queries.get_runner(runner_id)

    def read_models_now(self) -> ReadModels:
        return self.queries.read_models_now()

    def current_read_models(self) -> ReadModels | None:
        return self.queries.current_read_models()

    def wait_for(self, position: int, timeout: float = 5.0) -> None:
        self.queries.wait_for(position, timeout)

    def fold_runner(self, runner_id: str) -> RunnerSnapshot:
        return self.queries.fold_runner(runner_id)

    def fold_runner_snapshots(self, pool_name: str | None = None) -> list[RunnerSnapshot]:
        return self.queries.fold_runner_snapshots(pool_name)

    def fold_assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        return self.queries.fold_assignments(sandbox_id)

    def fold_runner_assignments(self, runner_id: str) -> list[DurableAssignment]:
        return self.queries.fold_runner_assignments(runner_id)
