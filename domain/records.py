"""The record shapes of the value types, as events and snapshots store them (JSON).

Plain ``TypedDict``s with no import from the rest of the domain, so that the value
types (``values.py``) and the evidence (``placement/evidence.py``) can both name them.
"""

from __future__ import annotations

from typing import TypedDict


class RequirementsRecord(TypedDict):
    """``Requirements.to_record()``: what a sandbox pins (``Sandbox.Created``) and a refused
    creation records (``RefusalLog.Refused``)."""

    pool_name: str
    architecture: str
    required_capabilities: list[str]  # sorted
    capacity: dict[str, int]  # Capacity.as_dict()
    guest_protocol_generation: int
    preferred_artifact_digests: list[str]
    egress_context: str | None


class MaterializationRecord(TypedDict):
    """``MaterializationSnapshot.to_record()``: one materialization as a lease records it
    (``RunnerLease.EvidenceRecorded``) and a placement's runner evidence carries it."""

    backend_kind: str
    architecture: str
    runtime_digest: str
    toolchain_digest: str
    digest: str


class RunnerSnapshotRecord(TypedDict):
    """``RunnerSnapshot.to_record()``: the runner a placement read, as its evidence records
    it (``Sandbox.AssignmentFenced.placement["runner"]``)."""

    id: str
    pool_name: str
    backend_kind: str
    architecture: str
    capabilities: list[str]  # sorted
    allocatable: dict[str, int]  # Capacity.as_dict()
    reserved: dict[str, int]  # Capacity.as_dict()
    drain_phase: str
    last_heartbeat_at: str | None  # ISO 8601 (a JSON dump)
    artifact_digests: list[str]
    materializations: list[MaterializationRecord]
    supported_egress_contexts: list[str]
    guest_protocol_minimum: int
    guest_protocol_maximum: int
