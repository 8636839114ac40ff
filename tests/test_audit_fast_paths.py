"""The audit fold's shortcuts on a placement (``domain/audit/sandbox_checks.py``) find
what the long way finds.

- A sandbox's requirement record is validated once for records of the very same values
  (``SandboxChecks._pinned``, keyed by the record's ``marshal`` bytes): a record equal
  to a validated one by ``==`` but not in its types (``True`` or ``1.0`` for ``1``, a
  tuple for a list) is validated on its own, and refused as ``Requirements.from_record``
  refuses it.
- A placement whose evidence is the fold's own runner and lease is settled by
  ``passes_on_state`` (``passes_every_rule`` read from the fold's state); when it does
  not pass, every rule is evaluated on the snapshot and each failure named, as before
  (tested here on evidence the fold takes as its own: ``plain_view`` returns its
  lease's entry).
- A home decision that lists one candidate is judged without the ranks' loop: each
  finding, and each error a malformed one raises, is the loop's.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from secondbox_scheduler.domain.audit import sandbox_checks
from secondbox_scheduler.domain.audit.evidence import plain_evidence, plain_view
from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.domain.audit.state import REQUIREMENTS_KEPT
from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.placement.evidence import rank_key_from_record
from secondbox_scheduler.domain.sandbox import Sandbox
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot
from tests.aggregates import T0, requirements
from tests.test_audit_fold import LATER, World, details_at, world

RECORD = requirements().to_record()


def _pinned(audit: AuditFold, record: dict[str, Any]) -> Requirements:
    return audit._pinned(record)


def test_records_of_the_same_values_share_one_validation() -> None:
    audit = AuditFold(compact=True)
    first = _pinned(audit, copy.deepcopy(RECORD))
    assert first == Requirements.from_record(RECORD)
    assert _pinned(audit, copy.deepcopy(RECORD)) is first
    other = {**copy.deepcopy(RECORD), "pool_name": "pool-b"}
    assert _pinned(audit, other) == Requirements.from_record(other)
    assert _pinned(audit, other) is not first


def _capacity_as(value: object) -> dict[str, Any]:
    record = copy.deepcopy(RECORD)
    record["capacity"]["instances"] = value
    return record


@pytest.mark.parametrize(
    "record",
    [
        _capacity_as(True),  # == 1, refused: a bool is not an amount
        _capacity_as(1.0),  # == 1, refused: strict integers
        {**RECORD, "preferred_artifact_digests": tuple(RECORD["preferred_artifact_digests"])},
        {**RECORD, "pool_name": datetime(2026, 1, 1, tzinfo=UTC)},  # marshal cannot write it
        {**RECORD, "extra": None},
    ],
)
def test_a_record_equal_in_value_but_not_in_type_is_validated_on_its_own(
    record: dict[str, Any],
) -> None:
    audit = AuditFold(compact=True)
    _pinned(audit, copy.deepcopy(RECORD))  # the sound record validated first
    try:
        expected: Requirements | str = Requirements.from_record(record)
    except InvalidRequestError as error:
        expected = str(error)
    try:
        found: Requirements | str = _pinned(audit, record)
    except InvalidRequestError as error:
        found = str(error)
    assert found == expected


def test_the_records_kept_are_bounded_and_each_still_validated() -> None:
    audit = AuditFold(compact=True)
    for n in range(REQUIREMENTS_KEPT + 10):
        record = {**copy.deepcopy(RECORD), "pool_name": f"pool-{n}"}
        assert _pinned(audit, record).pool_name == f"pool-{n}"
        assert len(audit._requirements_seen) <= REQUIREMENTS_KEPT
    with pytest.raises(InvalidRequestError):
        _pinned(audit, _capacity_as(True))


def test_a_tampered_requirement_record_is_found_though_a_sound_one_was_validated() -> None:
    w = world()  # s1 placed: its record validated
    created = next(
        e for e in w.log.events if isinstance(e, Sandbox.Created) and e.sandbox_id == "s2"
    )
    created.__dict__["requirements"] = _capacity_as(True)
    fence = w.place("s2") - 2  # the fence, its reservation, its token index
    audit = AuditFold(compact=True)
    refused = {}
    for position, event in enumerate(w.log.events, start=1):
        try:
            audit.apply(position, event)
        except InvalidRequestError as error:  # audit verify: "unfoldable" at the fence
            refused[position] = str(error)
    assert refused == {fence: str(_refusal(_capacity_as(True)))}


def _refusal(record: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        Requirements.from_record(record)
    return refused.value


def _spied(monkeypatch: pytest.MonkeyPatch) -> list[RunnerSnapshot | None]:
    seen: list[RunnerSnapshot | None] = []

    def spy(record: Any, *args: Any) -> tuple[Any, ...] | None:
        view = plain_view(record, *args)
        seen.append(plain_evidence(record, *args))
        return view

    monkeypatch.setattr(sandbox_checks, "plain_view", spy)
    return seen


def test_a_stale_heartbeat_on_the_folds_own_evidence_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = world()
    # the evidence is the runner and lease as the log has them; the decision's timeout
    # makes the heartbeat (at T0) stale at its time (LATER, one second on)
    position = w.forge_fence(placement={"heartbeat_timeout_seconds": 0.5})
    seen = _spied(monkeypatch)
    found = details_at(w.log, position, "invariant-4")
    assert seen[-1] is not None  # taken as the fold's own state
    stale_before = (LATER - timedelta(seconds=0.5)).isoformat()
    assert found == [
        f"runner 'r1' was not compatible: last heartbeat {T0.isoformat()} is before {stale_before}"
    ]


def test_a_draining_runner_on_the_folds_own_evidence_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w: World = world()
    fields = w.fence_fields()
    w.runner.start_drain(LATER)
    w.log.save(w.runner)
    fields["placement"]["runner"] = {
        **fields["placement"]["runner"],
        "drain_phase": "draining",
    }
    fields["placement"]["runner_version"] = w.runner.version
    position = w.log.forge(Sandbox.AssignmentFenced, w.sandboxes["s2"].id, **fields)
    seen = _spied(monkeypatch)
    found = details_at(w.log, position, "invariant-4")
    assert seen[-1] is not None
    assert found == ["runner 'r1' was not compatible: drain phase is 'draining'"]


def _home_check_the_long_way(audit: AuditFold, home: str, decision: dict[str, Any]) -> None:
    """``SandboxChecks._check_home_decision`` as it was before its one-candidate case."""
    chosen = decision.get("chosen_runner_id")
    if chosen != home:
        audit._violate("invariant-4", f"home decision chose {chosen!r}")
    ranks = {}
    for c in decision.get("candidates", ()):
        if not c["failures"]:
            ranks[c["runner_id"]] = c.get("rank")
    if home not in ranks:
        audit._violate("invariant-4", f"home runner {home!r} is not listed as compatible")
        return
    if len(ranks) == 1:
        rank_key_from_record(home, ranks[home])
        return
    best = min(ranks, key=lambda runner_id: rank_key_from_record(runner_id, ranks[runner_id]))
    if ranks[home] is not None and best != home:
        audit._violate("invariant-4", f"listed runner {best!r} ranks above home {home!r}")


RANK = {"artifact_locality": 1, "free_instances": 3, "free_vcpu_count": 4, "free_memory_bytes": 5}
HOME_DECISIONS: dict[str, Any] = {
    "the home alone": [{"runner_id": "r1", "failures": [], "rank": RANK}],
    "the home alone, no rank": [{"runner_id": "r1", "failures": []}],
    "the home alone, refused": [{"runner_id": "r1", "failures": [{"code": "pool"}], "rank": RANK}],
    "another runner alone": [{"runner_id": "r2", "failures": [], "rank": RANK}],
    "a malformed rank": [{"runner_id": "r1", "failures": [], "rank": {"free_instances": "x"}}],
    "a rank of a list": [{"runner_id": "r1", "failures": [], "rank": [1]}],
    "an unhashable runner id": [{"runner_id": ["r1"], "failures": [], "rank": RANK}],
    "a candidate of a list": [["r1"]],
    "no failures key": [{"runner_id": "r1", "rank": RANK}],
    "candidates as a mapping": {"r1": {"runner_id": "r1", "failures": []}},
    "candidates as a string": "r",
    "no candidates": [],
    "two, the home first": [
        {"runner_id": "r1", "failures": [], "rank": RANK},
        {"runner_id": "r2", "failures": [], "rank": RANK},
    ],
    "two, the home second": [
        {"runner_id": "r0", "failures": [], "rank": RANK},
        {"runner_id": "r1", "failures": [], "rank": RANK},
    ],
}


def _outcome(check: Any, decision: dict[str, Any]) -> tuple[list[str], str | None]:
    audit = AuditFold(compact=True)
    audit._current = SimpleNamespace(originator_id="s1")  # what a finding is named by
    try:
        check(audit, "r1", decision)
    except Exception as error:  # audit verify: "unfoldable", with this error
        return [v.detail for v in audit.violations], f"{type(error).__name__}: {error}"
    return [v.detail for v in audit.violations], None


@pytest.mark.parametrize("case", HOME_DECISIONS)
@pytest.mark.parametrize("chosen", ["r1", "r2"])
def test_a_home_decision_of_one_candidate_is_judged_as_the_loop_judges_it(
    case: str, chosen: str
) -> None:
    decision = {"chosen_runner_id": chosen, "candidates": copy.deepcopy(HOME_DECISIONS[case])}
    fast = _outcome(lambda audit, home, d: audit._check_home_decision(home, d), decision)
    assert fast == _outcome(_home_check_the_long_way, decision)
