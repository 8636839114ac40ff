"""Which sandbox, runner and pool each event concerns: what the feed filters on.

Most events name their subject only through their stream: a ``Runner.DrainStarted``
holds nothing but a timestamp, a ``Sandbox.AssignmentRunning`` a generation. A stream's
subject is read from its first event (``Runner.Registered``, ``RunnerLease.Opened``,
``Sandbox.Created``, ``RefusalLog.Opened``, ``FencingTokenUse.Used``) and kept
(:class:`Subjects`); an event's own attributes refine it (:data:`RULES`):

- the events of a runner's streams (``Runner``, ``RunnerLease``) concern that runner
  and its pool, and a reservation's sandbox (``Runner.CapacityReserved``,
  ``Runner.CapacityReleased``);
- a sandbox's events concern the sandbox, its pool, and the runner of the generation
  they act on (fenced once, never changed): ``Sandbox.Created`` its home runner,
  ``Sandbox.GenerationAdvanced`` none (the new generation has no runner yet);
- a refusal concerns its sandbox (and the sandbox's pool once it exists), a fencing
  token's use its sandbox generation; the access tokens' events concern no sandbox,
  runner or pool.

Every event class of the catalogue has a rule: ``tests/test_event_feed.py`` checks it
with :func:`~secondbox_scheduler.domain.event_catalogue.unaccounted`, so that a new
event class cannot reach the feed unfiltered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from uuid import UUID

from secondbox_scheduler.domain.access_tokens import ACCESS_TOKEN_EVENTS
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.ids import runner_uuid, sandbox_uuid
from secondbox_scheduler.domain.lease import RunnerLease
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure.store.application_store import StoredApplication

MAX_STREAMS = 100_000  # stream subjects kept per process (least recently used dropped)


@dataclass(frozen=True, slots=True)
class Subject:
    """What an event concerns (None: nothing of that kind)."""

    sandbox_id: str | None = None
    runner_id: str | None = None
    pool_name: str | None = None


NOBODY = Subject()


class Subjects:
    """The subjects of streams and of sandbox generations, read once and kept."""

    def __init__(self, app: StoredApplication) -> None:
        self.app = app
        self._streams: OrderedDict[UUID, Subject] = OrderedDict()
        self._runners: OrderedDict[tuple[str, int], str | None] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, event: Any) -> Subject:
        """The subject of ``event`` (a domain event of the catalogue; NOBODY for another)."""
        rule = RULES.get(type(event))
        if rule is None:
            return NOBODY
        return rule(self, event)

    def stream(self, stream_id: UUID) -> Subject:
        """The subject of the stream, from its first event."""
        with self._lock:
            found = self._streams.get(stream_id)
            if found is not None:
                self._streams.move_to_end(stream_id)
                return found
        events = self.app.recorder.select_events(stream_id, lte=1, limit=1)
        subject = NOBODY
        if events:
            subject = self._first(self.app.mapper.to_domain_event(events[0]))
        self._keep(self._streams, stream_id, subject)
        return subject

    def learn(self, event: Any) -> None:
        """Keep what a stream's first event (or a fenced assignment) tells, as it passes."""
        if getattr(event, "originator_version", None) == 1 and type(event) in FIRST:
            self._keep(self._streams, event.originator_id, self._first(event))
        if isinstance(event, Sandbox.AssignmentFenced):
            record = event.assignment
            self._keep(
                self._runners, (record["sandbox_id"], record["generation"]), record["runner_id"]
            )

    def _first(self, event: Any) -> Subject:
        found = FIRST.get(type(event))
        return NOBODY if found is None else found(self, event)

    def generation_runner(self, sandbox_id: str | None, generation: int) -> str | None:
        """The runner a sandbox generation was fenced on (None: not fenced)."""
        if sandbox_id is None:
            return None
        key = (sandbox_id, generation)
        with self._lock:
            if key in self._runners:
                self._runners.move_to_end(key)
                return self._runners[key]
        runner = None
        get_assignment = getattr(self.app, "get_assignment", None)
        if get_assignment is not None:
            assignment = get_assignment(sandbox_id, generation)
            runner = None if assignment is None else assignment.runner_id
        if runner is not None:  # an unfenced generation may be fenced later: not kept
            self._keep(self._runners, key, runner)
        return runner

    def _keep(self, table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        with self._lock:
            table[key] = value
            table.move_to_end(key)
            while len(table) > MAX_STREAMS:
                table.popitem(last=False)


def _runner_first(subjects: Subjects, event: Any) -> Subject:
    return Subject(runner_id=event.runner_id, pool_name=event.pool_name)


def _lease_first(subjects: Subjects, event: Any) -> Subject:
    pool = subjects.stream(runner_uuid(event.runner_id)).pool_name
    return Subject(runner_id=event.runner_id, pool_name=pool)


def _sandbox_first(subjects: Subjects, event: Any) -> Subject:
    return Subject(sandbox_id=event.sandbox_id, pool_name=event.requirements.get("pool_name"))


def _of_sandbox(subjects: Subjects, event: Any) -> Subject:
    """A stream that belongs to a sandbox (refusals, token uses): its sandbox's pool."""
    pool = subjects.stream(sandbox_uuid(event.sandbox_id)).pool_name
    return Subject(sandbox_id=event.sandbox_id, pool_name=pool)


# The first event of each kind of stream, and the subject it gives the stream.
FIRST: Mapping[type[Any], Callable[[Subjects, Any], Subject]] = {
    Runner.Registered: _runner_first,
    RunnerLease.Opened: _lease_first,
    Sandbox.Created: _sandbox_first,
    RefusalLog.Opened: _of_sandbox,
    FencingTokenUse.Used: _of_sandbox,
}


def _stream(subjects: Subjects, event: Any) -> Subject:
    return subjects.stream(event.originator_id)


def _reserved(subjects: Subjects, event: Any) -> Subject:
    return replace(subjects.stream(event.originator_id), sandbox_id=event.sandbox_id)


def _released(subjects: Subjects, event: Any) -> Subject:
    sandbox_id = str(event.reservation).rpartition("#")[0] or None
    return replace(subjects.stream(event.originator_id), sandbox_id=sandbox_id)


def _created(subjects: Subjects, event: Any) -> Subject:
    return replace(subjects.stream(event.originator_id), runner_id=event.home_runner_id)


def _fenced(subjects: Subjects, event: Any) -> Subject:
    return replace(subjects.stream(event.originator_id), runner_id=event.assignment["runner_id"])


def _generation(subjects: Subjects, event: Any) -> Subject:
    stream = subjects.stream(event.originator_id)
    runner = subjects.generation_runner(stream.sandbox_id, event.generation)
    return replace(stream, runner_id=runner)


def _advanced(subjects: Subjects, event: Any) -> Subject:
    return subjects.stream(event.originator_id)  # the new generation has no runner yet


def _token_use(subjects: Subjects, event: Any) -> Subject:
    subject = _of_sandbox(subjects, event)
    return replace(
        subject, runner_id=subjects.generation_runner(event.sandbox_id, event.generation)
    )


def _nobody(subjects: Subjects, event: Any) -> Subject:
    return NOBODY


# Every event class of the catalogue: the subject of one of its events.
RULES: Mapping[type[Any], Callable[[Subjects, Any], Subject]] = {
    Runner.Registered: _stream,
    Runner.CapacityReserved: _reserved,
    Runner.CapacityReleased: _released,
    Runner.DrainStarted: _stream,
    Runner.DrainCancelled: _stream,
    Runner.AllocatableChanged: _stream,
    Runner.Deregistered: _stream,
    RunnerLease.Opened: _stream,
    RunnerLease.LivenessRenewed: _stream,
    RunnerLease.EvidenceRecorded: _stream,
    Sandbox.Created: _created,
    Sandbox.AssignmentFenced: _fenced,
    Sandbox.AssignmentRunning: _generation,
    Sandbox.AssignmentReleased: _generation,
    Sandbox.AssignmentFailed: _generation,
    Sandbox.ReconcileClaimed: _generation,
    Sandbox.ReconcileClaimReleased: _generation,
    Sandbox.AssignmentUncertain: _generation,
    Sandbox.ReconcileScheduled: _generation,
    Sandbox.GenerationAdvanced: _advanced,
    RefusalLog.Opened: _stream,
    RefusalLog.Refused: _stream,
    FencingTokenUse.Used: _token_use,
    **dict.fromkeys(ACCESS_TOKEN_EVENTS, _nobody),
}
