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
from typing import Any

import pytest

PROBE = textwrap.dedent(
    """
    import json, sys
    from secondbox_scheduler import SchedulerApplication
    env = json.loads(sys.argv[1])
    print("ready", flush=True)  # imported: wait for the others (a barrier, not a clock)
    sys.stdin.readline()
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
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, env, "-", f"r{round_}-{index}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(6)
    ]
    # every process imports first (however long a loaded machine takes: it was a start
    # time 2 s ahead, which slow imports could miss, and the replicas then started one
    # after another), then all construct at once
    for process in processes:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n", process.stderr
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    results = [process.communicate(timeout=120) for process in processes]
    failures = [failure for out, _ in results for failure in json.loads(out or '["no output"]')]
    assert failures == [], [err for _, err in results]
