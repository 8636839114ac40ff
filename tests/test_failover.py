"""Failover on real clusters: a primary and its standby from the local binaries.

The application names both hosts in one URL (``target_session_attrs=read-write``). When
the primary is lost (SIGKILL to every one of its processes) it waits a bounded time for
a writable server and then fails with ``CellUnavailableError`` naming the cell; once the
standby is promoted (``pg_ctl promote``) the same application places again, without a
restart. With asynchronous replication a placement acknowledged by the lost primary can
be missing from the promoted standby: then its fencing token is refused by every
command that takes one, and ``audit verify --checkpoint`` against a checkpoint kept
before the loss reports the log truncated.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain.errors import (
    AssignmentNotFoundError,
    SchedulerError,
    StaleFenceError,
)
from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.domain.values import ScheduleRequest
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import checkpoint, verify
from secondbox_scheduler.infrastructure.exit_codes import EXIT_VIOLATION
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError
from secondbox_scheduler.infrastructure.store.reconnect import (
    BACKOFF_BASE_SECONDS,
    BACKOFF_CAP_SECONDS,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.clusters import (
    LocalCluster,
    clusters_directory,
    multi_host_url,
    primary,
    standby_of,
    wait_for_replay,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.config import FaultRunConfig
from secondbox_scheduler.infrastructure.tools.fault_injection.fleet import (
    HEARTBEAT_TIMEOUT,
    requirements,
    setup_fleet,
)

pytestmark = pytest.mark.postgres
PROOF = {"verified-by": "test"}


@pytest.fixture
def pair() -> Iterator[tuple[LocalCluster, LocalCluster]]:
    """A primary with an asynchronous standby (nothing waits for it), both removed."""
    directory = clusters_directory()
    made: list[LocalCluster] = []
    try:
        made.append(primary(directory, "primary"))
        made[0].sql("CREATE DATABASE cell")
        made.append(standby_of(made[0], directory, "standby"))
        yield made[0], made[1]
    finally:
        for cluster in made:
            cluster.remove()
        shutil.rmtree(directory, ignore_errors=True)


def request(app: SchedulerApplication, sandbox_id: str, token: bytes) -> ScheduleRequest:
    now = app.now()
    return ScheduleRequest(
        assignment_id=f"a-{sandbox_id}-{token.hex()[:8]}", assignment_command_id=f"c-{token.hex()}",
        instance_id=f"i-{sandbox_id}", sandbox_id=sandbox_id, workspace_id=f"ws-{sandbox_id}",
        start_mutation_id=f"s-{token.hex()}", profile_revision_id="verify-profile",
        requirements=requirements("verify"), fencing_token=token,
        claim_expires_at=now + timedelta(minutes=5), operation_deadline=now + timedelta(minutes=5),
        retry_limit=2, serialization_retry_limit=12, heartbeat_timeout=HEARTBEAT_TIMEOUT,
        now=now, effect_started_at=now, plan_ready_at=now,
    )  # fmt: skip


def open_cell(url: str) -> SchedulerApplication:
    return SchedulerApplication(
        env={
            "SECONDBOX_DATABASE_URL": url,
            "SECONDBOX_CELL": "a",
            "SECONDBOX_BATCHING": "off",
            "SECONDBOX_RECONNECT_SECONDS": "2",
        }
    )


def test_lost_assignment_token_refused_after_failover_and_checkpoint_reports_truncation(
    pair: tuple[LocalCluster, LocalCluster],
) -> None:
    old, standby = pair
    url = multi_host_url([old, standby], "cell")
    app = open_cell(url)
    try:
        setup_fleet(app, FaultRunConfig(database_url=url, runners=2, sandboxes=2))
        kept, assignment_kept = "sbx-0000", None
        assignment_kept, _ = app.schedule(request(app, kept, b"k" * 32))
        wait_for_replay(old, standby)
        standby.stop()  # the standby gets nothing more: what follows is only on `old`
        lost_token = b"L" * 32
        lost, created = app.schedule(request(app, "sbx-0001", lost_token))
        assert created  # acknowledged by the primary (asynchronous replication)
        held = checkpoint(app)  # kept elsewhere, before the loss
        assert held is not None

        old.kill()
        with pytest.raises(CellUnavailableError) as refused:
            app.get_runner("runner-00")
        assert refused.value.cell == "a"

        standby.start()
        standby.promote()
        # the same application, no restart: it finds the promoted standby
        assert app.assignments(kept)[-1].id == assignment_kept.id
        assert app.get_assignment("sbx-0001") is None  # the acknowledged placement is gone

        def every_command(token: bytes) -> list[SchedulerError]:
            refusals: list[SchedulerError] = []
            for command in (
                lambda: app.mark_running("sbx-0001", lost.generation, token),
                lambda: app.release("sbx-0001", lost.generation, token, PROOF),
                lambda: app.fail("sbx-0001", lost.generation, token, "transient"),
            ):
                with pytest.raises(SchedulerError) as error:
                    command()
                refusals.append(error.value)
            return refusals

        assert all(isinstance(e, AssignmentNotFoundError) for e in every_command(lost_token))
        # placed again after the failover: a new assignment, the lost token still refused
        again, created = app.schedule(request(app, "sbx-0001", b"N" * 32))
        assert created
        assert again.fencing_token != lost_token
        assert all(isinstance(e, StaleFenceError) for e in every_command(lost_token))
        assert app.get_assignment("sbx-0001") == again

        report = verify(app, measure_raw=False, checkpoint=held)
        rules = {violation.rule for violation in report.violations}
        assert rules & {"chain-truncated", "chain-rewritten"}, report.to_dict()
        assert verify(app, measure_raw=False).ok  # the promoted log itself is sound
    finally:
        app.close()

    # the command line says so too: exit 1, naming the checkpoint's finding
    result = subprocess.run(
        [sys.executable, "-m", "secondbox_scheduler.infrastructure.command_line", "audit",
         "verify", "--database-url", url, "--checkpoint", str(held)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == EXIT_VIOLATION, result.stdout + result.stderr
    assert "chain-" in result.stdout + result.stderr


def test_a_replica_reconnects_after_the_primary_is_replaced(
    pair: tuple[LocalCluster, LocalCluster],
) -> None:
    old, standby = pair
    old.wait_for("standby")  # synchronous: every commit flushed on the standby too
    url = multi_host_url([old, standby], "cell")
    app = open_cell(url)
    try:
        setup_fleet(app, FaultRunConfig(database_url=url, runners=2, sandboxes=3))
        placed, _ = app.schedule(request(app, "sbx-0000", b"a" * 32))
        old.kill()
        with pytest.raises(CellUnavailableError):
            app.schedule(request(app, "sbx-0001", b"b" * 32))
        standby.promote()
        # a retried schedule replays: the synchronous standby has it
        replay, created = app.schedule(request(app, "sbx-0000", b"a" * 32))
        assert (replay, created) == (placed, False)
        fresh, created = app.schedule(request(app, "sbx-0002", b"c" * 32))
        assert created
        assert app.get_assignment("sbx-0002") == fresh
        assert app.reconnect is not None
        assert app.reconnect.reconnects >= 1
    finally:
        app.close()


def test_an_aggregate_read_before_an_async_failover_writes_no_gap_after_it(
    pair: tuple[LocalCluster, LocalCluster],
) -> None:
    """A command that ran across the reconnection can leave an aggregate of the lost
    primary in the cache after the cache was forgotten; its next save must not write
    past the promoted store's last version (a gap), but run again on what it holds."""
    old, standby = pair
    url = multi_host_url([old, standby], "cell")
    app = open_cell(url)
    try:
        setup_fleet(app, FaultRunConfig(database_url=url, runners=2, sandboxes=1))
        token = b"g" * 32
        placed, _ = app.schedule(request(app, "sbx-0000", token))
        wait_for_replay(old, standby)
        standby.stop()
        app.mark_running("sbx-0000", placed.generation, token)  # only on `old`
        stream = sandbox_uuid("sbx-0000")
        ahead: Any = app.repository.get(stream)  # as a command in flight holds it
        old.kill()
        with pytest.raises(CellUnavailableError):
            app.get_runner("runner-00")
        standby.start()
        standby.promote()
        found = app.get_assignment("sbx-0000")  # reconnected: assigned, not running
        assert found is not None
        assert (found.id, found.state) == (placed.id, "assigned")
        cache = app.repository.cache
        assert cache is not None
        cache.put(stream, ahead)  # that command puts it back
        app.release("sbx-0000", placed.generation, token, PROOF)
        versions = [e.originator_version for e in app.recorder.select_events(stream)]
        assert versions == list(range(1, len(versions) + 1))  # no gap
        released = app.get_assignment("sbx-0000")
        assert released is not None
        assert released.state == "released"
        assert verify(app, measure_raw=False).ok
    finally:
        app.close()


