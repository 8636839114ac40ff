"""Ranking policies: which compatible runner is preferred.

docs/spec.md (section 3) fixes one ranking, the seed's (:class:`SeedRanking`): artifact locality,
then free instances, vCPU and memory (most first), then id. It is the default of
``select_runner`` and ``decide`` and the only one the scheduler itself decides with.
The what-if replay (``domain/whatif/engine.py``) can replay a recorded history under another
one: :class:`BinPacking` (least free capacity first) and :class:`Spread` (least
utilised first) are built in, and any object with a ``name`` and a ``key`` method is a
policy (:class:`RankingPolicy`).

A policy only orders runners that passed every rule: it never makes an incompatible
runner eligible.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from secondbox_scheduler.domain.placement.evidence import RankKey
from secondbox_scheduler.domain.values import Requirements, RunnerSnapshot


def rank_key(requirements: Requirements, runner: RunnerSnapshot) -> RankKey:
    """Sort key of a compatible runner: smaller is better (docs/spec.md (section 3) ranking)."""
    preferred = frozenset(requirements.preferred_artifact_digests)
    return rank_key_for(preferred, runner)


def rank_key_for(preferred: frozenset[str], runner: RunnerSnapshot) -> RankKey:
    """``rank_key`` with the preferred digests as a set (computed once per decision)."""
    locality = sum(1 for digest in runner.artifact_digests if digest in preferred)
    a, r = runner.allocatable, runner.reserved
    return (
        -locality,
        -(a.instances - r.instances),
        -(a.vcpu_count - r.vcpu_count),
        -(a.memory_bytes - r.memory_bytes),
        runner.id,
    )


@runtime_checkable
class RankingPolicy(Protocol):
    """Orders compatible runners: the runner with the smallest ``key`` is chosen.

    The key must be a tuple that compares with the keys of other runners; end it with
    ``runner.id`` so that two runners never tie (with a tie, the runner listed first
    would win, and listing order is not part of the recorded evidence).
    """

    @property
    def name(self) -> str:
        """A short name for reports (``seed``, ``binpack``, ``spread``)."""
        ...

    def key(self, requirements: Requirements, runner: RunnerSnapshot) -> tuple[Any, ...]:
        """Sort key of ``runner`` for ``requirements``: smaller is preferred."""
        ...


def artifact_locality(requirements: Requirements, runner: RunnerSnapshot) -> int:
    """How many of the runner's cached artifact digests are preferred (docs/spec.md, section 3)."""
    preferred = frozenset(requirements.preferred_artifact_digests)
    return sum(1 for digest in runner.artifact_digests if digest in preferred)


class SeedRanking:
    """docs/spec.md (section 3): locality, free instances, vCPU, memory (most first), id."""

    name = "seed"

    def key(self, requirements: Requirements, runner: RunnerSnapshot) -> tuple[Any, ...]:
        return rank_key(requirements, runner)


class BinPacking:
    """Least free capacity first: fewest free instances, then vCPU, then memory; then
    the seed's artifact locality (most first) and id. Fills runners before opening
    others, so that whole runners stay free (kube-scheduler's MostAllocated in spirit,
    on absolute amounts)."""

    name = "binpack"

    def key(self, requirements: Requirements, runner: RunnerSnapshot) -> tuple[Any, ...]:
        a, r = runner.allocatable, runner.reserved
        return (
            a.instances - r.instances,
            a.vcpu_count - r.vcpu_count,
            a.memory_bytes - r.memory_bytes,
            -artifact_locality(requirements, runner),
            runner.id,
        )


def _share(reserved: int, allocatable: int) -> float:
    return reserved / allocatable if allocatable > 0 else 1.0


class Spread:
    """Least utilised first: the largest share reserved of vCPU, memory and instances,
    lowest first; then most free instances, then id. Spreads load evenly over runners
    of different sizes (kube-scheduler's LeastAllocated); artifact locality is ignored."""

    name = "spread"

    def key(self, requirements: Requirements, runner: RunnerSnapshot) -> tuple[Any, ...]:
        a, r = runner.allocatable, runner.reserved
        share = max(
            _share(r.vcpu_count, a.vcpu_count),
            _share(r.memory_bytes, a.memory_bytes),
            _share(r.instances, a.instances),
        )
        return (share, -(a.instances - r.instances), runner.id)


SEED = SeedRanking()
POLICIES: dict[str, RankingPolicy] = {
    policy.name: policy for policy in (SEED, BinPacking(), Spread())
}
