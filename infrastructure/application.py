"""The scheduler's application service (SPEC section 5) on eventsourcing.

Commands validate their input (InvalidRequestError naming the field, nothing
written), load aggregates, let the aggregates decide, and save every changed
aggregate in one atomic save. A lost optimistic-concurrency race
(``eventsourcing.persistence.IntegrityError``) is retried from the start after a
full-jitter backoff; past the retry limit it becomes SerializationContentionError.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, Application, ProcessingEvent
from eventsourcing.domain import Snapshot
from eventsourcing.persistence import ApplicationRecorder, EventStore, IntegrityError, Mapper
from eventsourcing.postgres import PostgresDatastore
from eventsourcing.sqlite import SQLiteDatastore
from eventsourcing.utils import EnvType, strtobool
from prometheus_client import CollectorRegistry

from secondbox_scheduler.domain.assignment import AssignmentRecord, to_durable_assignment
from secondbox_scheduler.domain.audit.chain import Chain
from secondbox_scheduler.domain.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    PlacementError,
    RunnerNotFoundError,
    SandboxNotFoundError,
    SchedulerError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.ids import lease_uuid, refusal_log_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.limits import (
    MAX_CLAIM_DURATION,
    MAX_DEADLINE_AHEAD,
    MAX_HEARTBEAT_TIMEOUT,
    MAX_PROOF_ENTRIES,
    MAX_PROOF_VALUE_LENGTH,
)
from secondbox_scheduler.domain.placement.evidence import Unlisted
from secondbox_scheduler.domain.reconcile import ReconcileDecision
from secondbox_scheduler.domain.refusals import OPERATION_CREATE, Refusal, RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox, assignment_history
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
from secondbox_scheduler.infrastructure.metrics import (
    MetricsSink,
    PrometheusMetrics,
    measured,
    refusal_reasons,
)
from secondbox_scheduler.infrastructure.placing.batch import PlacementBatch
from secondbox_scheduler.infrastructure.placing.batcher import DEFAULT_BATCH_SIZE, PlacementBatcher
from secondbox_scheduler.infrastructure.placing.runner_locks import RunnerLocks
from secondbox_scheduler.infrastructure.settings import (
    APPLICATION_RECORDER_TOPIC,
    AUDIT_KEY,
    BATCH_SIZE,
    BATCH_WAIT_MS,
    BATCHING,
    CHAIN,
    CHAINED_RECORDERS,
    CLOCK_TOLERANCE_SECONDS,
    DATABASE_URL,
    LEASE_RENEWAL_SECONDS,
    POSTGRES_MODULE,
    POSTGRES_SETTINGS,
    READ_MODELS,
    RUNNER_LOCKS,
    SQLITE_MODULE,
    batch_setting,
    clock_tolerance,
    settings_from_url,
)
from secondbox_scheduler.infrastructure.store.encoding import EventMapper
from secondbox_scheduler.infrastructure.store.event_chain import (
    ChainedPostgresRecorder,
    ChainedRecorder,
    SealedPostgresSnapshots,
    SealedSnapshots,
    SealedSQLiteSnapshots,
)
from secondbox_scheduler.infrastructure.store.fast_forward import load_many
from secondbox_scheduler.infrastructure.store.probe import probe_store
from secondbox_scheduler.infrastructure.store.startup import (
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    check_sqlite,
    connect_postgres,
    postgres_schema_lock,
)
from secondbox_scheduler.projections.candidates import home_candidates
from secondbox_scheduler.projections.event_log import count_events, last_versions
from secondbox_scheduler.projections.read_models import (
    ProjectionStatus,
    ReadModels,
    supports_read_models,
)
from secondbox_scheduler.projections.runner_index import RunnerIndex

T = TypeVar("T")
A = TypeVar("A")

BACKOFF_BASE_SECONDS = 0.002
BACKOFF_CAP_SECONDS = 0.250
BACKOFF_MAX_EXPONENT = 10  # 2 ms * 2**10 is past the cap already; 2.0**1024 overflows
COMMAND_RETRY_LIMIT = 32  # conflicts tolerated by commands other than schedule
DEFAULT_LEASE_RENEWAL = timedelta(seconds=10)


def system_now() -> datetime:
    return datetime.now(UTC)


class StaleRead(Exception):
    """A command read two aggregates on either side of a rival's commit (a sandbox
    without the assignment whose reservation its runner already holds, or the reverse):
    a lost race, retried like an optimistic-concurrency conflict."""


def _seconds(duration: timedelta) -> str:
    return f"{duration.total_seconds():g}s"


def backoff_ceiling(retry: int) -> float:
    """Upper bound of the full-jitter draw before retry number ``retry`` (0-based),
    defined for every retry: the exponent is capped, as the original caps it."""
    exponent = min(max(retry, 0), BACKOFF_MAX_EXPONENT)
    return min(BACKOFF_BASE_SECONDS * 2.0**exponent, BACKOFF_CAP_SECONDS)


@dataclass
class SchedulerMetrics:
    """Counters of one application instance (thread-safe). An exporter attached as
    ``sink`` (:meth:`SchedulerApplication.attach_metrics`: Prometheus, see
    :mod:`.metrics`) is told every count and command duration as it happens."""

    placements: int = 0
    replays: int = 0
    refusals_recorded: int = 0
    contention_retries: int = 0
    contention_errors: int = 0
    placements_deferred: int = 0  # to the next batch: another replica held the runner
    heartbeats: dict[str, int] = field(default_factory=dict)
    batch_sizes: dict[int, int] = field(default_factory=dict)  # placement batches by size
    refusals: dict[tuple[str, str], int] = field(default_factory=dict)  # (operation, error)
    refusal_reasons: dict[tuple[str, str], int] = field(default_factory=dict)  # runners refusing
    reconcile_actions: dict[str, int] = field(default_factory=dict)
    commands: dict[tuple[str, str], int] = field(default_factory=dict)  # (command, outcome)
    placement_batches: int = 0
    sink: MetricsSink | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)
        if self.sink is not None:
            self.sink.count(name, amount)

    def heartbeat(self, outcome: str) -> None:
        with self._lock:
            self.heartbeats[outcome] = self.heartbeats.get(outcome, 0) + 1
        if self.sink is not None:
            self.sink.heartbeat(outcome)

    def refusal(self, operation: str, error: PlacementError) -> None:
        """A refused placement: once per call, and per reason key the runners refusing
        (as ``simulate`` counts them: capacity per dimension, unlisted runners too)."""
        reasons = refusal_reasons(error)
        key = (operation, type(error).__name__)
        with self._lock:
            self.refusals[key] = self.refusals.get(key, 0) + 1
            for reason, runners in reasons.items():
                self.refusal_reasons[(operation, reason)] = (
                    self.refusal_reasons.get((operation, reason), 0) + runners
                )
        if self.sink is not None:
            self.sink.refusal(operation, key[1], reasons)

    def reconcile(self, action: str) -> None:
        with self._lock:
            self.reconcile_actions[action] = self.reconcile_actions.get(action, 0) + 1
        if self.sink is not None:
            self.sink.reconcile(action)

    def command(self, command: str, outcome: str, seconds: float) -> None:
        """One command's outcome (``ok``, ``refused``, ``error``) and duration."""
        with self._lock:
            self.commands[(command, outcome)] = self.commands.get((command, outcome), 0) + 1
        if self.sink is not None:
            self.sink.command(command, outcome, seconds)

    def batch(self, size: int) -> None:
        """One placement batch decided and committed, with its number of requests."""
        with self._lock:
            self.placement_batches += 1
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        if self.sink is not None:
            self.sink.batch(size)