class FakeClock:
    """The reconnection's clock and sleep: a sleep moves the clock, and is recorded."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_reconnect_backs_off_within_its_budget_then_answers_cell_unavailable() -> None:
    directory = clusters_directory()
    only = primary(directory, "only")
    try:
        only.sql("CREATE DATABASE cell")
        app = open_cell(multi_host_url([only], "cell"))  # SECONDBOX_RECONNECT_SECONDS=2
        try:
            setup_fleet(app, FaultRunConfig(database_url="", runners=2, sandboxes=1))
            reconnect = app.reconnect
            assert reconnect is not None
            assert reconnect.budget == 2.0
            clock = FakeClock()
            reconnect._clock, reconnect._sleep = clock, clock.sleep
            reconnect._rng = random.Random(5)
            only.kill()
            with pytest.raises(CellUnavailableError) as refused:
                app.get_runner("runner-00")
            assert refused.value.cell == "a"
            assert "no writable server for 2 s" in str(refused.value)
            waits = list(clock.sleeps)
            assert len(waits) > 3  # it tried again, several times
            for attempt, wait in enumerate(waits):  # full jitter under a doubling ceiling
                ceiling = min(BACKOFF_BASE_SECONDS * 2**attempt, BACKOFF_CAP_SECONDS)
                assert 0.0 <= wait <= ceiling
            assert sum(waits) == pytest.approx(reconnect.budget)  # bounded: the budget
            # given up: a later call tries one connection and answers at once
            clock.now += 1.0
            with pytest.raises(CellUnavailableError):
                app.get_runner("runner-00")
            assert clock.sleeps == waits
            assert reconnect._last_probe == clock.now
            only.start()  # the server is back: the next call reconnects
            clock.now += 1.0
            assert app.get_runner("runner-00").id == "runner-00"
            assert reconnect.reconnects == 1
        finally:
            app.close()
    finally:
        only.remove()
        shutil.rmtree(directory, ignore_errors=True)
