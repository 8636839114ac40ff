"""The garbage collector's young-generation threshold in the scheduler's processes
(infrastructure/gc_tuning.py): set from SECONDBOX_GC_THRESHOLD, a bad value refused
naming the setting and its rule, and never set by the application itself."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from secondbox_scheduler.domain import InvalidRequestError
from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.gc_tuning import (
    DEFAULT_YOUNG_THRESHOLD,
    GC_THRESHOLD,
    tune_gc,
)


@pytest.fixture(autouse=True)
def kept_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_the_default_raises_only_the_young_threshold() -> None:
    assert tune_gc({}) == DEFAULT_YOUNG_THRESHOLD
    assert gc.get_threshold() == (DEFAULT_YOUNG_THRESHOLD, 10, 10)


def test_a_threshold_is_set_and_off_leaves_python_s() -> None:
    assert tune_gc({GC_THRESHOLD: "5000"}) == 5000
    assert gc.get_threshold()[0] == 5000
    gc.set_threshold(700, 10, 10)
    assert tune_gc({GC_THRESHOLD: "off"}) is None
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("value", ["0", "699", "1000001", "lots", "1e4", "-5"])
def test_bad_thresholds_are_refused_naming_the_setting(value: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        tune_gc({GC_THRESHOLD: value})
    assert refused.value.field == GC_THRESHOLD
    assert "700" in str(refused.value)
    assert gc.get_threshold() == (700, 10, 10)  # nothing changed


def test_the_application_leaves_the_process_alone() -> None:
    """An embedder's process is theirs to tune."""
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": "sqlite:///:memory:"})
    try:
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        app.close()


def test_the_command_line_tunes_its_process_and_refuses_a_bad_setting() -> None:
    probe = (
        "import gc, sys; from secondbox_scheduler.infrastructure import cli; "
        "sys.argv = ['secondbox-scheduler', '--help']; "
        "import atexit; atexit.register(lambda: print('threshold', gc.get_threshold()[0])); "
        "cli.main()"
    )
    env = {k: v for k, v in os.environ.items() if k != GC_THRESHOLD}
    tuned = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert f"threshold {DEFAULT_YOUNG_THRESHOLD}" in tuned.stdout
    refused = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, GC_THRESHOLD: "lots"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert GC_THRESHOLD in refused.stderr
    assert "Traceback" not in refused.stderr
