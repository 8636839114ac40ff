"""Placing a batch of schedule requests: decided in order, committed in one transaction.

``schedule`` (through :class:`~.batcher.PlacementBatcher`) and ``schedule_many`` come
here. A batch is decided as the requests would be one by one, in their order, against
the current state: each request sees the sandboxes and runners as the requests before
it left them (a duplicate request is answered as a replay of the first, a runner filled
by the first refuses the next). Then every new event is saved in **one** transaction, in
request order (each fence followed by its reservation and its token index, as a single
placement writes them), so the log of a batch reads like the log of the same placements
made one after another, and the audit fold checks it the same way.

While it decides and commits, the batch holds an advisory lock on each of its home
runners (PostgreSQL, :mod:`.runner_locks`): replicas whose batches meet on a runner take
turns instead of invalidating each other's decisions. It reads the runners and leases
just before the locks, and again those the locking step reports a rival changed
meanwhile (found in the same round trip as the locks). A batch of the batcher
(``run_deferring``) does not wait for a runner another replica's batch holds when a few
of its requests need it: those are handed back (None) and go first into the next batch.
Correctness does not rest on the locks: when another process committed first (the save
fails on a stream version), only the requests that read a stream that changed, and the
requests that read what those wrote, are decided again, each within its own
``serialization_retry_limit``; the others are committed at once. Every caller gets the
answer a serial execution would give: its assignment, a replay (``created=False``), a
typed refusal, or
``SerializationContentionError`` after its own retry budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from uuid import UUID

from eventsourcing.persistence import IntegrityError

from secondbox_scheduler.domain.actors import ActorRecord
from secondbox_scheduler.domain.errors import (
    HomeRunnerUnavailableError,
    InvalidRequestError,
    PlacementError,
    RunnerNotFoundError,
    SchedulerError,
    SerializationContentionError,
)
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse, token_sha256
from secondbox_scheduler.domain.ids import (
    fencing_token_uuid,
    lease_uuid,
    runner_uuid,
    sandbox_uuid,
)
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.placement.deciding import (
    HomeRunner,
    Placed,
    Refused,
    Replayed,
    decide_placement,
)
from secondbox_scheduler.domain.refusals import OPERATION_SCHEDULE, Refusal
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import TOKEN_REUSED, Sandbox
from secondbox_scheduler.domain.values import ScheduleRequest
from secondbox_scheduler.infrastructure.acting import stamp
from secondbox_scheduler.infrastructure.placing.port import Outcome, PlacementStore


@dataclass
class _Decision:
    """One request's decision within a round: what it read, what it wrote, its answer."""

    index: int
    request: ScheduleRequest
    read: set[UUID] = field(default_factory=set)  # streams whose state it depended on
    events: list[Any] = field(default_factory=list)  # new events, in save order
    aggregates: list[Any] = field(default_factory=list)  # that produced them
    outcome: Outcome | None = None
    refusal: PlacementError | None = None  # to record as evidence once final
    generation: int = 0
    stale: bool = False  # read a runner that saw a commit its sandbox read missed
    attempt: int = 0  # the lost races before this round (recorded with the placement)
    token: FencingTokenUse | None = None
    actor: ActorRecord | None = None  # who asked: recorded on its events (acting.py)