class SchedulerApplication(Application[UUID]):
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
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._may_create = True
        planned = self.construct_env(self.name, env)
        self.clock_tolerance = clock_tolerance(planned.get(CLOCK_TOLERANCE_SECONDS))
        with self._opening(planned):
            super().__init__(env)
            seconds = self.env.get(LEASE_RENEWAL_SECONDS)
            self.lease_renewal_interval = (
                timedelta(seconds=float(seconds)) if seconds else DEFAULT_LEASE_RENEWAL
            )
            self.metrics = SchedulerMetrics()
            self.runner_index = RunnerIndex(self.recorder, self.mapper)
            self.read_models: ReadModels | None = None
            if supports_read_models(self) and self.env.get(READ_MODELS, "on") != "off":
                self.read_models = ReadModels(self)
            self.catch_up_inline = self.env.get(READ_MODELS, "on") != "external"
            self.runner_locks = RunnerLocks(
                self.recorder if strtobool(self.env.get(RUNNER_LOCKS) or "on") else None
            )
            self.batcher: PlacementBatcher | None = None
            if strtobool(self.env.get(BATCHING) or "on"):
                self.batcher = PlacementBatcher(
                    self._place_deferring,
                    size=int(
                        batch_setting(self.env.get(BATCH_SIZE), DEFAULT_BATCH_SIZE, BATCH_SIZE)
                    ),
                    wait=batch_setting(self.env.get(BATCH_WAIT_MS), 0, BATCH_WAIT_MS) / 1000,
                )
            if metrics_registry is not None:
                self.attach_metrics(metrics_registry)

    def close(self) -> None:
        locks = getattr(self, "runner_locks", None)
        if locks is not None:
            locks.close()
        super().close()

    def attach_metrics(self, registry: CollectorRegistry | None = None) -> PrometheusMetrics:
        """Export the metrics of this application (:mod:`.metrics`) to ``registry`` (a new
        one if None; pass ``prometheus_client.REGISTRY`` for the process-wide one), from
        now on; read-model lag and the log head are read at each scrape."""
        exporter = PrometheusMetrics(registry)
        exporter.watch(self._read_model_status, self.head_position, self.probe_store)
        self.metrics.sink = exporter
        return exporter

    def _read_model_status(self) -> list[ProjectionStatus] | None:
        return None if self.read_models is None else self.read_models.status()

    def probe_store(self) -> None:
        """StoreUnavailableError unless the store answers now (one connection, no retries)."""
        probe_store(self.env)

    @contextmanager
    def _opening(self, planned: Any) -> Iterator[None]:
        """Open the store named by the settings: a typed error at once when it cannot be
        reached (:mod:`.store_startup`); on PostgreSQL, tables created under a lock that
        replicas starting together take in turn."""
        module = planned.get("PERSISTENCE_MODULE", "")
        if module == POSTGRES_MODULE:
            settings = {key: planned.get(key) or "" for key in POSTGRES_SETTINGS}
            if strtobool(planned.get("CREATE_TABLE") or "y"):
                with postgres_schema_lock(settings) as may_create:
                    # a role without CREATE on the schema (the append-only application
                    # role, docs/operations.md) opens the tables its owner created
                    self._may_create = may_create
                    yield
                return
            connect_postgres(settings).close()
        elif module == SQLITE_MODULE:
            check_sqlite(planned.get("SQLITE_DBNAME") or "")
        yield

    def construct_env(self, name: str, env: EnvType | None = None) -> Any:
        environment = super().construct_env(name, env)
        url = environment.get(DATABASE_URL)
        if url:
            environment.update(settings_from_url(url))
        module = environment.get("PERSISTENCE_MODULE") or ""
        chained = (environment.get(CHAIN) or "on").lower() != "off"
        if (
            chained
            and module in CHAINED_RECORDERS
            and not environment.get(APPLICATION_RECORDER_TOPIC)
        ):
            environment[APPLICATION_RECORDER_TOPIC] = CHAINED_RECORDERS[module]
        if not getattr(self, "_may_create", True):
            environment["CREATE_TABLE"] = "n"
        return environment

    @property
    def chain(self) -> Chain:
        """The chain of the stored events (keyed with ``SECONDBOX_AUDIT_KEY`` if set)."""
        key = self.env.get(AUDIT_KEY) or ""
        return Chain(key.encode() or None)

    def construct_mapper(self) -> Mapper[UUID]:
        """The domain's events encoded with orjson (:mod:`.event_encoding`), unless the
        environment names another mapper (``MAPPER_TOPIC``)."""
        mapper_class = None if self.env.get(self.factory.MAPPER_TOPIC) else EventMapper
        return self.factory.mapper(
            transcoder=self.construct_transcoder(), mapper_class=mapper_class
        )

    def construct_recorder(self) -> ApplicationRecorder:
        recorder = super().construct_recorder()
        if isinstance(recorder, ChainedRecorder):
            recorder.configure(self.chain)
        return recorder

    def construct_snapshot_store(self) -> EventStore[UUID]:
        """Snapshots sealed by the chain (:mod:`.event_chain`) when the events are chained."""
        store = super().construct_snapshot_store()
        recorder = self.recorder
        if not isinstance(recorder, ChainedRecorder):
            return store
        name = store.recorder.events_table_name  # type: ignore[attr-defined]
        create = strtobool(self.env.get("CREATE_TABLE") or "y")
        datastore = getattr(self.factory, "datastore", None)
        sealed: SealedSnapshots
        if isinstance(datastore, SQLiteDatastore):
            sealed = SealedSQLiteSnapshots(datastore, events_table_name=name)
        elif isinstance(datastore, PostgresDatastore):
            sealed = SealedPostgresSnapshots(datastore, events_table_name=name)
        else:  # pragma: no cover - chained recorders exist for these two stores only
            return store
        sealed.configure(self.chain, recorder.events_table_name)  # before its tables
        if create:
            sealed.create_table()
        return EventStore(mapper=self.mapper, recorder=sealed)

    # -- helpers --------------------------------------------------------------

    def now(self) -> datetime:
        return require_aware("now", self._now())

    def _not_after_clock(self, field: str, value: datetime, now: datetime) -> None:
        """SPEC section 6a: no caller-supplied time later than clock + tolerance."""
        if value > now + self.clock_tolerance:
            raise InvalidRequestError(
                field,
                f"must not be later than the scheduler's clock + {_seconds(self.clock_tolerance)} "
                f"(clock {now.isoformat()}, got {value.isoformat()})",
            )

    def _near_clock(self, field: str, value: datetime, now: datetime) -> None:
        """SPEC section 6a: a request's time within clock +/- tolerance."""
        self._not_after_clock(field, value, now)
        if value < now - self.clock_tolerance:
            raise InvalidRequestError(
                field,
                f"must not be earlier than the scheduler's clock - "
                f"{_seconds(self.clock_tolerance)} (clock {now.isoformat()}, got "
                f"{value.isoformat()})",
            )

    def backoff(self, retry: int) -> None:
        """Full jitter: sleep a uniform draw in [0, min(2 ms * 2^retry, 250 ms)]."""
        with self._rng_lock:
            delay = self._rng.uniform(0.0, backoff_ceiling(retry))
        self._sleep(delay)

    def _retrying(self, operation: Callable[[int], T], *, retries: int, subject: str) -> T:
        """Run ``operation(attempt)``; on a lost race (a rival's commit first, or reads
        that straddled one: :class:`StaleRead`) back off and run it again."""
        for attempt in range(retries + 1):
            try:
                return operation(attempt)
            except (IntegrityError, StaleRead):
                if attempt == retries:
                    break
                self.metrics.add("contention_retries")
                self.backoff(attempt)
        self.metrics.add("contention_errors")
        raise SerializationContentionError(retries + 1, subject)

    def _load(self, aggregate_id: UUID, kind: type[A], *, copy: bool = True) -> A | None:
        """The aggregate, or None. ``copy=False`` returns the cached instance itself:
        only for reading a few scalar fields, never for commands."""
        try:
            aggregate: object = self.repository.get(aggregate_id, deepcopy_from_cache=copy)
        except AggregateNotFoundError:
            return None
        assert isinstance(aggregate, kind)
        return aggregate

    def _runner(self, runner_id: str, *, copy: bool = True) -> Runner:
        runner = self._load(runner_uuid(runner_id), Runner, copy=copy)
        if runner is None:
            raise RunnerNotFoundError(runner_id)
        if runner.deregistered:
            raise RunnerNotFoundError(runner_id, "deregistered")
        return runner

    def _lease(self, runner_id: str, *, copy: bool = True) -> RunnerLease:
        lease = self._load(lease_uuid(runner_id), RunnerLease, copy=copy)
        if lease is None:
            raise RunnerNotFoundError(runner_id)
        return lease

    def _sandbox(self, sandbox_id: str, *, copy: bool = True) -> Sandbox:
        sandbox = self._load(sandbox_uuid(sandbox_id), Sandbox, copy=copy)
        if sandbox is None:
            raise SandboxNotFoundError(sandbox_id)
        return sandbox

    def _update_runner(self, runner_id: str, change: Callable[[Runner, datetime], Any]) -> None:
        def attempt(_: int) -> None:
            runner = self._runner(runner_id)
            change(runner, self.now())
            if runner.pending_events:
                self.save(runner)

        self._retrying(attempt, retries=COMMAND_RETRY_LIMIT, subject=f"runner {runner_id!r}")

    def _update_sandbox(self, sandbox_id: str, change: Callable[[Sandbox, datetime], T]) -> T:
        def attempt(_: int) -> T:
            sandbox = self._sandbox(sandbox_id)
            result = change(sandbox, self.now())
            if sandbox.pending_events:
                self.save(sandbox)
            return result

        return self._retrying(
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
    ) -> None:
        """Register a runner host. Refuses an id that is already registered."""
        require_text("runner_id", runner_id)
        require_text("pool_name", pool_name)
        require_text("architecture", architecture)
        checked = RunnerSnapshot(
            id=runner_id,
            pool_name=pool_name,
            backend_kind=backend_kind,
            architecture=architecture,
            capabilities=_as_collection("capabilities", capabilities),
            allocatable=allocatable,
            guest_protocol_minimum=guest_protocol_minimum,
            guest_protocol_maximum=guest_protocol_maximum,
            supported_egress_contexts=_as_collection(
                "supported_egress_contexts", supported_egress_contexts
            ),
        )
        at = self.now()
        runner = Runner.register(
            runner_id=runner_id,
            pool_name=pool_name,
            backend_kind=checked.backend_kind,
            architecture=architecture,
            capabilities=checked.capabilities,
            allocatable=checked.allocatable,
            guest_protocol_minimum=checked.guest_protocol_minimum,
            guest_protocol_maximum=checked.guest_protocol_maximum,
            supported_egress_contexts=checked.supported_egress_contexts,
            at=at,
        )
        try:
            self.save(runner, RunnerLease.open(runner_id, at))
        except IntegrityError:
            raise AlreadyExistsError(f"runner {runner_id!r} is already registered") from None

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
        self._not_after_clock("at", at, self.now())
        checked = RunnerSnapshot(
            id=runner_id,
            artifact_digests=_as_collection("artifact_digests", artifact_digests),
            materializations=_as_collection("materializations", materializations),
        )
        self._runner(runner_id, copy=False)  # exists and is not deregistered

        def attempt(_: int) -> str:
            lease = self._lease(runner_id)
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

        outcome = self._retrying(
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
        wanted = _as_capacity("allocatable", allocatable)
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

        Repeating the call with the same arguments returns the recorded home runner.
        """
        require_text("sandbox_id", sandbox_id)
        require_text("workspace_id", workspace_id)
        require_text("profile_revision_id", profile_revision_id)
        wanted = _as_requirements(requirements)
        _require_timeout(heartbeat_timeout)

        existing = self._load(sandbox_uuid(sandbox_id), Sandbox)
        if existing is None:
            now = self.now()
            try:
                runners, unlisted = self._candidates(wanted, now, heartbeat_timeout)
                sandbox = Sandbox.create(
                    sandbox_id=sandbox_id,
                    workspace_id=workspace_id,
                    profile_revision_id=profile_revision_id,
                    requirements=wanted,
                    runners=runners,
                    now=now,
                    heartbeat_timeout=heartbeat_timeout,
                    unlisted=unlisted,
                )
            except PlacementError as error:
                self._record_refusal(
                    sandbox_id, OPERATION_CREATE, 0, error, now, heartbeat_timeout, wanted
                )
                raise
            try:
                self.save(sandbox)
                return sandbox.home_runner_id
            except IntegrityError:
                existing = self._load(sandbox_uuid(sandbox_id), Sandbox)
                assert existing is not None
        if (
            existing.workspace_id != workspace_id
            or existing.profile_revision_id != profile_revision_id
            or existing.requirements != wanted.to_record()
        ):
            raise AlreadyExistsError(
                f"sandbox {sandbox_id!r} already exists with another workspace or profile revision"
            )
        return existing.home_runner_id

    def _record_refusal(
        self,
        sandbox_id: str,
        operation: str,
        generation: int,
        error: PlacementError,
        decided_at: datetime,
        heartbeat_timeout: timedelta,
        requirements: Requirements | None = None,
    ) -> None:
        """Record a refused placement as evidence (best effort: it never changes the
        outcome; a lost race is retried a few times, then the record is dropped).
        ``requirements``: a refused creation's, so that it can be replayed."""
        self._record_refusals([
            Refusal(
                sandbox_id, operation, generation, error, decided_at, heartbeat_timeout,
                requirements,
            )
        ])  # fmt: skip

    def _record_refusals(self, refusals: Sequence[Refusal]) -> None:
        """Record refused placements as evidence: several (a batch's) with one read of
        their sandboxes' logs and one save (one by one, with a round trip and a commit
        each, they held up a batch's callers when a full fleet refused most of it); a
        lost race, or a single one: each alone, as best effort (above)."""
        for refusal in refusals:
            self.metrics.refusal(refusal.operation, refusal.error)
        if len(refusals) > 1:
            loaded = load_many(self, [refusal_log_uuid(r.sandbox_id) for r in refusals])
            logs: dict[str, RefusalLog] = {}
            recorded = 0
            for refusal in refusals:
                log = logs.get(refusal.sandbox_id) or loaded.get(
                    refusal_log_uuid(refusal.sandbox_id)
                )
                if not isinstance(log, RefusalLog):
                    log = RefusalLog.open(refusal.sandbox_id, refusal.decided_at)
                logs[refusal.sandbox_id] = log
                recorded += refusal.add_to(log)
            changed = [log for log in logs.values() if log.pending_events]
            try:
                if changed:  # all repeats of the last: nothing to save (review)
                    self.save(*changed)
                    self.metrics.add("refusals_recorded", recorded)
                return
            except IntegrityError:
                pass  # another replica recorded one of them first: each alone
        for refusal in refusals:
            self._store_refusal(refusal)

    def _store_refusal(self, refusal: Refusal) -> None:
        for _ in range(4):
            log = self._load(refusal_log_uuid(refusal.sandbox_id), RefusalLog) or (
                RefusalLog.open(refusal.sandbox_id, refusal.decided_at)
            )
            if not refusal.add_to(log):
                return
            try:
                self.save(log)
                self.metrics.add("refusals_recorded")
                return
            except IntegrityError:
                continue

    def _candidates(
        self, requirements: Requirements, now: datetime, heartbeat_timeout: timedelta
    ) -> tuple[list[RunnerSnapshot], Unlisted]:
        """The runners to evaluate for a home decision, and counts of the pool's others:
        with the read model, the pool's prefiltered candidates a page at a time
        (:func:`secondbox_scheduler.projections.candidates.home_candidates`); without it,
        every runner of the pool, folded from the aggregates."""
        read_models = self.current_read_models()
        if read_models is None:
            return self.fold_runner_snapshots(requirements.pool_name), Unlisted()
        return home_candidates(read_models.runners, requirements, now, heartbeat_timeout)

    def _load_runner(self, runner_id: str) -> Runner:
        """The runner an assignment holds capacity on (a copy to command)."""
        runner = self._load(runner_uuid(runner_id), Runner)
        if runner is None:
            raise RunnerNotFoundError(runner_id)
        return runner

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
        self, requests: Sequence[ScheduleRequest], deferrable: Sequence[bool]
    ) -> list[tuple[DurableAssignment, bool] | SchedulerError | None]:
        """The batcher's batch: None for a request handed back (its runner was busy)."""
        return PlacementBatch(self).run_deferring(requests, deferrable)

    def _check_request(self, request: object) -> None:
        if not isinstance(request, ScheduleRequest):
            raise InvalidRequestError("request", "must be a ScheduleRequest", request)
        request.ensure_valid()
        self._check_request_times(request)

    def save_in_order(self, events: Sequence[Any], aggregates: Sequence[Any] = ()) -> None:
        """Save ``events`` in one transaction in exactly this order (a batch keeps each
        placement's events together, as a single placement writes them); snapshots of
        ``aggregates`` as a save of them would take."""
        processing_event: ProcessingEvent[UUID] = ProcessingEvent()
        processing_event.events = list(events)
        processing_event.aggregates = {aggregate.id: aggregate for aggregate in aggregates}
        taken = self._snapshots_due(processing_event)
        events_recorder, snapshots = self.recorder, self.snapshots
        if (
            taken
            and snapshots is not None
            and isinstance(events_recorder, ChainedPostgresRecorder)
            and isinstance(snapshots.recorder, SealedPostgresSnapshots)
            and snapshots.recorder.datastore is events_recorder.datastore
        ):  # one transaction, one commit, for the events and the snapshots taken at them
            stored = [snapshots.mapper.to_stored_event(snapshot) for snapshot in taken]
            processing_event.saved_kwargs["snapshots"] = snapshots.recorder.within(stored)
            taken = []
        recordings = self._record(processing_event)
        if taken and snapshots is not None:
            snapshots.put(taken)
        self._notify(recordings)

    def _take_snapshots(self, processing_event: ProcessingEvent[UUID]) -> None:
        """Snapshot each saved aggregate whose new events passed a multiple of its
        interval, from the aggregate in memory (the library reads it back from the store
        for every such event; a batch passes several on a busy runner)."""
        taken = self._snapshots_due(processing_event)
        if taken and self.snapshots is not None:  # one transaction for all of them
            self.snapshots.put(taken)

    def _snapshots_due(self, processing_event: ProcessingEvent[UUID]) -> list[Any]:
        """The snapshots of the aggregates of ``processing_event`` whose new events pass
        a multiple of their snapshotting interval, taken from the aggregates in memory."""
        if self.snapshots is None:
            return []
        versions: dict[UUID, list[int]] = {}
        for event in processing_event.events:
            versions.setdefault(event.originator_id, []).append(event.originator_version)
        taken = []
        for aggregate_id, aggregate in processing_event.aggregates.items():
            interval = self.snapshotting_intervals.get(type(aggregate))
            written = versions.get(aggregate_id, ())
            if interval and any(version % interval == 0 for version in written):
                assert aggregate.version == max(written)
                snapshot_class = getattr(type(aggregate), "Snapshot", Snapshot)
                taken.append(snapshot_class.take(aggregate))
        return taken

    def stream_versions(self, stream_ids: Sequence[UUID]) -> dict[UUID, int]:
        """The last stored version of each stream (absent: no such stream)."""
        return last_versions(self.recorder, stream_ids)

    def _check_request_times(self, request: ScheduleRequest) -> None:
        """SPEC section 6a and the limits: the request's times against the clock."""
        assert request.now is not None
        assert request.effect_started_at is not None
        assert request.plan_ready_at is not None
        now = self.now()
        self._near_clock("now", request.now, now)
        self._not_after_clock("effect_started_at", request.effect_started_at, now)
        self._not_after_clock("plan_ready_at", request.plan_ready_at, now)
        for name in ("claim_expires_at", "operation_deadline"):
            value = getattr(request, name)
            if value - request.now > MAX_DEADLINE_AHEAD:
                raise InvalidRequestError(
                    name, f"must be at most {_seconds(MAX_DEADLINE_AHEAD)} after now", value
                )
        _require_timeout(request.heartbeat_timeout)

    @measured("mark_running")
    def mark_running(self, sandbox_id: str, generation: int, fencing_token: bytes) -> None:
        _require_fence(sandbox_id, generation, fencing_token)
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
        _require_fence(sandbox_id, generation, fencing_token)
        proof = require_string_map(
            "release_proof", release_proof, non_empty=True,
            max_entries=MAX_PROOF_ENTRIES, max_value_length=MAX_PROOF_VALUE_LENGTH,
        )  # fmt: skip

        def attempt(_: int) -> bool:
            now = self.now()
            sandbox = self._sandbox(sandbox_id)
            record = sandbox.release(generation, fencing_token, proof, now)
            if record is None:
                return False
            runner = self._load_runner(record["runner_id"])
            if not runner.holds(sandbox_id, generation):
                raise StaleRead  # a rival's release committed between the two reads
            runner.release(
                sandbox_id=sandbox_id, generation=generation, release_proof=proof, at=now
            )
            self.save(sandbox, runner)
            return True

        return self._retrying(
            attempt, retries=COMMAND_RETRY_LIMIT, subject=f"sandbox {sandbox_id!r}"
        )

    @measured("fail")
    def fail(
        self, sandbox_id: str, generation: int, fencing_token: bytes, failure_class: str
    ) -> DurableAssignment:
        """Count a failure: a transient class retries within retry_limit, else terminal."""
        _require_fence(sandbox_id, generation, fencing_token)
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
        _require_generation(sandbox_id, generation)
        require_text("owner", owner)
        until = require_aware("until", until)
        if until - self.now() > MAX_CLAIM_DURATION:
            raise InvalidRequestError(
                "until", f"a claim lasts at most {_seconds(MAX_CLAIM_DURATION)}", until
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
        _require_generation(sandbox_id, generation)
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
        _require_generation(sandbox_id, generation)
        require_text("owner", owner)
        return self._update_sandbox(
            sandbox_id, lambda sandbox, at: sandbox.release_reconcile_claim(generation, owner, at)
        )

    @measured("advance_generation")
    def advance_generation(self, sandbox_id: str, generation: int) -> int:
        """Move to generation + 1 (only after release); returns the new generation."""
        _require_generation(sandbox_id, generation)
        return self._update_sandbox(
            sandbox_id, lambda sandbox, at: sandbox.advance_generation(generation, at)
        )

    # -- queries --------------------------------------------------------------

    def get_assignment(
        self, sandbox_id: str, generation: int | None = None
    ) -> DurableAssignment | None:
        """The assignment of the current generation, or of ``generation``: a past one is
        read from the assignments read model when it is kept current here, else folded
        from the sandbox's events (the aggregate keeps only the current generation)."""
        require_text("sandbox_id", sandbox_id)
        sandbox = self._load(sandbox_uuid(sandbox_id), Sandbox, copy=False)
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
        return assignment_history(self.events.get(sandbox_uuid(sandbox_id)))

    def assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        """Every generation's assignment of one sandbox, oldest first."""
        require_text("sandbox_id", sandbox_id)
        read_models = self.current_read_models()
        if read_models is not None:
            found = read_models.assignments.by_sandbox(sandbox_id)
            if not found and self._load(sandbox_uuid(sandbox_id), Sandbox, copy=False) is None:
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
        return self._sandbox(sandbox_id, copy=False).home_runner_id

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

    def wait_for(self, position: int, timeout: float = 5.0) -> None:
        """Read-your-writes: block until the read models have applied ``position``."""
        if self.read_models is not None:
            self.read_models.wait(position, timeout)

    # -- folds of the aggregates (the authority the read models must equal) ----

    def fold_runner(self, runner_id: str) -> RunnerSnapshot:
        return self._runner(runner_id, copy=False).snapshot(self._lease(runner_id, copy=False))

    def fold_runner_snapshots(self, pool_name: str | None = None) -> list[RunnerSnapshot]:
        snapshots = []
        for runner_id in self.runner_index.runner_ids(pool_name):
            runner = self._load(runner_uuid(runner_id), Runner, copy=False)
            if runner is None or runner.deregistered:
                continue
            snapshots.append(runner.snapshot(self._lease(runner_id, copy=False)))
        return snapshots

    def fold_assignments(self, sandbox_id: str) -> list[DurableAssignment]:
        self._sandbox(sandbox_id, copy=False)  # refuses an unknown sandbox
        history = self._assignment_history(sandbox_id)
        return [to_durable_assignment(history[generation]) for generation in sorted(history)]

    def fold_runner_assignments(self, runner_id: str) -> list[DurableAssignment]:
        runner = self._runner(runner_id)
        found = []
        for held in runner.reservations.values():
            assignment = self.get_assignment(held["sandbox_id"], held["generation"])
            if assignment is not None:
                found.append(assignment)
        return sorted(found, key=lambda a: (a.sandbox_id, a.generation))

    def event_count(self) -> int:
        """How many events the store holds (all aggregates of this application)."""
        return count_events(self.recorder)

    def head_position(self) -> int:
        """The notification log's head position (may exceed the count on PostgreSQL)."""
        return self.recorder.max_notification_id() or 0


# -- input checks -------------------------------------------------------------


def _as_collection(field_name: str, value: object) -> Any:
    if isinstance(value, (str, bytes)):
        raise InvalidRequestError(field_name, "must be a collection, not a single string", value)
    return value


def _as_capacity(field_name: str, value: object) -> Capacity:
    if isinstance(value, Capacity):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field_name, "must be a Capacity or a mapping", value)
    try:
        return Capacity(**value)
    except InvalidRequestError as error:
        raise InvalidRequestError(f"{field_name}.{error.field}", error.rule, error.value) from None


