"""The scheduler's application service (docs/spec.md, section 5) on eventsourcing.

Each command reads top to bottom: check the input (``InvalidRequestError`` naming the
field, nothing written: ``domain/command_inputs.py``), load the aggregates, let the
aggregates decide, and save every changed aggregate in one atomic save. A lost
optimistic-concurrency race is retried from the start after a full-jitter backoff
(:mod:`.retrying`); past the retry limit it becomes ``SerializationContentionError``.
``schedule`` goes through the batcher to the placement batch (``placing/``), which
decides with ``domain/placement/deciding.py``. The store's wiring is the base class
(``store/application_store.py``); queries (:mod:`.queries`, on the service through
:mod:`.query_methods`), counters (:mod:`.counters`)
and refusal records (:mod:`.refusal_recording`) have modules of their own.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from eventsourcing.persistence import IntegrityError
from eventsourcing.utils import EnvType, strtobool

from secondbox_scheduler.domain.command_inputs import (
    as_capacity,
    as_collection,
    check_heartbeat_time,
    check_request_times,
    require_fence,
    require_generation,
    seconds_text,
)
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    RunnerNotFoundError,
    SchedulerError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.ids import runner_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.limits import (
    MAX_CLAIM_DURATION,
    MAX_PROOF_ENTRIES,
    MAX_PROOF_VALUE_LENGTH,
)
from secondbox_scheduler.domain.reconcile import ReconcileDecision
from secondbox_scheduler.domain.refusals import Refusal, RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import (
    Capacity,
    DurableAssignment,
    MaterializationSnapshot,
    Requirements,
    RunnerSnapshot,
    ScheduleRequest,
    require_aware,
    require_string_map,
    require_text,
)
from secondbox_scheduler.infrastructure.acting import current_actor
from secondbox_scheduler.infrastructure.counters import SchedulerMetrics
from secondbox_scheduler.infrastructure.creating.batch import CreateBatch, Created, CreateRequest
from secondbox_scheduler.infrastructure.creating.batcher import create_batcher_from_settings
from secondbox_scheduler.infrastructure.metrics import measured, timed_command
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.batcher import (
    DEFAULT_BATCH_SIZE,
    batcher_from_settings,
)
from secondbox_scheduler.infrastructure.placing.runner_locks import RunnerLocks
from secondbox_scheduler.infrastructure.queries import SchedulerQueries
from secondbox_scheduler.infrastructure.query_methods import QueryMethods
from secondbox_scheduler.infrastructure.refusal_recording import RefusalRecorder
from secondbox_scheduler.infrastructure.registration import (
    checked_registration,
    registered_runner,
    registered_so,
)
from secondbox_scheduler.infrastructure.retrying import COMMAND_RETRY_LIMIT, Retrying, StaleRead
from secondbox_scheduler.infrastructure.settings import (
    CLOCK_TOLERANCE_SECONDS,
    LEASE_RENEWAL_SECONDS,
    READ_MODELS,
    RUNNER_LOCKS,
    clock_tolerance,
)
from secondbox_scheduler.infrastructure.snapshot_intervals import snapshotting_interval
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication
from secondbox_scheduler.infrastructure.store.startup import DEFAULT_CONNECT_TIMEOUT_SECONDS
from secondbox_scheduler.infrastructure.store.write_timeouts import WriteTimeoutError
from secondbox_scheduler.projections.read_models import (
    ProjectionStatus,
    ReadModels,
    supports_read_models,
)

if TYPE_CHECKING:  # prometheus-client: the [server] extra, or the embedder's own
    from prometheus_client import CollectorRegistry

    from secondbox_scheduler.infrastructure.prometheus_export import PrometheusMetrics
T = TypeVar("T")

DEFAULT_LEASE_RENEWAL = timedelta(seconds=10)


def system_now() -> datetime:
    return datetime.now(UTC)


class SchedulerApplication(StoredApplication, QueryMethods):
    """Event-sourced scheduler: runners, sandboxes and fenced assignments."""

    snapshotting_intervals: ClassVar[dict[type[Any], int]] = {
        Runner: 10,
        Sandbox: 20,
        RunnerLease: 20,
        RefusalLog: 20,
    }
    env: ClassVar[dict[str, str]] = {
        "AGGREGATE_CACHE_MAXSIZE": "10000",
        "POSTGRES_CONNECT_TIMEOUT": str(DEFAULT_CONNECT_TIMEOUT_SECONDS),
    }

    def snapshotting_interval(self, aggregate: Any) -> int | None:
        """A Runner's interval grows with its active reservations
        (:mod:`.snapshot_intervals`); the others' are their class's."""
        base = self.snapshotting_intervals.get(type(aggregate))
        return None if base is None else snapshotting_interval(aggregate, base)

    def __init__(
        self,
        env: EnvType | None = None,
        now: Callable[[], datetime] | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        """``metrics_registry``: export this application's metrics to that Prometheus
        registry (:meth:`attach_metrics`); by default they are only counted in
        ``self.metrics``."""
        self._now = now or system_now
        planned = self.construct_env(self.name, env)
        self.clock_tolerance = clock_tolerance(planned.get(CLOCK_TOLERANCE_SECONDS))
        with self._opening(planned):
            super().__init__(env)
            seconds = self.env.get(LEASE_RENEWAL_SECONDS)
            self.lease_renewal_interval = (
                timedelta(seconds=float(seconds)) if seconds else DEFAULT_LEASE_RENEWAL
            )
            self.metrics = SchedulerMetrics()
            self.retrying = Retrying(self.metrics, sleep=sleep, rng=rng)
            self.refusals = RefusalRecorder(self, self.metrics)
            self.read_models: ReadModels | None = None
            self.catch_up_inline = self.env.get(READ_MODELS, "on") != "external"
            if supports_read_models(self) and self.env.get(READ_MODELS, "on") != "off":
                self.read_models = ReadModels(self, writes=self.catch_up_inline)
            self.queries = SchedulerQueries(
                self, self.read_models, catch_up_inline=self.catch_up_inline
            )
            self.runner_locks = RunnerLocks(
                self.recorder if strtobool(self.env.get(RUNNER_LOCKS) or "on") else None
            )
            self.batcher = batcher_from_settings(self.env, self._place_deferring)
            self.creations = create_batcher_from_settings(self.env, self._create)
            if metrics_registry is not None:
                self.attach_metrics(metrics_registry)

    def forget_cached(self) -> None:
        """After a reconnection: the aggregates cached, the runner-lock sessions and
        the catch-up gate's are of the lost server."""
        super().forget_cached()
        locks = getattr(self, "runner_locks", None)
        if locks is not None:
            locks.reset()
        read_models = getattr(self, "read_models", None)
        if read_models is not None:
            read_models.reset_gate()

    def close(self) -> None:
        for batcher in (getattr(self, "batcher", None), getattr(self, "creations", None)):
            if batcher is not None:
                batcher.close()  # its leader thread (for coroutines)
        locks = getattr(self, "runner_locks", None)
        if locks is not None:
            locks.close()
        read_models = getattr(self, "read_models", None)
        if read_models is not None:
            read_models.close()  # the catch-up gate's session
        super().close()

    def attach_metrics(self, registry: CollectorRegistry | None = None) -> PrometheusMetrics:
        """Export the metrics of this application (:mod:`.metrics`) to ``registry`` (a new
        one if None; pass ``prometheus_client.REGISTRY`` for the process-wide one), from
        now on; read-model lag and the log head are read at each scrape."""
        from secondbox_scheduler.infrastructure.prometheus_export import PrometheusMetrics

        exporter = PrometheusMetrics(registry)
        exporter.watch(self._read_model_status, self.head_position, self.probe_store)
        self.metrics.sink = exporter
        return exporter

    def _read_model_status(self) -> list[ProjectionStatus] | None:
        return None if self.read_models is None else self.read_models.status()

    # -- the clock, races, refusals (also the placement batch's port) ----------------

    def now(self) -> datetime:
        return require_aware("now", self._now())

    def backoff(self, retry: int) -> None:
        """Full jitter: sleep a uniform draw in [0, min(2 ms * 2^retry, 250 ms)]."""
        self.retrying.backoff(retry)

    def record_refusals(self, refusals: Sequence[Refusal]) -> None:
        """Record refused placements as evidence (best effort: :mod:`.refusal_recording`)."""
        self.refusals.record(refusals)

    def _update_runner(self, runner_id: str, change: Callable[[Runner, datetime], Any]) -> None:
        def attempt(_: int) -> None:
            runner = self.queries.runner(runner_id)
            change(runner, self.now())
            if runner.pending_events:
                self.save(runner)

        self.retrying.run(attempt, retries=COMMAND_RETRY_LIMIT, subject=f"runner {runner_id!r}")

    def _update_sandbox(self, sandbox_id: str, change: Callable[[Sandbox, datetime], T]) -> T:
        def attempt(_: int) -> T:
            sandbox = self.queries.sandbox(sandbox_id)
            result = change(sandbox, self.now())
            if sandbox.pending_events:
                self.save(sandbox)
            return result

        return self.retrying.run(
            attempt, retries=COMMAND_RETRY_LIMIT, subject=f"sandbox {sandbox_id!r}"
        )

    # -- runner side ----------------------------------------------------------

    @measured("register_runner")
    def register_runner(
        self,
        *,
        runner_id: str,
        pool_name: str,
        backend_kind: str,
        architecture: str,
        capabilities: Iterable[str] | Mapping[str, bool],
        allocatable: Capacity | Mapping[str, int],
        guest_protocol_minimum: int,
        guest_protocol_maximum: int,
        supported_egress_contexts: Iterable[str] = (),
    ) -> bool:
        """Register a runner host; True when this call registered it. The identical
        registration of a registered runner is a no-op (False); another registration of a
        taken id is refused (AlreadyExistsError): :mod:`.registration`."""
        checked = checked_registration(
            runner_id, pool_name, backend_kind, architecture, capabilities, allocatable,
            guest_protocol_minimum, guest_protocol_maximum, supported_egress_contexts,
        )  # fmt: skip
        at = self.now()
        try:
            self.save(registered_runner(checked, at), RunnerLease.open(runner_id, at))
        except WriteTimeoutError:  # a lock held elsewhere: contention, not a registration
            raise SerializationContentionError(1, f"runner {runner_id!r}") from None
        except IntegrityError:
            if registered_so(self.fold_runner, checked):
                return False
            raise AlreadyExistsError(f"runner {runner_id!r} is already registered") from None
        return True

    @measured("record_heartbeat")
    def record_heartbeat(
        self,
        *,
        runner_id: str,
        at: datetime,
        artifact_digests: Sequence[str] = (),
        materializations: Sequence[MaterializationSnapshot | Mapping[str, str]] = (),
    ) -> str:
        """Record liveness and evidence; returns what happened (see domain.lease).

        Evidence changes are always recorded; a plain renewal is recorded at most
        once per lease renewal interval; a heartbeat older than the last recorded
        one changes nothing. Heartbeats write only the runner's lease stream.
        """
        require_text("runner_id", runner_id)
        at = require_aware("at", at)
        check_heartbeat_time(at, self.now(), self.clock_tolerance)
        checked = RunnerSnapshot(
            id=runner_id,
            artifact_digests=as_collection("artifact_digests", artifact_digests),
            materializations=as_collection("materializations", materializations),
        )
        self.queries.runner(runner_id, copy=False)  # exists and is not deregistered

        def attempt(_: int) -> str:
            lease = self.queries.lease(runner_id)
            outcome = lease.observe(
                at=at,
                artifact_digests=checked.artifact_digests,
                materializations=checked.materializations,
                renewal_interval=self.lease_renewal_interval,
                recorded_at=self.now(),
            )
            if lease.pending_events:
                self.save(lease)
            return outcome

        outcome = self.retrying.run(
            attempt, retries=COMMAND_RETRY_LIMIT, subject=f"lease of runner {runner_id!r}"
        )
        self.metrics.heartbeat(outcome)
        return outcome

    @measured("start_drain")
    def start_drain(self, runner_id: str) -> None:
        require_text("runner_id", runner_id)
        self._update_runner(runner_id, lambda runner, at: runner.start_drain(at))

    @measured("cancel_drain")
    def cancel_drain(self, runner_id: str) -> None:
        require_text("runner_id", runner_id)
        self._update_runner(runner_id, lambda runner, at: runner.cancel_drain(at))

    @measured("change_allocatable")
    def change_allocatable(self, runner_id: str, allocatable: Capacity | Mapping[str, int]) -> None:
        """Change what the runner offers; refused below what is reserved."""
        require_text("runner_id", runner_id)
        wanted = as_capacity("allocatable", allocatable)
        self._update_runner(runner_id, lambda runner, at: runner.change_allocatable(wanted, at))

    @measured("deregister_runner")
    def deregister_runner(self, runner_id: str) -> None:
        """Remove a runner; refused while anything is reserved on it."""
        require_text("runner_id", runner_id)
        self._update_runner(runner_id, lambda runner, at: runner.deregister(at))

    # -- sandbox side ---------------------------------------------------------

    @measured("create_sandbox")
    def create_sandbox(
        self,
        *,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: Requirements | Mapping[str, Any],
        heartbeat_timeout: timedelta,
    ) -> str:
        """Choose and record the sandbox's home runner; returns its id.

        Repeating the call with the same arguments returns the recorded home runner (a
        :class:`~.creating.batch.RecordedHome`: the call created nothing). Concurrent
        calls of one process are decided at one catch-up of the read models and
        committed together (:mod:`.creating`), unless batching is off.
        """
        request = CreateRequest.checked(
            sandbox_id, workspace_id, profile_revision_id, requirements, heartbeat_timeout,
            current_actor(),
        )  # fmt: skip
        if self.creations is not None:
            return self.creations.create(request)
        outcome = self._create([request])[0]
        if isinstance(outcome, SchedulerError):
            raise outcome
        return outcome

    async def create_sandbox_async(
        self,
        *,
        sandbox_id: str,
        workspace_id: str,
        profile_revision_id: str,
        requirements: Requirements | Mapping[str, Any],
        heartbeat_timeout: timedelta,
    ) -> str:
        """:meth:`create_sandbox` for a coroutine (the HTTP service): the same checks,
        batches and answers, awaited on the caller's event loop rather than blocking a
        thread (:meth:`.creating.batcher.CreateBatcher.create_async`). With batching
        off, the call runs on the loop's default executor, in the caller's context."""
        if self.creations is None:
            call = functools.partial(
                self.create_sandbox, sandbox_id=sandbox_id, workspace_id=workspace_id,
                profile_revision_id=profile_revision_id, requirements=requirements,
                heartbeat_timeout=heartbeat_timeout,
            )  # fmt: skip
            context = contextvars.copy_context()
            return await asyncio.get_running_loop().run_in_executor(None, context.run, call)
        with timed_command(self.metrics, "create_sandbox"):
            request = CreateRequest.checked(
                sandbox_id, workspace_id, profile_revision_id, requirements, heartbeat_timeout,
                current_actor(),
            )  # fmt: skip
            return await self.creations.create_async(request)

    def _create(self, requests: Sequence[CreateRequest]) -> list[Created]:
        return CreateBatch(self).run(requests)

    @measured("schedule")
    def schedule(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        """Serialize one sandbox generation and reserve capacity on its home runner.

        Returns the assignment and whether this call created it (False: replay).
        Concurrent calls of one process are decided in arrival order and committed
        together (:mod:`.batcher`, :mod:`.placement_batch`), unless batching is off.
        """
        self._check_request(request)
        if self.batcher is not None:
            return self.batcher.schedule(request)
        outcome = self._place([request])[0]
        if isinstance(outcome, SchedulerError):
            raise outcome
        return outcome

    async def schedule_async(self, request: ScheduleRequest) -> tuple[DurableAssignment, bool]:
        """:meth:`schedule` for a coroutine (the HTTP service): the same checks, the same
        batches and answers, awaited on the caller's event loop rather than blocking a
        thread (:meth:`.batcher.PlacementBatcher.schedule_async`). With batching off, the
        call runs on the loop's default executor, in the caller's context (its actor)."""
        if self.batcher is None:
            loop = asyncio.get_running_loop()
            context = contextvars.copy_context()
            return await loop.run_in_executor(None, context.run, self.schedule, request)
        with timed_command(self.metrics, "schedule"):
            self._check_request(request)
            return await self.batcher.schedule_async(request)

    def schedule_many(
        self, requests: Sequence[ScheduleRequest]
    ) -> list[tuple[DurableAssignment, bool] | SchedulerError]:
        """``schedule`` for a batch the caller already holds: each request's answer, in
        order, as a serial execution in this order would give it (an assignment and
        whether it was created, or the typed error; an invalid request's error does not
        stop the others). Committed in transactions of at most the batch size."""
        checked: list[tuple[DurableAssignment, bool] | SchedulerError | None] = []
        valid: list[tuple[int, ScheduleRequest]] = []
        for index, request in enumerate(requests):
            try:
                self._check_request(request)
            except InvalidRequestError as error:
                checked.append(error)
                continue
            checked.append(None)
            valid.append((index, request))
        size = self.batcher.size if self.batcher is not None else DEFAULT_BATCH_SIZE
        for start in range(0, len(valid), size):
            chunk = valid[start : start + size]
            for (index, _), outcome in zip(chunk, self._place([r for _, r in chunk]), strict=True):
                checked[index] = outcome
        return [outcome for outcome in checked if outcome is not None]

    def _place(
        self, requests: Sequence[ScheduleRequest]
    ) -> list[tuple[DurableAssignment, bool] | SchedulerError]:
        return PlacementBatch(self).run(requests)

    def _place_deferring(
        self, requests: Sequence[ScheduleRequest], deferrable: Sequence[bool], actors: Any
    ) -> list[tuple[DurableAssignment, bool] | SchedulerError | None]:
        """The batcher's batch: None for a request handed back (its runner was busy)."""
        return PlacementBatch(self).run_deferring(requests, deferrable, actors)

    def _check_request(self, request: object) -> None:
        if not isinstance(request, ScheduleRequest):
            raise InvalidRequestError("request", "must be a ScheduleRequest", request)
        request.ensure_valid()
        check_request_times(request, self.now(), self.clock_tolerance)

    @measured("mark_running")
    def mark_running(self, sandbox_id: str, generation: int, fencing_token: bytes) -> None:
        require_fence(sandbox_id, generation, fencing_token)
        self._update_sandbox(
            sandbox_id, lambda sandbox, at: sandbox.mark_running(generation, fencing_token, at)
        )

    @measured("release")
    def release(
        self,
        sandbox_id: str,
        generation: int,
        fencing_token: bytes,
        release_proof: Mapping[str, str],
    ) -> bool:
        """Free the assignment's capacity, once; False when it was already released."""
        require_fence(sandbox_id, generation, fencing_token)
        proof = require_string_map(
            "release_proof", release_proof, non_empty=True,
            max_entries=MAX_PROOF_ENTRIES, max_value_length=MAX_PROOF_VALUE_LENGTH,
        )  # fmt: skip

        def attempt(_: int) -> bool:
            now = self.now()
            sandbox = self.queries.sandbox(sandbox_id)
            record = sandbox.release(generation, fencing_token, proof, now)
            if record is None:
                return False
            runner = self.load(runner_uuid(record["runner_id"]), Runner)
            if runner is None:
                raise RunnerNotFoundError(record["runner_id"])
            if not runner.holds(sandbox_id, generation):
                raise StaleRead  # a rival's release committed between the two reads
            runner.release(
                sandbox_id=sandbox_id, generation=generation, release_proof=proof, at=now
            )
            self.save(sandbox, runner)
            return True

        return self.retrying.run(
            attempt, retries=COMMAND_RETRY_LIMIT, subject=f"sandbox {sandbox_id!r}"
        )

    @measured("fail")
    def fail(
        self, sandbox_id: str, generation: int, fencing_token: bytes, failure_class: str
    ) -> DurableAssignment:
        """Count a failure: a transient class retries within retry_limit, else terminal."""
        require_fence(sandbox_id, generation, fencing_token)
        self._update_sandbox(
            sandbox_id,
            lambda sandbox, at: sandbox.fail(generation, fencing_token, failure_class, at),
        )
        assignment = self.get_assignment(sandbox_id, generation)
        assert assignment is not None
        return assignment

    @measured("claim_reconcile")
    def claim_reconcile(
        self, sandbox_id: str, generation: int, owner: str, until: datetime
    ) -> bool:
        """True only if no other owner holds an unexpired reconcile claim."""
        require_generation(sandbox_id, generation)
        require_text("owner", owner)
        until = require_aware("until", until)
        if until - self.now() > MAX_CLAIM_DURATION:
            raise InvalidRequestError(
                "until", f"a claim lasts at most {seconds_text(MAX_CLAIM_DURATION)}", until
            )
        return self._update_sandbox(
            sandbox_id, lambda sandbox, at: sandbox.claim_reconcile(generation, owner, until, at)
        )

    @measured("record_reconcile")
    def record_reconcile(
        self,
        sandbox_id: str,
        generation: int,
        owner: str,
        decision: ReconcileDecision,
    ) -> None:
        """Commit a reconcile result; refused (ReconcileClaimError) unless ``owner``'s
        claim is current when it commits."""
        require_generation(sandbox_id, generation)
        require_text("owner", owner)
        self._update_sandbox(
            sandbox_id,
            lambda sandbox, at: sandbox.reconcile(
                generation, owner, decision.action, decision.reason,
                decision.next_reconcile_at, at,
            ),
        )  # fmt: skip
        self.metrics.reconcile(decision.action)

    @measured("release_reconcile_claim")
    def release_reconcile_claim(self, sandbox_id: str, generation: int, owner: str) -> bool:
        require_generation(sandbox_id, generation)
        require_text("owner", owner)
        return self._update_sandbox(
            sandbox_id, lambda sandbox, at: sandbox.release_reconcile_claim(generation, owner, at)
        )

    @measured("advance_generation")
    def advance_generation(self, sandbox_id: str, generation: int) -> int:
        """Move to generation + 1 (only after release); returns the new generation."""
        require_generation(sandbox_id, generation)
        return self._update_sandbox(
            sandbox_id, lambda sandbox, at: sandbox.advance_generation(generation, at)
        )
