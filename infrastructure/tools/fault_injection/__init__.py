"""The fault-injection run, ``secondbox-scheduler verify``: scheduler replicas as processes
against one PostgreSQL, some killed mid-way, then every promise checked from the events.

Not to be confused with ``audit verify``
(:mod:`secondbox_scheduler.infrastructure.audit.verify`), the replay of a log.

- :mod:`.config`: what a run is asked to do and what it found;
- :mod:`.database`: the run's own database;
- :mod:`.fleet`: the runners and sandboxes it works on;
- :mod:`.run`: the supervisor (workers started and killed, PostgreSQL restarted);
- :mod:`.worker`: one worker process (``python -m``);
- :mod:`.checks`: the final checks.
"""

from secondbox_scheduler.infrastructure.tools.fault_injection.config import (
    FaultRunConfig,
    FaultRunReport,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.run import run_fault_injection

__all__ = ["FaultRunConfig", "FaultRunReport", "run_fault_injection"]