def _as_requirements(value: object) -> Requirements:
    if isinstance(value, Mapping):
        value = Requirements(**value)
    if not isinstance(value, Requirements):
        raise InvalidRequestError("requirements", "must be Requirements or a mapping", value)
    if not value.pool_name:
        raise InvalidRequestError("requirements.pool_name", "must not be empty")
    if not value.architecture:
        raise InvalidRequestError("requirements.architecture", "must not be empty")
    if value.guest_protocol_generation < 1:
        raise InvalidRequestError("requirements.guest_protocol_generation", "must be at least 1")
    return value


def _require_timeout(value: object) -> None:
    if not isinstance(value, timedelta):
        raise InvalidRequestError("heartbeat_timeout", "must be a timedelta", value)
    if value <= timedelta(0):
        raise InvalidRequestError("heartbeat_timeout", "must be greater than zero")
    if value > MAX_HEARTBEAT_TIMEOUT:
        raise InvalidRequestError(
            "heartbeat_timeout", f"must be at most {_seconds(MAX_HEARTBEAT_TIMEOUT)}", value
        )


def _require_generation(sandbox_id: object, generation: object) -> None:
    require_text("sandbox_id", sandbox_id)
    if type(generation) is not int or generation < 1:  # not bool, not an IntEnum member
        raise InvalidRequestError("generation", "must be an integer of at least 1", generation)


def _require_fence(sandbox_id: object, generation: object, fencing_token: object) -> None:
    _require_generation(sandbox_id, generation)
    if not isinstance(fencing_token, bytes) or not fencing_token:
        raise InvalidRequestError("fencing_token", "must be non-empty bytes", fencing_token)
