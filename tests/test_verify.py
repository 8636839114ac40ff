"""A CI-sized run of `secondbox-scheduler verify`: concurrent replicas with kills, on PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from secondbox_scheduler.infrastructure.verify import VerifyConfig, run_verify


@pytest.mark.slow
def test_concurrent_replicas_with_kills_keep_every_promise(
    postgres_server: Any, tmp_path: Path
) -> None:
    config = VerifyConfig(
        database_url=postgres_server.url(),
        workers=3,
        duration=12.0,
        runners=4,
        sandboxes=60,
        kill_workers=3,
        directory=tmp_path,
    )
    report = run_verify(config)
    assert report.ok, report.violations
    assert report.kills == 3
    assert report.acknowledged_schedules > 0
    assert report.operations["release"] > 0
    assert report.events > 0
