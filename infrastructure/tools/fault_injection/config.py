"""What a fault-injection run is asked to do (:class:`FaultRunConfig`) and what it found
(:class:`FaultRunReport`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES = ("standard", "adversarial")


@dataclass
class FaultRunConfig:
    database_url: str
    workers: int = 4
    duration: float = 30.0
    runners: int = 6
    sandboxes: int = 120
    kill_workers: int = 0
    restart_postgres: bool = False
    seed: int = 7
    # "standard": well-behaved clients on roomy runners; "adversarial": runners tight on
    # all five dimensions and clients that misbehave on purpose (fault_injection/adversary.py)
    profile: str = "standard"
    # placements batched (groups of a worker's sandboxes committed together), as in
    # production; False: one placement per transaction
    batching: bool = True
    keep: bool = False
    # where the workers' journals and logs go; None: a new temporary directory
    log_dir: Path | None = None


@dataclass
class FaultRunReport:
    database: str
    log_dir: Path
    operations: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    faults: int = 0
    kills: int = 0
    restarts_of_postgres: int = 0
    contention_retries: int = 0
    contention_errors: int = 0
    batching: bool = True
    batch_sizes: Counter[int] = field(default_factory=Counter)  # placement batches by size
    acknowledged_schedules: int = 0
    retried_in_flight: int = 0
    events: int = 0
    audit_events_per_second: float = 0.0
    # adversarial profile: misbehaviours refused as documented, guard and audit probes held
    misbehaviours: Counter[str] = field(default_factory=Counter)
    probes: Counter[str] = field(default_factory=Counter)
    # adversarial profile: the insider phase's attempts (name, outcome, detail), in order
    insider: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "database": self.database,
            "log_dir": str(self.log_dir),
            "operations": dict(sorted(self.operations.items())),
            "refusals": dict(sorted(self.refusals.items())),
            "faults": self.faults,
            "kills": self.kills,
            "postgres_restarts": self.restarts_of_postgres,
            "contention_retries": self.contention_retries,
            "contention_errors": self.contention_errors,
            "batching": "on" if self.batching else "off",
            "placement_batches": dict(sorted(self.batch_sizes.items())),
            "acknowledged_schedules": self.acknowledged_schedules,
            "retried_in_flight": self.retried_in_flight,
            "events": self.events,
            "audit_events_per_second": round(self.audit_events_per_second, 1),
            "misbehaviours_refused": dict(sorted(self.misbehaviours.items())),
            "probes_held": dict(sorted(self.probes.items())),
            "insider": self.insider,
            "violations": self.violations,
        }
