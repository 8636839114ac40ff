"""Placement evidence read back from records (domain/placement/evidence.py): what an event written
by any release says, decoded with the defaults the docs promise (docs/events.md 7)."""

from __future__ import annotations

from datetime import timedelta

from secondbox_scheduler.domain.placement.evidence import (
    CAPACITY,
    EGRESS,
    RuleFailure,
    RunnerEvaluation,
    Unlisted,
    bounded_evidence,
    rank_key_from_record,
    rank_record,
    reason_label,
)
from secondbox_scheduler.domain.placement.rules import PlacementDecision, decide
from tests.aggregates import T0, TIMEOUT, new_lease, new_runner, requirements, slots


def test_a_rank_record_reads_back_as_the_ranking_key_with_missing_amounts_zero() -> None:
    assert rank_key_from_record("r1", rank_record((-1, -2, -3, -4, "r1"))) == (-1, -2, -3, -4, "r1")
    assert rank_key_from_record("r2", {"free_instances": 2}) == (0, -2, 0, 0, "r2")
    assert rank_key_from_record("r3", None) == (0, 0, 0, 0, "r3")
    assert rank_key_from_record("r4", {}) == (0, 0, 0, 0, "r4")


def test_a_rule_failure_without_a_shortfall_reads_back_with_none() -> None:
    failure = RuleFailure.from_record({"code": EGRESS, "detail": "no"})
    assert failure == RuleFailure(EGRESS, "no", {})
    assert failure.to_record() == {"code": EGRESS, "detail": "no"}
    short = RuleFailure(CAPACITY, "short", {"instances": 1})
    assert RuleFailure.from_record(short.to_record()) == short


def test_an_evaluation_reads_back_from_its_record() -> None:
    evaluation = RunnerEvaluation("r1", (RuleFailure(EGRESS, "no"),))
    assert RunnerEvaluation.from_record(evaluation.to_record()) == evaluation
    assert evaluation.failed_only_egress
    assert not evaluation.compatible


def test_unlisted_counts_read_back_with_missing_counts_zero() -> None:
    full = Unlisted(refused=3, compatible=2, not_evaluated=1, reasons={"capacity:instances": 3})
    assert Unlisted.from_record(full.to_record()) == full
    assert Unlisted.from_record({"refused": 4}) == Unlisted(refused=4)
    assert Unlisted.from_record({"compatible": 5}) == Unlisted(compatible=5)
    assert Unlisted.from_record({"not_evaluated": 6}) == Unlisted(not_evaluated=6)
    assert Unlisted.from_record({"reasons": {"draining": 2}}) == Unlisted(reasons={"draining": 2})
    assert Unlisted.from_record(None) == Unlisted()
    assert Unlisted.from_record({}) == Unlisted()
    assert not Unlisted()
    assert Unlisted(not_evaluated=1)


def test_capacity_reason_labels_name_the_dimension() -> None:
    assert reason_label("capacity:memory_bytes") == "insufficient memory_bytes"
    assert reason_label("draining") == "draining"


def test_a_decision_summarises_its_refusals() -> None:
    runner, lease = new_runner("r1", allocatable=slots(0)), new_lease("r1")
    decision = decide(requirements(), [runner.snapshot(lease)], T0, TIMEOUT)
    assert isinstance(decision, PlacementDecision)
    assert decision.chosen is None
    assert decision.compatible_count == 0
    assert decision.summary().startswith("0/1 runners are available: 1 insufficient ")
    fits = new_runner("r2", allocatable=slots(1))
    later = decide(requirements(), [fits.snapshot(new_lease("r2"))], T0, timedelta(seconds=30))
    assert later.summary() == "1/1 runners are available"


def test_unlisted_counts_merge_by_adding_each_count() -> None:
    one = Unlisted(refused=1, compatible=2, not_evaluated=3, reasons={"draining": 1})
    two = Unlisted(
        refused=10, compatible=20, not_evaluated=30, reasons={"draining": 2, "egress": 1}
    )
    assert one.merged(two) == Unlisted(
        refused=11, compatible=22, not_evaluated=33, reasons={"draining": 3, "egress": 1}
    )


def test_bounded_evidence_keeps_the_chosen_runner_and_eight_per_combination() -> None:
    compatible = [RunnerEvaluation(f"r{n:02d}", ()) for n in range(10)]
    draining = [RunnerEvaluation(f"d{n:02d}", (RuleFailure("draining", ""),)) for n in range(9)]
    egress = [RunnerEvaluation("e00", (RuleFailure(EGRESS, ""),))]
    kept, elided = bounded_evidence([*compatible, *draining, *egress], "r09")
    assert kept == [*range(8), 9, *range(10, 18), 19]
    assert elided == Unlisted(refused=1, compatible=1, reasons={"draining": 1})


def test_a_decisions_summary_counts_the_unlisted_runners() -> None:
    decision = PlacementDecision(None, (RunnerEvaluation("r1", ()),), Unlisted(refused=2,
                                 reasons={"draining": 2}))  # fmt: skip
    assert decision.summary() == "1/3 runners are available: 2 draining"
