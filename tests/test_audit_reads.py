"""Every read command answers a document, for every sandbox and runner of a history.

A small simulated history (refusals, a drain and its cancellation, a runner gone silent,
failures, uncertain assignments, manual releases, generation advances) with the corner
events of the release 0.1 fixture on top (a refused creation, a refused schedule, a
terminal failure, a reconcile claim, a deregistered runner, snapshots), written once per
store. Then each read of the command line (``audit state``, ``audit timeline``, ``audit
explain``, ``assignments``, ``runners``) and each GET route of the HTTP API is asked
about every sandbox and every runner: each answer is a valid document (JSON that
parses, exit code 0; HTTP 200 or a typed 404), never an internal error. ``audit verify
--until`` a time answers exactly what the position cut it stands for answers.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest
from typer.testing import CliRunner

from secondbox_scheduler.domain.assignment import STATES
from secondbox_scheduler.domain.ids import refusal_log_uuid, runner_uuid, sandbox_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.log_fold import log_events
from secondbox_scheduler.infrastructure.audit.signed_notes import Signer
from secondbox_scheduler.infrastructure.cli import audit as audit_commands
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.cli import inspection as inspection_commands
from secondbox_scheduler.infrastructure.cli.common import open_store
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.tools.simulation import SimulationConfig, run_simulation
from tests.fixtures.make_history_0_1 import LATER, Clock, corner_events
from tests.http_helpers import api_client
from tests.postgres_server import PostgresServer

RUNNER = CliRunner()
RATES = {
    "seconds",
    "events_per_second",
    "raw_read_seconds",
    "raw_read_events_per_second",
    "ratio_to_raw_read",
}
# events followed, in the same transaction, by another (docs/audit.md, invariant-2)
TRANSACTIONS = ("Sandbox.AssignmentFenced", "Runner.CapacityReserved", "Sandbox.AssignmentReleased")
DOCUMENTED_CUT = datetime(2026, 1, 5, 9, 5, tzinfo=UTC)  # docs/audit.md's example
NOT_FOUND = {"sandbox_not_found", "runner_not_found", "assignment_not_found"}


@dataclass
class History:
    """A store with a history, and what the log says is in it."""

    kind: str
    url: str
    sandboxes: list[str] = field(default_factory=list)
    runners: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    generations: dict[str, int] = field(default_factory=dict)  # highest seen
    refused_schedules: list[str] = field(default_factory=list)
    never_created: list[str] = field(default_factory=list)  # refusals only
    deregistered: list[str] = field(default_factory=list)
    inside: dict[str, int] = field(default_factory=dict)  # a position inside a transaction
    stamps: list[tuple[int, datetime]] = field(default_factory=list)  # log order
    kinds: set[str] = field(default_factory=set)  # the event classes in the log
    # the store opened once for the commands, as they open it: with and without read models
    opened: dict[bool, SchedulerApplication] = field(default_factory=dict)

    def open(self) -> SchedulerApplication:
        return SchedulerApplication(env={"SECONDBOX_DATABASE_URL": self.url})

    def position_of(self, moment: datetime) -> int:
        """The position a cut at ``moment`` stops at: the last event before the first
        event stamped later than it (docs/audit.md)."""
        last = 0
        for position, stamp in self.stamps:
            if stamp > moment:
                return last
            last = position
        return last


def _read_history(history: History, app: SchedulerApplication) -> None:
    owners: dict[Any, str] = {}  # a sandbox's stream and its refusal log: the sandbox
    sandboxes: set[str] = set()
    runners: set[str] = set()
    pools: set[str] = set()
    refused: set[str] = set()
    created: set[str] = set()
    gone: set[str] = set()
    for position, event in log_events(app, None):
        history.stamps.append((position, event.timestamp))
        name = type(event).__qualname__
        history.kinds.add(name)
        generation = None
        if name in TRANSACTIONS:  # the first of each: its transaction goes on past it
            history.inside.setdefault(name, position)
        if name in ("Sandbox.Created", "RefusalLog.Opened"):
            sandboxes.add(event.sandbox_id)
            owners[sandbox_uuid(event.sandbox_id)] = event.sandbox_id
            owners[refusal_log_uuid(event.sandbox_id)] = event.sandbox_id
            if name == "Sandbox.Created":
                created.add(event.sandbox_id)
        elif name == "Runner.Deregistered":
            gone.add(str(event.originator_id))
        elif name == "Runner.Registered":
            runners.add(event.runner_id)
            pools.add(event.pool_name)
        elif name == "Sandbox.AssignmentFenced":
            generation = event.assignment["generation"]
        elif name in ("Sandbox.GenerationAdvanced", "RefusalLog.Refused"):
            generation = event.generation
            if name == "RefusalLog.Refused" and event.operation == "schedule":
                refused.add(owners[event.originator_id])
        if generation is not None:
            sandbox_id = owners[event.originator_id]
            history.generations[sandbox_id] = max(
                history.generations.get(sandbox_id, 1), generation
            )
    history.sandboxes = sorted(sandboxes)
    history.runners = sorted(runners)
    history.pools = sorted(pools)
    history.refused_schedules = sorted(refused)
    history.never_created = sorted(sandboxes - created)
    history.deregistered = sorted(r for r in runners if str(runner_uuid(r)) in gone)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def history(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[History]:
    schema = None
    server: PostgresServer | None = None
    if request.param == "sqlite":
        url = f"sqlite:///{Path(tmp_path_factory.mktemp('reads')) / 'history.db'}"
    else:
        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        url = server.url(schema)
    found = History(request.param, url)
    try:
        run_simulation(SimulationConfig(database_url=url, runners=6, sandboxes=12, cycles=2))
        clock = Clock(LATER)
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
        try:
            corner_events(app, clock)
            _read_history(found, app)
        finally:
            app.close()
        for read_models in (True, False):
            shared = open_store(url, read_models=read_models)
            found.opened[read_models] = shared
            shared.close = lambda: None  # type: ignore[method-assign]  # the commands close it
        yield found
    finally:
        for shared in found.opened.values():
            SchedulerApplication.close(shared)
        if server is not None and schema is not None:
            with psycopg.connect(server.conninfo(), autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def invoke(
    history: History, *args: str, as_json: bool = True, absent: bool = False, reopen: bool = False
) -> Any:
    """A read command on the history's store: exit code 0, and its JSON parsed. The
    command reads the store the fixture opened for it, as the command opens it (opening
    is what costs, and is tested in test_cli.py); ``reopen``: it opens the store itself.
    ``absent``: the subject may not exist (a sandbox whose creation was refused, a
    deregistered runner), answered as the HTTP API answers a typed 404: exit code 3 and
    one line ``error: ... not found`` (None is returned)."""
    extra = ["--json"] if as_json else []

    def shared(_url: str, *, must_exist: bool = True, read_models: bool = True) -> Any:
        return history.opened[read_models]

    with contextlib.ExitStack() as stack:
        if not reopen:
            for module in (audit_commands, inspection_commands):
                stack.enter_context(mock.patch.object(module, "open_store", shared))
        result = RUNNER.invoke(cli, [*args, "--database-url", history.url, *extra])
    assert "unexpected" not in result.output, (args, result.output)
    if absent and result.exit_code == 3:
        assert result.output.startswith("error:"), (args, result.output)
        assert "not found" in result.output, (args, result.output)
        assert not result.stdout.strip(), (args, result.stdout)
        return None
    assert result.exit_code == 0, (args, result.output, result.exception)
    return json.loads(result.stdout) if as_json else result.stdout


def without_rates(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in RATES}


def test_the_history_holds_what_the_reads_must_survive(history: History) -> None:
    """Refused schedules and creations, drains, failures, uncertain runners, releases,
    generation advances, a deregistered runner, many generations, snapshots."""
    assert {
        "RefusalLog.Refused", "Runner.DrainStarted", "Runner.DrainCancelled",
        "Sandbox.AssignmentFailed", "Sandbox.AssignmentUncertain", "Sandbox.AssignmentReleased",
        "Runner.CapacityReleased", "Sandbox.GenerationAdvanced", "Sandbox.ReconcileClaimed",
        "Sandbox.ReconcileClaimReleased", "Runner.AllocatableChanged", "Runner.Deregistered",
    } <= history.kinds  # fmt: skip
    assert len(history.refused_schedules) >= 2
    assert "corner-refused" in history.never_created  # a creation refused: refusals only
    assert history.deregistered  # the fixture's corner runner that left
    assert "corner-sbx-2" in history.refused_schedules
    assert history.generations["corner-sbx-1"] >= 14
    assert {"corner-a", "corner-b"} <= set(history.runners)


def test_timeline_of_a_sandbox_with_a_refused_schedule(history: History) -> None:
    """Defect: a refused schedule records ``requirements=None``; the timeline's field
    summary subscripted it (TypeError, ``audit timeline`` exit 2, HTTP 500)."""
    for sandbox_id in history.refused_schedules:
        entries = invoke(history, "audit", "timeline", "--sandbox", sandbox_id, reopen=True)
        refusals = [e for e in entries if e["event"] == "RefusalLog.Refused"]
        assert refusals, sandbox_id
        text = invoke(history, "audit", "timeline", "--sandbox", sandbox_id, as_json=False)
        assert "RefusalLog.Refused" in text
    app = history.open()
    try:
        with api_client(app) as client:
            for sandbox_id in history.refused_schedules:
                response = client.get(f"/v1/sandboxes/{sandbox_id}/timeline")
                assert response.status_code == 200, (sandbox_id, response.text)
                assert response.json()["entries"]
    finally:
        app.close()


def _cuts(history: History) -> list[datetime]:
    stamps = [stamp for _, stamp in history.stamps]
    count = len(stamps)
    chosen = [stamps[count * k // 8] for k in range(1, 8)]
    return [
        stamps[0] - timedelta(seconds=1),  # before the first event: nothing
        *chosen,  # at an event's own time (later events of the same time included)
        *(moment + timedelta(seconds=2.5) for moment in chosen[::2]),  # between events
        DOCUMENTED_CUT,
        LATER + timedelta(seconds=30),  # inside the corner events
        stamps[-1] + timedelta(days=1),  # after the last event: everything
    ]


def test_verify_until_a_time_equals_the_position_cut(history: History) -> None:
    """Defect: a cut by time reported every snapshot past the cut as "no event at its
    version" (the snapshot check was told of no cut); a cut by position passed."""
    for moment in _cuts(history):
        position = history.position_of(moment)
        if position == 0:
            continue  # no position cut reads nothing; the time cut is checked below
        reopen = moment == DOCUMENTED_CUT  # once as the command runs alone
        by_time = invoke(history, "audit", "verify", "--until", moment.isoformat(), reopen=reopen)
        by_position = invoke(history, "audit", "verify", "--until", str(position), reopen=reopen)
        assert without_rates(by_time) == without_rates(by_position), moment
        assert by_time["ok"], (moment, by_time["violations"][:3])
        assert by_time["position"] == position, moment
    before = invoke(
        history, "audit", "verify", "--until", _cuts(history)[0].isoformat()
    )  # nothing read: nothing wrong
    assert before["ok"]
    assert before["events_checked"] == 0
    for position in (1, len(history.stamps) // 3, len(history.stamps)):
        report = invoke(history, "audit", "verify", "--until", str(position))
        assert report["ok"], report["violations"][:3]
        assert report["position"] == position


def test_verify_until_a_position_inside_a_transaction(history: History) -> None:
    """Found by the test above: a cut by position between an assignment's fence and its
    reservation (or a release and its capacity's) reported that transaction unpaired
    ("no matching CapacityReserved before the end of the log") on a clean log."""
    assert set(history.inside) == set(TRANSACTIONS)
    for name, position in sorted(history.inside.items()):
        report = invoke(history, "audit", "verify", "--until", str(position))
        assert report["ok"], (name, report["violations"])
        assert report["position"] == position


def test_state_at_a_time_equals_the_position_cut(history: History) -> None:
    for moment in _cuts(history)[1::3]:
        position = history.position_of(moment)
        by_time = invoke(history, "audit", "state", "--at", moment.isoformat())
        assert by_time == invoke(history, "audit", "state", "--at", str(position)), moment
        assert by_time["position"] == position
        invoke(history, "audit", "state", "--at", str(position), as_json=False)


def test_every_cli_read_answers_for_every_sandbox_and_runner(history: History) -> None:
    runners = invoke(history, "runners")
    assert runners
    assert {r["id"] for r in runners} <= set(history.runners)
    invoke(history, "runners", as_json=False)
    for pool in history.pools:
        assert {r["pool_name"] for r in invoke(history, "runners", "--pool", pool)} <= {pool}
    for sandbox_id in history.sandboxes:
        timeline = invoke(history, "audit", "timeline", "--sandbox", sandbox_id)
        assert timeline, sandbox_id
        invoke(history, "audit", "timeline", "--sandbox", sandbox_id, as_json=False)
        explanation = invoke(history, "audit", "explain", "--sandbox", sandbox_id)
        assert explanation["sandbox_id"] == sandbox_id
        assert explanation["decisions"], sandbox_id
        invoke(history, "audit", "explain", "--sandbox", sandbox_id, as_json=False)
        last = history.generations.get(sandbox_id, 1)
        for generation in sorted({1, last}):
            invoke(
                history, "audit", "explain", "--sandbox", sandbox_id,
                "--generation", str(generation),
            )  # fmt: skip
        found = invoke(history, "assignments", "--sandbox", sandbox_id, absent=True)
        assert found is None or isinstance(found, list)
        assert (found is None) == (sandbox_id in history.never_created)
        invoke(history, "assignments", "--sandbox", sandbox_id, as_json=False, absent=True)
    for runner_id in history.runners:
        assert invoke(history, "audit", "timeline", "--runner", runner_id), runner_id
        invoke(history, "audit", "timeline", "--runner", runner_id, as_json=False)
        found = invoke(history, "assignments", "--runner", runner_id, absent=True)
        assert found is None or isinstance(found, list)
        assert (found is None) == (runner_id in history.deregistered)
        invoke(history, "assignments", "--runner", runner_id, as_json=False, absent=True)


def test_every_http_read_answers_for_every_sandbox_and_runner(history: History) -> None:
    app = history.open()
    try:
        # every GET route the service documents (its OpenAPI paths): a new read route
        # fails this test until it is asked below
        paths = create_app(app).openapi()["paths"]
        reads = {path for path, operations in paths.items() if "get" in operations}
        urls: dict[str, list[str]] = {path: [] for path in reads}

        def add(path: str, url: str) -> None:
            assert path in urls, f"{path} is not a GET route: update this test"
            urls[path].append(url)

        add("/healthz", "/healthz")
        add("/readyz", "/readyz")
        add("/metrics", "/metrics")
        add("/v1/tokens", "/v1/tokens")  # none issued: the service is open, the list empty
        add("/v1/runners", "/v1/runners")
        for pool in history.pools:
            add("/v1/runners", f"/v1/runners?pool_name={pool}")
        for runner_id in history.runners:
            add("/v1/runners/{runner_id}", f"/v1/runners/{runner_id}")
            add("/v1/runners/{runner_id}/assignments", f"/v1/runners/{runner_id}/assignments")
            add("/v1/runners/{runner_id}/timeline", f"/v1/runners/{runner_id}/timeline")
        for sandbox_id in history.sandboxes:
            base = f"/v1/sandboxes/{sandbox_id}"
            add("/v1/sandboxes/{sandbox_id}", base)
            add("/v1/sandboxes/{sandbox_id}/assignment", f"{base}/assignment")
            add("/v1/sandboxes/{sandbox_id}/assignments", f"{base}/assignments")
            add("/v1/sandboxes/{sandbox_id}/explain", f"{base}/explain")
            add("/v1/sandboxes/{sandbox_id}/timeline", f"{base}/timeline")
            last = history.generations.get(sandbox_id, 1)
            for generation in sorted({1, last}):
                add(
                    "/v1/sandboxes/{sandbox_id}/assignment",
                    f"{base}/assignment?generation={generation}",
                )
                add("/v1/sandboxes/{sandbox_id}/explain", f"{base}/explain?generation={generation}")
        # the log as a Merkle tree: the signed checkpoint, proofs at the ends and middle
        app.env["SECONDBOX_CHECKPOINT_KEY"] = str(Signer.generate("audit-reads"))
        size = app.head_position()
        add("/v1/audit/checkpoint", "/v1/audit/checkpoint")
        for position in sorted({1, size // 2 or 1, size}):
            add("/v1/audit/proofs/inclusion", f"/v1/audit/proofs/inclusion?position={position}")
            add(
                "/v1/audit/proofs/inclusion",
                f"/v1/audit/proofs/inclusion?position={position}&size={size}",
            )
            add("/v1/audit/proofs/consistency", f"/v1/audit/proofs/consistency?from={position}")
        add("/v1/audit/proofs/consistency", f"/v1/audit/proofs/consistency?from=0&to={size}")
        # the lists and the event feed (docs/api.md), every page of a history this small
        add("/v1/sandboxes", "/v1/sandboxes?limit=1000")
        add("/v1/assignments", "/v1/assignments?limit=1000")
        for state in STATES:
            add("/v1/assignments", f"/v1/assignments?state={state}")
        for pool in history.pools:
            add("/v1/sandboxes", f"/v1/sandboxes?pool_name={pool}")
            add("/v1/runners", f"/v1/runners?pool_name={pool}&drain_phase=draining")
            add("/v1/events", f"/v1/events?pool_name={pool}")
        add("/v1/events", "/v1/events?limit=1000")
        add("/v1/events/stream", "/v1/events/stream?timeout=0")
        for sandbox_id in history.sandboxes:
            add("/v1/events", f"/v1/events?sandbox_id={sandbox_id}")
            add("/v1/assignments", f"/v1/assignments?sandbox_id={sandbox_id}")
        for runner_id in history.runners:
            add("/v1/events", f"/v1/events?runner_id={runner_id}")
        uncovered = sorted(path for path, asked in urls.items() if not asked)
        assert not uncovered, f"GET routes this test does not ask: {uncovered}"
        with api_client(app) as client:
            for path, asked in sorted(urls.items()):
                for url in asked:
                    response = client.get(url)
                    if path in ("/metrics", "/v1/events/stream"):
                        assert response.status_code == 200, (url, response.text)
                        continue
                    body = response.json()  # a document, whatever the status
                    if response.status_code == 404:
                        code = body["code"]
                        assert code in NOT_FOUND, (url, body)
                        subject = url.split("?")[0].split("/")[3]
                        if code != "assignment_not_found":  # the subject itself is gone
                            gone = history.never_created + history.deregistered
                            assert subject in gone, (url, body)
                    else:
                        assert response.status_code == 200, (url, response.text)
    finally:
        app.close()