class PlacementBatch:
    """Decides and commits one batch of already validated requests."""

    def __init__(self, store: PlacementStore) -> None:
        self.store = store
        self._actors: Sequence[ActorRecord | None] = ()

    def run(self, requests: Sequence[ScheduleRequest]) -> list[Outcome]:
        """Every request's answer (``schedule_many``: none deferred)."""
        outcomes = self.run_deferring(requests, [False] * len(requests), ())
        return [outcome for outcome in outcomes if outcome is not None]

    def run_deferring(
        self,
        requests: Sequence[ScheduleRequest],
        deferrable: Sequence[bool],
        actors: Sequence[ActorRecord | None] = (),
    ) -> list[Outcome | None]:
        """Every request's answer, or None for a deferrable request whose home runner
        another replica's batch holds (its lock tried without waiting): the batcher
        queues it again, first, for the next batch, where it waits for the lock. The
        others go on at once; requests on different runners touch different streams,
        so the answers are still those of a serial execution in arrival order.
        ``actors``: who asked for each request (the batcher's callers), recorded on that
        request's events and refusal; none given: the context's, when saved."""
        self._actors = actors
        outcomes: list[Outcome | None] = [None] * len(requests)
        conflicts = [0] * len(requests)
        todo = list(range(len(requests)))
        may_defer = any(deferrable)
        round_ = 0
        while todo:
            pending = [(index, requests[index], conflicts[index]) for index in todo]
            sandboxes = self._sandboxes({request.sandbox_id for _, request, _ in pending})
            home_of = {
                index: sandbox.home_runner_id
                for index, request, _ in pending
                if (sandbox := sandboxes[request.sandbox_id]) and sandbox.home_runner_id
            }
            homes = set(home_of.values())
            patient = {home_of[i] for i in home_of if not deferrable[i]} if may_defer else None
            # read before the locks; what changed meanwhile is read again, and a hot
            # runner after its lock only (:mod:`.runner_locks`)
            late = self.store.runner_locks.read_late(homes)
            runners, read = self._runners(homes - late) if homes - late else ({}, {})
            # liveness only (:mod:`.runner_locks`)
            with self.store.runner_locks.hold(
                homes,
                wait_for=patient,
                worth_deferring=partial(_few_deferred, list(home_of.values()), len(pending)),
                check=read.items(),
            ) as held:
                deferred = {index for index, home in home_of.items() if home in held.busy}
                self._read_again(runners, homes - held.busy, held.changed, late)
                decisions = self._decide(
                    [p for p in pending if p[0] not in deferred], sandboxes, runners
                )
                retry = self._commit(decisions)
            self._refuse_used_tokens([d for d in decisions if d.index not in retry])
            may_defer = False  # a request decided again waits for its runner
            if deferred:
                self.store.metrics.add("placements_deferred", len(deferred))
            final = [decision for decision in decisions if decision.index not in retry]
            for decision in final:
                outcomes[decision.index] = decision.outcome
                self._account(decision)
            self.store.record_refusals([r for d in final if (r := _refusal(d)) is not None])
            todo = []
            for index in sorted(retry):
                conflicts[index] += 1
                limit = requests[index].serialization_retry_limit
                if conflicts[index] > limit:
                    self.store.metrics.add("contention_errors")
                    outcomes[index] = SerializationContentionError(
                        limit + 1, f"sandbox {requests[index].sandbox_id!r}"
                    )
                else:
                    self.store.metrics.add("contention_retries")
                    todo.append(index)
            if todo:
                self.store.backoff(round_)
                round_ += 1
        self.store.metrics.batch(len(requests))
        return outcomes

    # -- deciding ---------------------------------------------------------------

    def _decide(
        self,
        pending: list[tuple[int, ScheduleRequest, int]],
        sandboxes: dict[str, Sandbox | None],
        runners: dict[str, HomeRunner | SchedulerError],
    ) -> list[_Decision]:
        """Decide each request in order against the state the earlier ones left. The
        batch's sandboxes were read with one load; their home runners and leases with
        another (``PlacementStore.load_many``), before the locks, and again those that
        changed before the locks were held."""
        clock = self.store.now()
        decisions = []
        for index, request, attempt in pending:
            decision = _Decision(index, request, attempt=attempt)
            if index < len(self._actors):
                decision.actor = self._actors[index]
            decisions.append(decision)
            decision.read.add(sandbox_uuid(request.sandbox_id))
            try:
                decision.outcome = self._decide_one(
                    decision, sandboxes[request.sandbox_id], runners, clock
                )
            except SchedulerError as error:
                decision.outcome = error
        return decisions

    def _sandboxes(self, sandbox_ids: set[str]) -> dict[str, Sandbox | None]:
        # not cached: each is placed once, and a cached copy would be stale at the commit
        loaded = self.store.load_many([sandbox_uuid(s) for s in sandbox_ids], cache_new=False)
        found = {s: loaded.get(sandbox_uuid(s)) for s in sandbox_ids}
        return {
            s: sandbox if isinstance(sandbox, Sandbox) else None for s, sandbox in found.items()
        }

    def _runners(
        self, runner_ids: set[str]
    ) -> tuple[dict[str, HomeRunner | SchedulerError], dict[UUID, int]]:
        """Each home runner with its lease (copies to command), or why it is unavailable;
        and the version read of each of their streams (0: none)."""
        streams = [stream for r in runner_ids for stream in (runner_uuid(r), lease_uuid(r))]
        loaded = self.store.load_many(streams)
        read = {
            stream: aggregate.version if (aggregate := loaded.get(stream)) is not None else 0
            for stream in streams
        }
        found: dict[str, HomeRunner | SchedulerError] = {}
        for runner_id in runner_ids:
            runner, lease = loaded.get(runner_uuid(runner_id)), loaded.get(lease_uuid(runner_id))
            if not isinstance(runner, Runner) or runner.deregistered:
                found[runner_id] = HomeRunnerUnavailableError(
                    (), f"home runner {runner_id!r} is not registered"
                )
            elif not isinstance(lease, RunnerLease):
                found[runner_id] = RunnerNotFoundError(runner_id)
            else:
                found[runner_id] = (runner, lease)
        return found, read

    def _read_again(
        self,
        runners: dict[str, HomeRunner | SchedulerError],
        held: set[str],
        changed: frozenset[UUID] | None,
        late: set[str],
    ) -> None:
        """Read again the ``held`` runners whose runner or lease stream ``changed`` since
        they were read, before the locks (None: the locking step failed, read them all:
        it may have waited), and read the ``late`` ones, not read before."""
        if changed is None:
            again = set(held)
        else:
            again = {r for r in held if runner_uuid(r) in changed or lease_uuid(r) in changed}
            self.store.runner_locks.found_changed(again)
        again |= late & held
        if again:
            runners.update(self._runners(again)[0])

    def _decide_one(
        self,
        decision: _Decision,
        sandbox: Sandbox | None,
        runners: dict[str, HomeRunner | SchedulerError],
        clock: Any,
    ) -> Outcome | None:
        """The request's answer, decided by the domain (None: a stale read, to decide
        again after a reload). Records what it read and what it would write."""

        def home_runner(runner_id: str) -> HomeRunner | SchedulerError:
            decision.read.add(runner_uuid(runner_id))
            return runners[runner_id]

        if sandbox is not None:
            decision.generation = sandbox.generation
        decided = decide_placement(
            decision.request, sandbox, home_runner, attempt=decision.attempt, clock=clock
        )
        if isinstance(decided, Replayed):
            return decided.assignment, False
        if isinstance(decided, Refused):  # evidence worth recording, unless its token is
            decision.refusal = decided.error  # reused (_refuse_used_tokens)
            return decided.error
        if isinstance(decided, Placed):
            decision.events = [e for a in decided.aggregates for e in a.collect_events()]
            stamp(decision.events, decision.actor)
            decision.token = decided.token
            decision.aggregates = list(decided.aggregates)
            return decided.assignment, True
        decision.stale = True  # a rival's fence: the sandbox read missed it
        return None

    # -- committing -------------------------------------------------------------

    def _commit(self, decisions: list[_Decision]) -> set[int]:
        """Save the placements; the indexes of the requests to decide again."""
        stale = [d for d in decisions if d.stale]
        retry = {d.index for d in stale}
        if stale:  # and whatever read what a stale request read, to keep the order
            retry |= _dependents(decisions, set().union(*(d.read for d in stale)))
        placing = [d for d in decisions if d.events and d.index not in retry]
        while placing:
            # an aggregate that a request left out of this save also changed (retried,
            # or refused for a reused token) holds state this save does not store: no
            # snapshot of it and no caching (a later save will pass the interval again)
            saving = {d.index for d in placing}
            unsafe = {id(a) for d in decisions if d.index not in saving for a in d.aggregates}
            aggregates = [a for d in placing for a in d.aggregates if id(a) not in unsafe]
            try:
                self.store.save_in_order([e for d in placing for e in d.events], aggregates)
                self._cache_runners(aggregates)
                return retry
            except IntegrityError:
                changed = self._changed_streams(placing)
                if not changed:  # the store refused for a reason no stream shows: retry all
                    changed = {e.originator_id for d in placing for e in d.events}
                affected = _dependents(decisions, changed)
                reused = {d.index for d in placing if self._reused_token(d, changed)}
                retry |= affected - reused
                placing = [d for d in placing if d.index not in affected]
        return retry

    def _cache_runners(self, committed: list[Any]) -> None:
        """The runners just committed replace their cached copies (the library caches
        nothing on a save when it fast-forwards): the next batch on a runner then reads
        only what other replicas wrote since, not this commit's events back. Only
        committed states: an aggregate a retried request also changed is not among
        ``committed``; the cache's copy is never commanded (loads return copies)."""
        runners = {id(a): a for a in committed if isinstance(a, Runner)}
        self.store.cache_committed(list(runners.values()))

    def _refuse_used_tokens(self, decisions: list[_Decision]) -> None:
        """The placement refusals whose token an earlier generation used: those requests
        are invalid whatever the runners' state (invariant 3), and that is their answer
        (on success the save finds a reused token itself). One read for all of them,
        after the runners' locks: a refusal writes nothing, so no other decision of the
        batch depends on it, and a token's use by an earlier generation never changes."""
        refused = [d for d in decisions if d.refusal is not None]
        if not refused:
            return
        streams = {
            d.index: fencing_token_uuid(
                d.request.sandbox_id, token_sha256(d.request.fencing_token.hex())
            )
            for d in refused
        }
        used = self.store.load_many(list(set(streams.values())), cache_new=False)
        for decision in refused:
            earlier = used.get(streams[decision.index])
            # an earlier generation's: a later one's (another replica, since this
            # decision) is no reason to refuse what a serial execution refused first
            if isinstance(earlier, FencingTokenUse) and earlier.generation < decision.generation:
                decision.outcome = InvalidRequestError("fencing_token", TOKEN_REUSED)
                decision.refusal = None

    def _reused_token(self, decision: _Decision, changed: set[UUID]) -> bool:
        """Whether the save failed because an earlier generation used the request's token
        (its stream exists for another generation): invariant 3, not a race. Then the
        request's answer is that refusal, final."""
        token = decision.token
        if token is None or token.id not in changed:
            return False
        earlier = self.store.load_stored(token.id)
        if not isinstance(earlier, FencingTokenUse) or earlier.generation == decision.generation:
            return False
        decision.outcome = InvalidRequestError("fencing_token", TOKEN_REUSED)
        decision.events = []
        return True

    def _changed_streams(self, placing: list[_Decision]) -> set[UUID]:
        """Streams whose stored version moved past what the batch read (or, for a token
        index, that exist already)."""
        expected: dict[UUID, int] = {}
        for decision in placing:
            for event in decision.events:
                version = event.originator_version - 1
                expected[event.originator_id] = min(
                    expected.get(event.originator_id, version), version
                )
        stored = self.store.stream_versions(list(expected))
        return {stream for stream, version in expected.items() if stored.get(stream, 0) != version}

    def _account(self, decision: _Decision) -> None:
        outcome = decision.outcome
        if isinstance(outcome, tuple):
            self.store.metrics.add("placements" if outcome[1] else "replays")


