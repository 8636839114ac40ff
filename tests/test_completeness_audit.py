"""The audit fold accounts for every event class the aggregates record.

Each class of the catalogue (:func:`event_classes`) is checked by a handler the fold's
table names (``AuditFold.HANDLERS``) or ignored for a reason (``AuditFold.IGNORED``);
an event of any other class, met at run time, is a finding (rule ``unknown-event``) at
its position, never skipped. Removing a handler must fail both checks: the static one
(:func:`unaccounted` names the class) and the one at run time (its events are reported).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from eventsourcing.domain import Aggregate
from eventsourcing.utils import get_topic

from secondbox_scheduler.domain.access_tokens import AccessTokens
from secondbox_scheduler.domain.assignment_history import assignment_history
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.domain.cell_claims import CellClaim
from secondbox_scheduler.domain.event_catalogue import event_classes, event_name, unaccounted
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify
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
from tests.conftest import Clock
from tests.factories import register

LATER = T0 + timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
UNKNOWN = "unknown-event"


class Widget(Aggregate):
    """An aggregate outside the catalogue: the scheduler never records its events."""

    class Poked(Aggregate.Event):
        pass

    def poke(self) -> None:
        self.trigger_event(self.Poked)


def whole_history() -> EventLog:
    """A clean history, made by the real aggregates, with an event of every class of the
    catalogue: two runners (one deregistered) with their leases, two sandboxes placed,
    one run, reconciled uncertain, released and advanced, the other redelivered past its
    deadline then failed for good, a refusal, an access token issued and revoked, and a
    runner's cell claim moved to another cell."""
    log = EventLog()
    runner, lease = new_runner("r1", allocatable=slots(3)), new_lease("r1")
    log.save(runner, lease)
    s1, s2 = (new_sandbox(sandbox_id, [runner.snapshot(lease)]) for sandbox_id in ("s1", "s2"))
    log.save(s1, s2)
    first = place(s1, runner, lease, LATER)
    log.save(s1, runner, first.token_use)
    second = place(s2, runner, lease, LATER)
    log.save(s2, runner, second.token_use)
    s1.mark_running(1, first.request.fencing_token, LATER)
    s1.claim_reconcile(1, "rec", LATER + MINUTE, LATER)
    s1.reconcile(1, "rec", "uncertain", "silent", LATER + MINUTE, LATER)
    s1.release_reconcile_claim(1, "rec", LATER)
    late = LATER + MINUTE  # a redelivery then gets a later operation deadline
    s2.claim_reconcile(1, "rec", late + MINUTE, late)
    s2.reconcile(1, "rec", "deadline_exceeded", "late", late + MINUTE, late)
    s2.release_reconcile_claim(1, "rec", late)
    s2.fail(1, second.request.fencing_token, "transport", late)  # no retry left: failed
    log.save(s1, s2)
    s1.release(1, first.request.fencing_token, PROOF, LATER)
    runner.release(sandbox_id="s1", generation=1, release_proof=PROOF, at=LATER)
    log.save(s1, runner)
    s1.advance_generation(1, LATER)
    runner.start_drain(LATER)
    runner.cancel_drain(LATER)
    runner.change_allocatable(slots(4), LATER)
    for seconds in (2, 200):  # one evidence change, then one renewal
        at = LATER + timedelta(seconds=seconds)
        lease.observe(
            at=at,
            artifact_digests=[RUNTIME, "sha256:other"],
            materializations=[materialization()],
            renewal_interval=MINUTE,
            recorded_at=at,
        )
    refusals = RefusalLog.open("s2", LATER)
    refusals.refuse(
        operation="schedule",
        generation=1,
        error="HomeRunnerUnavailableError",
        evaluations=[],
        decided_at=LATER,
        heartbeat_timeout=MINUTE,
    )
    gone, gone_lease = new_runner("r2"), new_lease("r2")
    gone.deregister(LATER)
    log.save(s1, runner, lease, refusals, gone, gone_lease)
    tokens = AccessTokens.open(LATER)
    tokens.issue(
        token_id="0123456789ab", role="runner", runner_ids=["r1"], token_sha256="0" * 64,
        expires_at=None, at=LATER,
    )  # fmt: skip
    tokens.revoke("0123456789ab", LATER)
    log.save(tokens)
    claim = CellClaim.claim(kind="runner", subject_id="r2", cell="a", at=LATER)
    claim.move("b", LATER)
    log.save(claim)
    return log


def positions_of(log: EventLog, event_class: type[Any]) -> list[int]:
    return [p for p, event in enumerate(log.events, start=1) if type(event) is event_class]


def unknown(violations: list[Violation]) -> list[Violation]:
    return [violation for violation in violations if violation.rule == UNKNOWN]


def test_the_whole_history_is_clean_and_holds_every_class_of_the_catalogue() -> None:
    """The ground the tests below stand on: with the fold's own table, nothing is found,
    and every class the fold must account for occurs (so each removal below is seen)."""
    log = whole_history()
    assert log.violations() == []
    assert {type(event) for event in log.events} == set(event_classes())


