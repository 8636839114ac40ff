"""Bounds and types on every input (docs/operations.md, "Limits").

Each value past a documented limit, or of a kind no store can hold, is refused with an
``InvalidRequestError`` that names the field and the rule, and nothing is written:
on both stores, through the API; and the command line answers any input with one line
and its exit code (2 a usage error, 3 refused by a rule), never a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secondbox_scheduler.domain import InvalidRequestError
from secondbox_scheduler.domain.limits import (
    MAX_FENCING_TOKEN_BYTES,
    MAX_ITEMS,
    MAX_NAME_LENGTH,
    MAX_PROOF_ENTRIES,
)
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock
from tests.factories import (
    RUNTIME,
    create_sandbox,
    materialization,
    register,
    requirements,
    schedule_request,
    token,
)

LONG = "x" * (MAX_NAME_LENGTH + 1)
SURROGATE = "runner-\ud800"
ESCAPE = "runner-\x1b[31m"


@pytest.fixture
def placed(app: SchedulerApplication, clock: Clock) -> tuple[SchedulerApplication, bytes]:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    fence = token()
    app.schedule(schedule_request("s1", clock(), fencing_token=fence))
    return app, fence


def cases(app: SchedulerApplication, clock: Clock, fence: bytes) -> dict[str, Callable[[], Any]]:
    """Each case: (field the refusal must name, the call)."""

    def register_runner(**overrides: Any) -> Callable[[], Any]:
        fields: dict[str, Any] = {
            "runner_id": "r9", "pool_name": "pool-a", "backend_kind": "firecracker",
            "architecture": "x86_64", "capabilities": ["compute"],
            "allocatable": {"instances": 1}, "guest_protocol_minimum": 1,
            "guest_protocol_maximum": 1, **overrides,
        }  # fmt: skip
        return lambda: app.register_runner(**fields)

    def create(**overrides: Any) -> Callable[[], Any]:
        fields: dict[str, Any] = {
            "sandbox_id": "s9", "workspace_id": "w", "profile_revision_id": "p",
            "requirements": requirements(), "heartbeat_timeout": timedelta(seconds=30),
            **overrides,
        }  # fmt: skip
        return lambda: app.create_sandbox(**fields)

    now = clock()
    return {
        "runner_id|long id": register_runner(runner_id=LONG),
        "runner_id|lone surrogate": register_runner(runner_id=SURROGATE),
        "runner_id|control characters": register_runner(runner_id=ESCAPE),
        "capabilities|too many": register_runner(
            capabilities=[f"c{i}" for i in range(MAX_ITEMS + 1)]
        ),
        "supported_egress_contexts|too many": register_runner(
            supported_egress_contexts=[f"e{i}" for i in range(MAX_ITEMS + 1)]
        ),
        "sandbox_id|long id": create(sandbox_id="s" * (MAX_NAME_LENGTH + 1)),
        "heartbeat_timeout|timedelta.max": create(heartbeat_timeout=timedelta.max),
        "heartbeat_timeout|over a day": create(heartbeat_timeout=timedelta(days=2)),
        "artifact_digests|too many": lambda: app.record_heartbeat(
            runner_id="r1", at=now, artifact_digests=[f"sha256:{i}" for i in range(10_000)]
        ),
        "materializations|too many": lambda: app.record_heartbeat(
            runner_id="r1",
            at=now,
            artifact_digests=[RUNTIME],
            materializations=[materialization()] * (MAX_ITEMS + 1),
        ),
        "artifact_digests|long digest": lambda: app.record_heartbeat(
            runner_id="r1", at=now, artifact_digests=["sha256:" + "f" * 1_000_000]
        ),
        "fencing_token|1 MB token": lambda: app.schedule(
            schedule_request("s1", now, fencing_token=b"\x01" * (MAX_FENCING_TOKEN_BYTES + 1))
        ),
        "assignment_id|1 MB id": lambda: app.schedule(
            schedule_request("s1", now, assignment_id="a" * 1_000_000)
        ),
        "resolved_artifacts|too many": lambda: app.schedule(
            schedule_request("s1", now, resolved_artifacts={f"k{i}": "v" for i in range(65)})
        ),
        "claim_expires_at|a year ahead": lambda: app.schedule(
            schedule_request("s1", now, claim_expires_at=now + timedelta(days=365))
        ),
        "serialization_retry_limit|huge": lambda: app.schedule(
            schedule_request("s1", now, serialization_retry_limit=10**9)
        ),
        "release_proof key|empty key": lambda: app.release("s1", 1, fence, {"": ""}),
        "release_proof|too many entries": lambda: app.release(
            "s1", 1, fence, {f"k{i}": "v" for i in range(MAX_PROOF_ENTRIES + 1)}
        ),
        "release_proof['log']|too long": lambda: app.release(
            "s1", 1, fence, {"log": "x" * 1_000_000}
        ),
        "until|datetime.max": lambda: app.claim_reconcile(
            "s1", 1, "owner", datetime.max.replace(tzinfo=UTC)
        ),
        "until|two hours": lambda: app.claim_reconcile("s1", 1, "owner", now + timedelta(hours=2)),
        "owner|control characters": lambda: app.claim_reconcile(
            "s1", 1, "owner\x07", now + timedelta(minutes=1)
        ),
        "pool_name|lone surrogate": lambda: app.runner_snapshots("\udcff"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "runner_id|long id", "runner_id|lone surrogate", "runner_id|control characters",
        "capabilities|too many", "supported_egress_contexts|too many", "sandbox_id|long id",
        "heartbeat_timeout|timedelta.max", "heartbeat_timeout|over a day",
        "artifact_digests|too many", "materializations|too many", "artifact_digests|long digest",
        "fencing_token|1 MB token", "assignment_id|1 MB id", "resolved_artifacts|too many",
        "claim_expires_at|a year ahead", "serialization_retry_limit|huge",
        "release_proof key|empty key", "release_proof|too many entries",
        "release_proof['log']|too long", "until|datetime.max", "until|two hours",
        "owner|control characters", "pool_name|lone surrogate",
    ],
)  # fmt: skip
def test_each_limit_is_a_typed_refusal_that_writes_nothing(
    placed: tuple[SchedulerApplication, bytes], clock: Clock, case: str
) -> None:
    app, fence = placed
    field = case.split("|")[0]
    call = cases(app, clock, fence)[case]
    before = app.event_count()
    with pytest.raises(InvalidRequestError) as refused:
        call()
    assert refused.value.field.startswith(field), str(refused.value)
    assert refused.value.rule
    assert app.event_count() == before


ODD_TEXT = st.one_of(
    st.text(min_size=MAX_NAME_LENGTH + 1, max_size=MAX_NAME_LENGTH + 50),
    st.text(min_size=1, max_size=10).map(lambda s: s + "\ud800"),
    st.sampled_from(["\x1b[2J", "a\nb", "\x7f", "\x9b31m", "tab\there"]),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=ODD_TEXT, target=st.sampled_from(["runner", "sandbox", "workspace", "owner",
                                                "instance", "pool", "digest"]))  # fmt: skip
def test_odd_text_anywhere_is_refused_by_name(
    placed: tuple[SchedulerApplication, bytes], clock: Clock, value: str, target: str
) -> None:
    app, _ = placed
    now = clock()
    calls: dict[str, Callable[[], Any]] = {
        "runner": lambda: app.start_drain(value),
        "sandbox": lambda: app.advance_generation(value, 1),
        "workspace": lambda: app.schedule(schedule_request("s1", now, workspace_id=value)),
        "owner": lambda: app.claim_reconcile("s1", 1, value, now + timedelta(minutes=1)),
        "instance": lambda: app.schedule(schedule_request("s1", now, instance_id=value)),
        "pool": lambda: app.create_sandbox(
            sandbox_id="s9", workspace_id="w", profile_revision_id="p",
            requirements={"pool_name": value, "architecture": "x86_64",
                          "guest_protocol_generation": 2},
            heartbeat_timeout=timedelta(seconds=30),
        ),
        "digest": lambda: app.record_heartbeat(runner_id="r1", at=now, artifact_digests=[value]),
    }  # fmt: skip
    before = app.event_count()
    with pytest.raises(InvalidRequestError) as refused:
        calls[target]()
    assert refused.value.field
    assert app.event_count() == before


# (the arguments, the exit code: 2 a usage error, 3 refused by a rule)
@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["audit", "state", "--at", "99999999999999999999999"], 2),
        (["audit", "state", "--at", "not-a-time\x1b[2J"], 2),
        (["runners", "--pool", "\x1b[31mred"], 2),
        (["assignments", "--sandbox", "x" * 5000], 2),
        (["audit", "explain", "--sandbox", b"s\xff"], 2),  # not UTF-8: a lone surrogate
        (["release", "--sandbox", "s1", "--generation", "1", "--token", "zz", "--proof", "a=b"],
         2),
        # no sandbox s1: refused before the generation matters
        (["release", "--sandbox", "s1", "--generation", "99999999999999999999", "--token",
          "00" * 32, "--proof", "a=b"], 3),
    ],
)  # fmt: skip
def test_the_command_line_answers_hostile_input_in_one_line(
    tmp_path: Path, clock: Clock, args: list[str | bytes], code: int
) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url}, now=clock)
    register(app, "r1", at=clock())
    app.close()
    result = subprocess.run(
        [sys.executable, "-m", "secondbox_scheduler.infrastructure.cli", *args,
         "--database-url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "\x1b[2J" not in result.stderr
    assert "\x1b[31m" not in result.stderr + result.stdout