def _refusal(decision: _Decision) -> Refusal | None:
    """The placement refusal of a final decision, to record as evidence."""
    request = decision.request
    if decision.refusal is None:
        return None
    assert request.now is not None
    return Refusal(
        request.sandbox_id, OPERATION_SCHEDULE, decision.generation, decision.refusal,
        request.now, request.heartbeat_timeout, actor=decision.actor,
    )  # fmt: skip


def _few_deferred(homes: list[str], requests: int, busy: frozenset[str]) -> bool:
    """Whether deferring the requests homed on ``busy`` runners puts off a few of the
    batch's requests (a quarter at most), not most of it: with hot runners that every
    batch needs, batches that take turns whole commit more per transaction."""
    return sum(home in busy for home in homes) * 4 <= requests


def _dependents(decisions: list[_Decision], changed: set[UUID]) -> set[int]:
    """The requests whose decisions may differ once the state is reloaded: those that
    read a changed stream and, in request order, those that read a stream an earlier
    one of them read or wrote (an earlier request never depends on a later one)."""
    dirty = set(changed)
    affected: set[int] = set()
    for decision in sorted(decisions, key=lambda d: d.index):
        touched = decision.read | {event.originator_id for event in decision.events}
        if touched & dirty:
            affected.add(decision.index)
            dirty |= touched
    return affected
