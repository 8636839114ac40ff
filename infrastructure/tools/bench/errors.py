"""The error of ``secondbox-scheduler bench``: a worker failed or the run cannot go ahead."""

from __future__ import annotations


class BenchError(RuntimeError):
    """A worker failed or the benchmark cannot run as configured."""
