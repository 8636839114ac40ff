"""What the fold of ``audit verify`` holds is bounded by the fleet, not by the log: no
record of a past generation released as it should be, 16 bytes per used fencing
token, no refusal kept, a lease's recent versions only. And it finds what the full fold
(``audit state``'s, which keeps every record) finds, on histories that name past
generations and old lease versions."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.state import LEASE_VERSIONS_KEPT, LEASE_WINDOW
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.sandbox import Sandbox
from tests.aggregates import (
    PROOF,
    RUNTIME,
    T0,
    EventLog,
    materialization,
    new_lease,
    new_runner,
    new_sandbox,
    place,
    slots,
)

LATER = T0 + timedelta(seconds=1)


def _fold(events: list[Any], *, compact: bool) -> AuditFold:
    audit = AuditFold(compact=compact)
    for position, event in enumerate(events, start=1):
        audit.apply(position, event)
    audit.finish()
    return audit


def _generations(rounds: int) -> tuple[EventLog, Sandbox, list[bytes]]:
    """Sandbox s1 on runner r1 placed, released and advanced ``rounds`` times, then
    placed once more; the tokens of each generation."""
    log = EventLog()
    runner, lease = new_runner("r1", allocatable=slots(2)), new_lease("r1")
    log.save(runner, lease)
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    log.save(sandbox)
    tokens = []
    for generation in range(1, rounds + 2):
        made = place(sandbox, runner, lease, LATER)
        tokens.append(made.request.fencing_token)
        log.save(sandbox, runner, made.token_use)
        if generation > rounds:
            break
        sandbox.release(generation, made.request.fencing_token, PROOF, LATER)
        runner.release(sandbox_id="s1", generation=generation, release_proof=PROOF, at=LATER)
        log.save(sandbox, runner)
        sandbox.advance_generation(generation, LATER)
        log.save(sandbox)
    return log, sandbox, tokens


def test_a_compact_fold_holds_no_record_of_a_past_generation_released_as_it_should_be() -> None:
    log, _, tokens = _generations(5)
    audit = _fold(log.events, compact=True)
    assert audit.violations == []
    (state,) = [s.sandbox for s in audit._streams.values() if s.sandbox is not None]
    assert state.generation == 6
    assert list(state.assignments) == [6]  # the current generation's record only
    assert len(state.tokens) == 6
    assert all(t.hex() in state.tokens for t in tokens)
    assert (tokens[0][:-1] + b"x").hex() not in state.tokens


def test_a_compact_fold_finds_what_the_full_fold_finds_about_past_generations() -> None:
    """Events naming a past generation (each one the aggregates refuse), a token of an
    earlier generation reused, a generation advanced unfenced: the same violations."""
    log, sandbox, tokens = _generations(3)
    forged = copy.deepcopy(log)
    stream = sandbox.id
    forged.forge(Sandbox.AssignmentReleased, stream, generation=1, release_proof=PROOF)
    forged.forge(Sandbox.AssignmentRunning, stream, generation=2)
    forged.forge(Sandbox.AssignmentReleased, stream, generation=2, release_proof={})
    forged.forge(Sandbox.AssignmentFailed, stream, generation=3, state="failed",
                 failure_class="admission", retry_count=1)  # fmt: skip
    fence = next(e for e in log.events if isinstance(e, Sandbox.AssignmentFenced))
    record = {**fence.assignment, "generation": 4, "fencing_token": tokens[1].hex()}
    forged.forge(Sandbox.AssignmentFenced, stream, assignment=record, placement=fence.placement)
    forged.forge(Sandbox.GenerationAdvanced, stream, generation=9)
    forged.forge(Sandbox.AssignmentReleased, stream, generation=5, release_proof=PROOF)
    forged.forge(Sandbox.AssignmentRunning, stream, generation=0)
    full, compact = _fold(forged.events, compact=False), _fold(forged.events, compact=True)
    found = [(v.position, v.rule, v.detail) for v in compact.violations]
    assert found == [(v.position, v.rule, v.detail) for v in full.violations]
    details = [detail for _, _, detail in found]
    assert "generation 1 released twice" in details
    assert "fencing token reused in generation 4" in details
    assert "release of generation 5 never fenced" in details


def test_a_compact_fold_keeps_no_refusal() -> None:
    log = EventLog()
    refusals = RefusalLog.open("s1", T0)
    refusals.refuse(
        operation="schedule", generation=1, error="NoCompatibleRunnerError", evaluations=(),
        decided_at=T0, heartbeat_timeout=timedelta(seconds=30),
    )  # fmt: skip
    log.save(refusals)
    assert _fold(log.events, compact=False).refusals
    assert _fold(log.events, compact=True).refusals == {}


def _renewals(lease: Any, count: int, every: timedelta, log: EventLog, start: int = 1) -> None:
    for index in range(start, start + count):
        at = T0 + index * every
        lease.observe(at=at, artifact_digests=[RUNTIME], materializations=[materialization()],
                      renewal_interval=timedelta(0), recorded_at=at)  # fmt: skip
        log.save(lease)


def test_a_lease_keeps_recent_versions_and_names_an_evidence_of_a_forgotten_one() -> None:
    log = EventLog()
    runner, lease = new_runner("r1", allocatable=slots(2)), new_lease("r1")
    log.save(runner, lease)
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    log.save(sandbox)
    old = copy.deepcopy(lease)  # the lease at version 2, as a stale decision saw it
    every = LEASE_WINDOW / 10
    _renewals(lease, 200, every, log)
    audit = _fold(log.events, compact=True)
    (kept,) = [s.lease for s in audit._streams.values() if s.lease is not None]
    assert kept.version == lease.version == 202
    assert LEASE_VERSIONS_KEPT <= len(kept.history) <= 12  # the window's, not 202
    assert kept.forgotten >= 190
    # a placement decided now on the lease as it was at version 2 (long left)
    now = T0 + 200 * every
    made = place(sandbox, runner, old, now, heartbeat_timeout=timedelta(hours=6))
    log.save(sandbox, runner, made.token_use)
    audit = _fold(log.events, compact=True)
    assert [v.rule for v in audit.violations] == ["invariant-4"]
    assert "evidence of lease version 2, which the lease left more than" in (
        audit.violations[0].detail
    )
    assert made.request.fencing_token  # the placement itself was made


def test_a_lease_renewed_fast_keeps_its_last_versions() -> None:
    """Renewals closer together than the window: every version of the window is kept
    (a placement may name any of them), checked against each one's heartbeat."""
    log = EventLog()
    runner, lease = new_runner("r1", allocatable=slots(2)), new_lease("r1")
    log.save(runner, lease)
    sandbox = new_sandbox("s1", [runner.snapshot(lease)])
    log.save(sandbox)
    _renewals(lease, 30, timedelta(seconds=1), log)
    recent = copy.deepcopy(lease)
    _renewals(lease, 5, timedelta(seconds=1), log, start=31)
    made = place(sandbox, runner, recent, T0 + timedelta(seconds=31))
    log.save(sandbox, runner, made.token_use)
    audit = _fold(log.events, compact=True)
    assert audit.violations == []
    (kept,) = [s.lease for s in audit._streams.values() if s.lease is not None]
    assert len(kept.history) == kept.version  # all within the window
