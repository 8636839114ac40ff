"""The cells of ``verify --profile failover``: per cell a primary and a standby on this
machine, and how its leader is lost and replaced.

:class:`ManualCell` (``--promote manual``): a primary from ``initdb`` and a standby from
``pg_basebackup`` (:mod:`.clusters`), synchronous (the primary's
``synchronous_standby_names`` names the standby, ``synchronous_commit`` on) or
asynchronous; losing the leader is SIGKILL to every process of the primary, and
replacing it is ``pg_ctl promote`` of the standby. The standby streams through a
:class:`~.link.Link` (the run partitions it before the kill). :class:`~.patroni.PatroniCell`
(``--promote patroni``) is the same pair managed by Patroni over a local etcd.
Both give the cell's multi-host URL (``target_session_attrs=read-write``): the routers
follow the new primary through it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from secondbox_scheduler.infrastructure.tools.fault_injection.clusters import (
    LocalCluster,
    multi_host_url,
    primary,
    standby_of,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.link import Link

DATABASE = "secondbox_failover"


class FailoverCell(Protocol):
    name: str

    def url(self) -> str:
        """The cell's store: every node's host, the writable one chosen."""
        ...

    def leader(self) -> LocalCluster:
        """The node that takes writes now."""
        ...

    def lag_leader(self) -> None:
        """Partition the leader's replication link (:mod:`.link`): from now until the
        kill its standby receives nothing more."""
        ...

    def kill_leader(self) -> str:
        """Lose the leader's host (SIGKILL, its replication link cut): its name."""
        ...

    def replace_leader(self, timeout: float) -> bool:
        """Let a standby take over (and the lost node come back as a standby, where
        the cell's replication needs one to take writes); whether it did in time."""
        ...

    def remove(self) -> None: ...


class ManualCell:
    """A primary and its standby; the standby promoted by hand (``pg_ctl promote``)."""

    def __init__(self, name: str, parent: Path, synchronous: bool) -> None:
        self.name = name
        standby_name = f"{name}_standby"  # an identifier in synchronous_standby_names
        self.nodes: list[LocalCluster] = []
        self.links: list[Link] = []  # the primary's: what its standby streams through
        self.lost: LocalCluster | None = None
        try:
            self.nodes.append(primary(parent, f"{name}_primary"))
            self.nodes[0].sql(f"CREATE DATABASE {DATABASE}")
            self.links.append(Link(self.nodes[0].port))
            self.nodes.append(
                standby_of(self.nodes[0], parent, standby_name, via_port=self.links[0].port)
            )
            if synchronous:
                self.nodes[0].wait_for(standby_name)
        except BaseException:
            self.remove()  # what was started of it
            raise

    def url(self) -> str:
        return multi_host_url(self.nodes, DATABASE)

    def leader(self) -> LocalCluster:
        return next(node for node in self.nodes if node.is_primary())

    def lag_leader(self) -> None:
        self.links[0].partition()  # the standby streams from the first primary only

    def kill_leader(self) -> str:
        self.lost = self.leader()
        self.lost.kill()
        if self.lost is self.nodes[0]:
            self.links[0].cut()
        return self.lost.name

    def replace_leader(self, timeout: float) -> bool:
        """``pg_ctl promote`` of the standby. It then takes writes alone: its
        ``synchronous_standby_names`` is empty (nothing to wait for until a new standby
        is built from it: docs/operations.md, "Failover")."""
        survivor = next(node for node in self.nodes if node is not self.lost)
        survivor.promote()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if survivor.is_primary():
                return True
            time.sleep(0.1)
        return False

    def remove(self) -> None:
        for node in self.nodes:
            node.remove()
        for link in self.links:
            link.close()
