"""SharedRounds: concurrent callers share one run that began after each of them asked."""

from __future__ import annotations

import threading

import pytest

from secondbox_scheduler.projections.shared_rounds import SharedRounds

WAIT = 10.0  # s: a bound on a failing test, never a synchronisation


def test_callers_that_arrive_during_a_run_share_the_next_one() -> None:
    rounds = SharedRounds()
    release = threading.Event()
    runs: list[int] = []

    def work() -> None:
        runs.append(len(runs) + 1)
        if len(runs) == 1:  # the first run holds until the others wait
            assert release.wait(WAIT)

    first = threading.Thread(target=rounds.run, args=(work,))
    first.start()
    others = [threading.Thread(target=rounds.run, args=(work,)) for _ in range(8)]
    for thread in others:
        thread.start()
    assert rounds.wait_for_waiting(8, WAIT)  # all eight wait for the run after the first
    release.set()
    for thread in [first, *others]:
        thread.join(WAIT)
        assert not thread.is_alive()
    assert runs == [1, 2]  # one run for the first caller, one shared by the eight


def test_a_run_that_began_before_a_call_does_not_answer_it() -> None:
    rounds = SharedRounds()
    inside = threading.Event()
    release = threading.Event()
    seen: list[str] = []

    def slow() -> None:
        seen.append("slow")
        inside.set()
        assert release.wait(WAIT)

    first = threading.Thread(target=rounds.run, args=(slow,))
    first.start()
    assert inside.wait(WAIT)
    late = threading.Thread(target=rounds.run, args=(lambda: seen.append("late"),))
    late.start()
    assert rounds.wait_for_waiting(1, WAIT)
    release.set()
    for thread in (first, late):
        thread.join(WAIT)
    assert seen == ["slow", "late"]  # the late caller got a run of its own, after


def test_a_failed_run_raises_to_its_caller_and_the_waiters_run_again() -> None:
    rounds = SharedRounds()
    inside = threading.Event()
    release = threading.Event()
    calls: list[str] = []

    def failing() -> None:
        calls.append("failing")
        inside.set()
        assert release.wait(WAIT)
        raise RuntimeError("the store is down")

    errors: list[BaseException] = []

    def first_caller() -> None:
        try:
            rounds.run(failing)
        except RuntimeError as error:
            errors.append(error)

    first = threading.Thread(target=first_caller)
    first.start()
    assert inside.wait(WAIT)
    waiter = threading.Thread(target=rounds.run, args=(lambda: calls.append("retry"),))
    waiter.start()
    assert rounds.wait_for_waiting(1, WAIT)
    release.set()
    for thread in (first, waiter):
        thread.join(WAIT)
        assert not thread.is_alive()
    assert [str(error) for error in errors] == ["the store is down"]
    assert calls == ["failing", "retry"]
    with pytest.raises(ZeroDivisionError):  # and a later caller still runs its own
        rounds.run(lambda: 1 / 0)