def test_after_every_event_the_folds_assignments_are_the_aggregates() -> None:
    """Each handler does its part: folded up to any position, the fold's assignment
    records are the ones the Sandbox aggregates hold there (field by field)."""
    log = whole_history()
    streams = {e.sandbox_id: e.originator_id for e in log.events if type(e) is Sandbox.Created}
    audit = AuditFold()
    for position, event in enumerate(log.events, start=1):
        audit.apply(position, event)
        expected = []
        for sandbox_id in sorted(streams):
            history = assignment_history(
                e for e in log.events[:position] if e.originator_id == streams[sandbox_id]
            )
            expected += [history[generation] for generation in sorted(history)]
        assert audit.assignment_records() == expected, (position, type(event).__qualname__)


# -- (a) every class is accounted for ----------------------------------------------------


def test_the_audit_fold_handles_or_ignores_with_a_reason_every_event_class() -> None:
    assert unaccounted(AuditFold.handled_events(), AuditFold.IGNORED) == []


def test_every_handler_the_table_names_is_a_method_of_the_fold() -> None:
    audit = AuditFold()
    for name in AuditFold.HANDLERS.values():
        assert callable(getattr(audit, name))


# -- (b) a handler removed is named, and its events are reported --------------------------


@pytest.mark.parametrize("removed", AuditFold.handled_events(), ids=event_name)
def test_a_class_whose_handler_is_removed_is_unaccounted_and_reported_when_met(
    removed: type[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    log = whole_history()
    table = {cls: name for cls, name in AuditFold.HANDLERS.items() if cls is not removed}
    monkeypatch.setattr(AuditFold, "HANDLERS", table)
    assert unaccounted(AuditFold.handled_events(), AuditFold.IGNORED) == [event_name(removed)]
    found = unknown(log.violations())
    assert [violation.position for violation in found] == positions_of(log, removed)
    for violation in found:
        assert violation.event == event_name(removed)
        assert get_topic(removed) in violation.detail


@pytest.mark.parametrize("removed", list(AuditFold.IGNORED), ids=event_name)
def test_a_class_no_longer_ignored_is_unaccounted_and_reported_when_met(
    removed: type[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    log = whole_history()
    ignored = {cls: why for cls, why in AuditFold.IGNORED.items() if cls is not removed}
    monkeypatch.setattr(AuditFold, "IGNORED", ignored)
    assert unaccounted(AuditFold.handled_events(), AuditFold.IGNORED) == [event_name(removed)]
    found = unknown(log.violations())
    assert [violation.position for violation in found] == positions_of(log, removed)


def test_an_ignored_class_without_a_reason_is_unaccounted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AuditFold, "IGNORED", dict.fromkeys(AuditFold.IGNORED, " "))
    assert unaccounted(AuditFold.handled_events(), AuditFold.IGNORED) == [
        event_name(cls) for cls in AuditFold.IGNORED
    ]


# -- (c) a class outside the catalogue ----------------------------------------------------


def test_an_event_of_a_class_outside_the_catalogue_is_an_unknown_event_finding() -> None:
    assert Widget.Poked not in event_classes()
    log = whole_history()
    end = len(log.events)
    widget = Widget()
    widget.poke()
    log.save(widget)
    audit = AuditFold()
    found = [audit.apply(position, event) for position, event in enumerate(log.events, start=1)]
    assert found[:end] == [[]] * end
    assert [violation.to_dict() for new in found[end:] for violation in new] == [
        {
            "position": end + 1,
            "aggregate": f"Widget {widget.id}",
            "event": "Widget.Created",
            "rule": UNKNOWN,
            "detail": f"event class {get_topic(Widget.Created)} is neither checked nor "
            "ignored by the audit",
        },
        {
            "position": end + 2,
            "aggregate": f"Widget {widget.id}",
            "event": "Widget.Poked",
            "rule": UNKNOWN,
            "detail": "event class tests.test_completeness_audit:Widget.Poked is neither "
            "checked nor ignored by the audit",
        },
    ]
    assert audit.finish() == [violation for new in found for violation in new]


def test_audit_verify_reports_an_event_of_a_class_outside_the_catalogue_in_a_store(
    app: SchedulerApplication, clock: Clock
) -> None:
    # the widget's events are stamped by the wall clock: the scheduler's clock reads it too
    # (else they are also recorded later than the auditor's clock: rule time-order)
    clock.current = datetime.now(UTC)
    register(app, "r1", at=clock())
    assert verify(app).ok
    widget = Widget()
    widget.poke()
    app.save(widget)
    end = app.head_position()
    report = verify(app)
    assert [(v.position, v.rule, v.event) for v in report.violations] == [
        (end - 1, UNKNOWN, "Widget.Created"),
        (end, UNKNOWN, "Widget.Poked"),
    ]
    assert report.first_bad_position == end - 1
