"""The errors of ``secondbox-scheduler bench``: the run cannot go ahead as configured (a
usage error, exit 2), or a worker failed (exit 70: docs/spec.md (section 8.4))."""

from __future__ import annotations


class BenchError(RuntimeError):
    """The benchmark cannot run as configured (``exit_code``: the CLI's exit code)."""

    exit_code = 2


class BenchWorkerError(BenchError):
    """A worker process died, failed or did not finish."""

    exit_code = 70
