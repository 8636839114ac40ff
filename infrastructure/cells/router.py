"""The cell router: each command to the cell that owns it, reads across every cell.

A :class:`CellRouter` (a :class:`~.cell_set.CellSet`) holds one
:class:`SchedulerApplication` per cell of a cells file (:mod:`.config`), built when a
command first needs that cell, and built again on a later command when building it
failed (the cell was down, or not created yet): a router started before one of its
cells answers serves that cell once it does.

Routing:

- ``register_runner`` by the runner's pool, ``create_sandbox`` by the requirements'
  pool (the cells file says which cell owns a pool);
- every other runner or sandbox command by the cell that holds the id, found in the
  router's cache, else in the id's claim (domain/cell_claims.py) in its directory cell
  (:mod:`.directory`): one cell asked, never every cell on every call. Only an id the
  directory does not know (a history written before the cells file, or an unknown id)
  is looked for in every cell; an unknown id's ``NotFoundError`` names the cells asked.

Ids unique across cells: creating a runner or sandbox first creates its claim in its
directory cell, naming the cell it is created in. Two routers creating one id in two
cells at the same moment create the same claim stream in the same store: the event
store's uniqueness on (stream, version) lets one win, and the other, reading the
winner's claim, refuses its creation (``AlreadyExistsError`` naming the winner's cell).
This holds for every pair of routers reading the same directory cells (the cells
file's ``directory`` cells never change) and needs no talk between routers. Its cost:
creating a *new* id needs its directory cell up as well as its own cell (a cell's other
commands need only that cell). A claim binds the id to its cell even when the creation
is then refused (a retry in the same cell goes on). A runner's claim moves to another
cell only once the runner is deregistered in the cell it names (moving a pool,
docs/operations.md): a deregistered runner can never be registered there again, so no
race can bring it back.

A cell that is down fails only its own commands, with :class:`CellUnavailableError`
naming it: each cell has its own application, pool and lock, reads over every cell ask
the cells at once (one thread each), a command still running after the connect timeout gets its
cell probed (one connection, the connect timeout) and fails if the probe does, and a
cell whose last call failed is probed before it is given the next one: a down cell's
commands fail within about twice the connect timeout instead of riding out the store's
own retries (ten, each waiting up to the connect timeout for a connection).
Several routers over the same cells keep nothing another one needs: the cache holds
only what the directory says, and a runner's cached cell that no longer holds it is
looked up again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.cell_claims import KIND_RUNNER, KIND_SANDBOX, CellClaim
from secondbox_scheduler.domain.command_inputs import as_requirements
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    NotFoundError,
    RunnerNotFoundError,
    SandboxNotFoundError,
)
from secondbox_scheduler.domain.ids import cell_claim_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.reconcile import ReconcileDecision
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
    require_text,
)
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.cell_set import (
    UNAVAILABLE,
    AcrossCells,
    ApplicationFactory,
    CellRow,
    CellSet,
    LazyApplication,
)
from secondbox_scheduler.infrastructure.cells.config import CellsConfig
from secondbox_scheduler.infrastructure.cells.directory import directory_cell
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError

T = TypeVar("T")
CACHE_SIZE = 262_144  # ids whose cell a router remembers (the least recently used go)


class CellRouter(CellSet):
    """Sends each command of :class:`SchedulerApplication` to its cell (module doc)."""

    def __init__(
        self,
        config: CellsConfig,
        *,
        env: Mapping[str, str] | None = None,
        now: Callable[[], datetime] | None = None,
        application_factory: ApplicationFactory | None = None,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        """``env``: settings every cell's application gets (its ``SECONDBOX_DATABASE_URL``
        is the cell's); ``application_factory``: how to build a cell's application
        (tests, embedders); ``cache_size``: ids whose cell it remembers."""
        super().__init__(config, env=env, now=now, application_factory=application_factory)
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()

    # -- which cell --------------------------------------------------------------------

    def cell_of_pool(self, pool_name: str, field: str = "pool_name") -> str:
        if len(self.config.cells) == 1 and not self.config.cells[0].pools:
            return self.config.cells[0].name  # no cells file: the one cell owns every pool
        return self.config.cell_of_pool(pool_name, field).name

    def directory_of(self, kind: str, subject_id: str) -> str:
        """The cell that keeps the claim of ``kind`` ``subject_id`` (:mod:`.directory`)."""
        return directory_cell(self.config.directory_cells, kind, subject_id)

    def _cached(self, kind: str, subject_id: str) -> str | None:
        with self._cache_lock:
            cell = self._cache.get((kind, subject_id))
            if cell is not None:
                self._cache.move_to_end((kind, subject_id))
            return cell

    def remember(self, kind: str, subject_id: str, cell: str) -> None:
        """Cache that ``cell`` holds ``subject_id`` (what a lookup or a creation learnt;
        a replica warming its cache)."""
        self._remember(kind, subject_id, cell)

    def _remember(self, kind: str, subject_id: str, cell: str) -> None:
        with self._cache_lock:
            self._cache[(kind, subject_id)] = cell
            self._cache.move_to_end((kind, subject_id))
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def forget(self, kind: str, subject_id: str) -> None:
        with self._cache_lock:
            self._cache.pop((kind, subject_id), None)

    @property
    def single(self) -> bool:
        return len(self.config.cells) == 1

    def cell_of_runner(self, runner_id: str) -> str:
        return self._cell_of(KIND_RUNNER, runner_id)

    def cell_of_sandbox(self, sandbox_id: str) -> str:
        return self._cell_of(KIND_SANDBOX, sandbox_id)

    def _cell_of(self, kind: str, subject_id: str) -> str:
        """The cell that holds ``subject_id``: cached, else its claim, else the one cell
        whose store has it; NotFoundError naming the cells asked."""
        require_text(f"{kind}_id", subject_id)
        if self.single:
            return self.names[0]
        cached = self._cached(kind, subject_id)
        if cached is not None:
            return cached
        directory = self.directory_of(kind, subject_id)
        down: CellUnavailableError | None = None
        try:
            claim = self.call(directory, lambda app: _claim(app, kind, subject_id))
        except CellUnavailableError as error:
            down, claim = error, None
        if claim is not None:
            self._remember(kind, subject_id, claim.cell)
            return claim.cell
        # not in the directory: a history written before the cells file, or unknown
        others = [name for name in self.names if name != directory]
        found = self.across(lambda app: exists_in(app, kind, subject_id), others)
        holders = [row.cell for row in found.rows if row.value]
        if holders:
            self._remember(kind, subject_id, holders[0])
            return holders[0]
        if down is not None:
            raise CellUnavailableError(
                down.cell,
                f"the directory cell of {kind} {subject_id!r} ({down.detail}); not found in "
                + (", ".join(others) or "no other cell"),
            )
        asked = [f"{directory} (its directory)", *others]
        unavailable = [f"{name} (unavailable)" for name in found.unavailable]
        detail = (
            "asked cells "
            + ", ".join(asked)
            + ("; " + ", ".join(unavailable) if unavailable else "")
        )
        missing: type[NotFoundError] = (
            RunnerNotFoundError if kind == KIND_RUNNER else SandboxNotFoundError
        )
        raise missing(subject_id, detail)

    def _claim_for(self, kind: str, subject_id: str, cell: str) -> None:
        """Make sure the directory says ``cell`` holds ``subject_id`` (creating the claim,
        or moving a runner's from a cell where it is deregistered); AlreadyExistsError
        when another cell holds it."""
        if self.single:
            return
        directory = self.directory_of(kind, subject_id)
        for _ in range(3):  # a rival's claim or move between our read and our save
            claim = self.call(directory, lambda app: _claim(app, kind, subject_id))
            if claim is None:
                new = CellClaim.claim(kind=kind, subject_id=subject_id, cell=cell, at=self._now())
                try:
                    self.call(directory, _saving(new))
                except IntegrityError:
                    continue
                self._remember(kind, subject_id, cell)
                return
            if claim.cell == cell:
                self._remember(kind, subject_id, cell)
                return
            if kind == KIND_RUNNER and self._deregistered_in(claim.cell, subject_id):
                claim.move(cell, self._now())
                try:
                    self.call(directory, _saving(claim))
                except IntegrityError:
                    continue
                self._remember(kind, subject_id, cell)
                return
            raise AlreadyExistsError(
                f"{kind} {subject_id!r} belongs to cell {claim.cell!r}: an id is unique "
                f"across cells (cell {cell!r} may not create it)"
            )
        raise AlreadyExistsError(f"{kind} {subject_id!r}: its claim kept changing; retry")

    def _deregistered_in(self, cell: str, runner_id: str) -> bool:
        runner = self.call(cell, lambda app: app.load(runner_uuid(runner_id), Runner))
        return runner is not None and runner.deregistered

    # -- commands routed by id ---------------------------------------------------------

    def on_runner(self, runner_id: str, operation: Callable[[SchedulerApplication], T]) -> T:
        """``operation`` on the cell that holds ``runner_id``; a cached cell that no longer
        holds it (its pool moved) is looked up again, once."""
        cell = self.cell_of_runner(runner_id)
        try:
            return self.call(cell, operation)
        except RunnerNotFoundError:
            if self.single:
                raise
            self.forget(KIND_RUNNER, runner_id)
            again = self.cell_of_runner(runner_id)
            if again == cell:
                raise
            return self.call(again, operation)

    def on_sandbox(self, sandbox_id: str, operation: Callable[[SchedulerApplication], T]) -> T:
        """``operation`` on the cell that holds ``sandbox_id``."""
        return self.call(self.cell_of_sandbox(sandbox_id), operation)

    # -- the application's commands ----------------------------------------------------

    def register_runner(self, *, runner_id: str, pool_name: str, **registration: Any) -> bool:
        """:meth:`SchedulerApplication.register_runner` in the cell of ``pool_name``."""
        require_text("runner_id", runner_id)
        require_text("pool_name", pool_name)
        cell = self.cell_of_pool(pool_name)
        self._claim_for(KIND_RUNNER, runner_id, cell)
        return self.call(
            cell,
            lambda app: app.register_runner(
                runner_id=runner_id, pool_name=pool_name, **registration
            ),
        )

    def record_heartbeat(
        self,
        *,
        runner_id: str,
        at: datetime,
        artifact_digests: Sequence[str] = (),
        materializations: Sequence[MaterializationSnapshot | Mapping[str, str]] = (),
    ) -> str:
        return self.on_runner(
            runner_id,
            lambda app: app.record_heartbeat(
                runner_id=runner_id,
                at=at,
                artifact_digests=artifact_digests,
                materializations=materializations,
            ),
        )

    def start_drain(self, runner_id: str) -> None:
        self.on_runner(runner_id, lambda app: app.start_drain(runner_id))

    def cancel_drain(self, runner_id: str) -> None:
        self.on_runner(runner_id, lambda app: app.cancel_drain(runner_id))

    def change_allocatable(self, runner_id: str, allocatable: Capacity | Mapping[str, int]) -> None:
        self.on_runner(runner_id, lambda app: app.change_allocatable(runner_id, allocatable))

    def deregister_runner(self, runner_id: str) -> None:
        self.on_runner(runner_id, lambda app: app.deregister_runner(runner_id))

    def create_sandbox(
        self,
        *,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: Requirements | Mapping[str, Any],
        heartbeat_timeout: timedelta,
    ) -> str:
        """:meth:`SchedulerApplication.create_sandbox` in the cell of the requirements'
        pool."""
        require_text("sandbox_id", sandbox_id)
        wanted = as_requirements(requirements)
        cell = self.cell_of_pool(wanted.pool_name, "requirements.pool_name")
        self._claim_for(KIND_SANDBOX, sandbox_id, cell)
        return self.call(
            cell,
            lambda app: app.create_sandbox(
                sandbox_id=sandbox_id,
                workspace_id=workspace_id,
                profile_revision_id=profile_revision_id,
                requirements=wanted,
                heartbeat_timeout=heartbeat_timeout,
            ),
        )

    def schedule(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        if not isinstance(request, ScheduleRequest):
            raise InvalidRequestError("request", "must be a ScheduleRequest", request)
        return self.on_sandbox(request.sandbox_id, lambda app: app.schedule(request))

    def mark_running(self, sandbox_id: str, generation: int, fencing_token: bytes) -> None:
        self.on_sandbox(
            sandbox_id, lambda app: app.mark_running(sandbox_id, generation, fencing_token)
        )

    def release(
        self,
        sandbox_id: str,
        generation: int,
        fencing_token: bytes,
        release_proof: Mapping[str, str],
    ) -> bool:
        return self.on_sandbox(
            sandbox_id,
            lambda app: app.release(sandbox_id, generation, fencing_token, release_proof),
        )

    def fail(
        self, sandbox_id: str, generation: int, fencing_token: bytes, failure_class: str
    ) -> DurableAssignment:
        return self.on_sandbox(
            sandbox_id, lambda app: app.fail(sandbox_id, generation, fencing_token, failure_class)
        )

    def claim_reconcile(
        self, sandbox_id: str, generation: int, owner: str, until: datetime
    ) -> bool:
        return self.on_sandbox(
            sandbox_id, lambda app: app.claim_reconcile(sandbox_id, generation, owner, until)
        )

    def record_reconcile(
        self, sandbox_id: str, generation: int, owner: str, decision: ReconcileDecision
    ) -> None:
        self.on_sandbox(
            sandbox_id, lambda app: app.record_reconcile(sandbox_id, generation, owner, decision)
        )

    def release_reconcile_claim(self, sandbox_id: str, generation: int, owner: str) -> bool:
        return self.on_sandbox(
            sandbox_id, lambda app: app.release_reconcile_claim(sandbox_id, generation, owner)
        )

    def advance_generation(self, sandbox_id: str, generation: int) -> int:
        return self.on_sandbox(
            sandbox_id, lambda app: app.advance_generation(sandbox_id, generation)
        )

    # -- queries -----------------------------------------------------------------------

    def now(self) -> datetime:
        return self._now()

    def get_assignment(
        self, sandbox_id: str, generation: int | None = None
    ) -> DurableAssignment | None:
        return self.on_sandbox(sandbox_id, lambda app: app.get_assignment(sandbox_id, generation))

    def assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        return self.on_sandbox(sandbox_id, lambda app: app.assignments(sandbox_id))

    def sandbox_home(self, sandbox_id: str) -> str:
        return self.on_sandbox(sandbox_id, lambda app: app.sandbox_home(sandbox_id))

    def runner_assignments(self, runner_id: str) -> list[DurableAssignment]:
        return self.on_runner(runner_id, lambda app: app.runner_assignments(runner_id))

    def get_runner(self, runner_id: str) -> RunnerSnapshot:
        return self.on_runner(runner_id, lambda app: app.get_runner(runner_id))

    def fold_runner(self, runner_id: str) -> RunnerSnapshot:
        return self.on_runner(runner_id, lambda app: app.fold_runner(runner_id))

    def runner_snapshots_across(
        self, pool_name: str | None = None
    ) -> AcrossCells[list[RunnerSnapshot]]:
        """Every cell's runner snapshots (of one pool: only its cell is asked)."""
        if pool_name is not None and not self.single:
            cells: list[str] | None = [self.cell_of_pool(pool_name)]
        else:
            cells = None
        return self.across(lambda app: app.runner_snapshots(pool_name), cells)

    def runner_snapshots(self, pool_name: str | None = None) -> list[RunnerSnapshot]:
        """Every runner of every cell (of one pool), by cell then id; CellUnavailableError
        if a cell asked did not answer."""
        found = self.runner_snapshots_across(pool_name)
        for error in found.unavailable.values():
            raise error
        return [snapshot for row in found.rows for snapshot in row.value]

    def runner_rows(self, pool_name: str | None = None) -> Iterator[CellRow[RunnerSnapshot]]:
        found = self.runner_snapshots_across(pool_name)
        for error in found.unavailable.values():
            raise error
        for row in found.rows:
            for snapshot in row.value:
                yield CellRow(row.cell, snapshot)

    def sandbox_application(self, sandbox_id: str) -> SchedulerApplication:
        """The application of the cell that holds ``sandbox_id`` (explanations,
        timelines)."""
        return self.application(self.cell_of_sandbox(sandbox_id))

    def runner_application(self, runner_id: str) -> SchedulerApplication:
        return self.application(self.cell_of_runner(runner_id))

    @contextmanager
    def errors_of(self, cell: str) -> Iterator[None]:
        """A store failure under the block is CellUnavailableError naming ``cell``."""
        try:
            yield
        except UNAVAILABLE as error:
            raise self._unavailable(cell, error) from None


def _saving(claim: CellClaim) -> Callable[[SchedulerApplication], object]:
    return lambda app: app.save(claim)


def _claim(app: SchedulerApplication, kind: str, subject_id: str) -> CellClaim | None:
    return app.load(cell_claim_uuid(kind, subject_id), CellClaim)


def exists_in(app: SchedulerApplication, kind: str, subject_id: str) -> bool:
    """Whether ``app``'s store has the runner or sandbox ``subject_id``."""
    aggregate: type[Any] = Runner if kind == KIND_RUNNER else Sandbox
    stream = runner_uuid(subject_id) if kind == KIND_RUNNER else sandbox_uuid(subject_id)
    return app.load(stream, aggregate) is not None


__all__ = ["AcrossCells", "CellRouter", "CellRow", "LazyApplication"]
