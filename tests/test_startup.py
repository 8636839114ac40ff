"""Replicas that start together on a fresh PostgreSQL schema all start.

Creating the tables, types and indexes (the event store's, the snapshot store's and the
read models') is serialized under an advisory lock, so concurrent ``CREATE TABLE IF NOT
EXISTS`` / ``CREATE TYPE`` statements of several replicas never collide ("tuple
concurrently updated").
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

PROBE = textwrap.dedent(
    """
    import json, sys, time
    from secondbox_scheduler import SchedulerApplication
    env, start = json.loads(sys.argv[1]), float(sys.argv[2])
    time.sleep(max(0.0, start - time.time()))
    failures = []
    app = None
    try:
        app = SchedulerApplication(env=env)
        app.register_runner(
            runner_id=sys.argv[3], pool_name="p", backend_kind="firecracker",
            architecture="x86_64", capabilities=["compute"], allocatable={"vcpu_count": 1},
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )
        app.runner_snapshots()  # the read models' tables too
    except Exception as error:
        failures.append(f"{type(error).__name__}: {error}")
    finally:
        if app is not None:
            app.close()
    print(json.dumps(failures))
    """
)


@pytest.mark.postgres
@pytest.mark.parametrize("round_", range(3))
def test_replicas_started_at_the_same_moment_on_a_fresh_schema_all_start(
    postgres_schema: Any, round_: int
) -> None:
    env = json.dumps(postgres_schema.env())
    start = time.time() + 2.0  # every process imports first, then all construct at once
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, env, str(start), f"r{round_}-{index}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(6)
    ]
    results = [process.communicate(timeout=120) for process in processes]
    failures = [failure for out, _ in results for failure in json.loads(out or '["no output"]')]
    assert failures == [], [err for _, err in results]
