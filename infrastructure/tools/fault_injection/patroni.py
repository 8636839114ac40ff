"""Patroni over a local etcd: the real failover engine for ``verify --profile failover``.

:class:`Etcd` runs Debian's ``etcd`` (``etcd-server``) on free ports in a directory of
its own. :class:`PatroniCell` runs two Patroni nodes of one cell (scope) over it, each
managing a PostgreSQL from the local binaries on free ports: the first bootstraps the
cluster (``initdb``), the second joins it as a standby (``pg_basebackup``). With
``synchronous=True`` the DCS configuration says ``synchronous_mode`` and
``synchronous_mode_strict``: every commit waits for the standby, and a primary without
a synchronous standby takes no writes (so nothing acknowledged exists only on it).

Losing the leader is SIGKILL to its Patroni and to every process of its PostgreSQL;
Patroni's leader key expires (``ttl``) and the standby promotes itself. Under strict
synchronous mode the new primary waits for a synchronous standby before it takes
writes, so :meth:`PatroniCell.replace_leader` starts the lost node's Patroni again once
the standby leads: it rejoins as the new standby (``pg_rewind`` if its WAL went ahead).
Found with :func:`patroni_binary` (``SECONDBOX_PATRONI``, ``.venv-failover`` made by
``scripts/failover-deps.sh``, or PATH) and :func:`etcd_binary`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from secondbox_scheduler.infrastructure.tools.fault_injection.clusters import (
    POSTGRES_USER,
    LocalCluster,
    alive,
    as_postgres,
    bindir,
    free_port,
    multi_host_url,
    own,
)
from secondbox_scheduler.infrastructure.tools.fault_injection.failover_cells import DATABASE
from secondbox_scheduler.infrastructure.tools.fault_injection.link import Link

PATRONI = "SECONDBOX_PATRONI"
TTL = 20  # Patroni's least leader-key TTL: a lost leader is replaced after at most this
LOOP_WAIT = 2
RETRY_TIMEOUT = 5


def patroni_binary() -> str | None:
    candidates = [os.environ.get(PATRONI) or ""]
    here = Path(__file__).resolve()
    candidates += [str(parent / ".venv-failover/bin/patroni") for parent in here.parents]
    candidates.append(shutil.which("patroni") or "")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class Etcd:
    """One local etcd member on free ports, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is missing: run scripts/failover-deps.sh (etcd-server)")
        directory.mkdir(parents=True, exist_ok=True)
        self.port, peer = free_port(), free_port()
        self.log = directory / "etcd.log"
        self.process = subprocess.Popen(
            [binary, "--name", "failover", "--data-dir", str(directory / "data"),
             "--listen-client-urls", f"http://127.0.0.1:{self.port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"failover=http://127.0.0.1:{peer}",
             "--enable-v2=true"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("ab"), start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                health = f"http://127.0.0.1:{self.port}/health"
                with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=1):
                    return
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"etcd did not start (see {self.log})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class PatroniNode:
    """One Patroni process and the PostgreSQL it manages."""

    def __init__(self, cell: str, name: str, directory: Path, etcd_port: int, sync: bool) -> None:
        self.name = name
        self.directory = directory
        directory.mkdir(parents=True)
        own(directory)
        self.cluster = LocalCluster(directory, free_port(), name)
        # the address the other node streams from (and rewinds from): a relay the run
        # can partition; the clients reach the node directly
        self.link = Link(self.cluster.port)
        self.api_port = free_port()
        self.config = directory / "patroni.yml"
        self.config.write_text(json.dumps(self.settings(cell, etcd_port, sync), indent=1))
        own(self.config)
        self.process: subprocess.Popen[bytes] | None = None

    def settings(self, cell: str, etcd_port: int, sync: bool) -> dict[str, Any]:
        """Patroni's YAML configuration (JSON is YAML) for this node: docs/operations.md
        shows the same for a production cell."""
        data = str(self.cluster.data)
        return {
            "scope": cell, "namespace": "/secondbox-verify/", "name": self.name,
            "restapi": {"listen": f"127.0.0.1:{self.api_port}",
                        "connect_address": f"127.0.0.1:{self.api_port}"},
            "etcd3": {"hosts": [f"127.0.0.1:{etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 64 * 2**20,
                    "synchronous_mode": sync, "synchronous_mode_strict": sync,
                    "postgresql": {
                        "use_pg_rewind": True, "use_slots": True,
                        "parameters": {
                            "wal_level": "replica", "hot_standby": "on", "wal_log_hints": "on",
                            "max_wal_senders": 10, "max_replication_slots": 10,
                            "wal_keep_size": "256MB", "synchronous_commit": "on",
                            "max_connections": 200, "shared_buffers": "32MB",
                            "fsync": "off", "full_page_writes": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.cluster.port}",
                "connect_address": f"127.0.0.1:{self.link.port}",
                "data_dir": data, "bin_dir": str(bindir()),
                "pgpass": str(self.directory / "pgpass"),
                "authentication": {
                    "superuser": {"username": POSTGRES_USER},
                    "replication": {"username": POSTGRES_USER},
                    "rewind": {"username": POSTGRES_USER},
                },
                "parameters": {"unix_socket_directories": str(self.directory)},
                "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
        }  # fmt: skip

    def start(self, binary: str) -> None:
        log = (self.directory / "patroni.log").open("ab")
        self.process = subprocess.Popen(
            [*as_postgres(), binary, str(self.config)], stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip

    def role(self) -> str:
        """``primary``, ``replica`` or ``unknown`` (from the node's REST API)."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.api_port}/patroni", timeout=1
            ) as r:
                state = json.loads(r.read())
        except (OSError, ValueError):
            return "unknown"
        role = str(state.get("role", "unknown"))
        return "primary" if role == "master" else role

    def kill(self) -> None:
        """SIGKILL to Patroni and to every process of its PostgreSQL, at once."""
        victims: list[int] = []
        if self.process is not None and self.process.poll() is None:
            victims.append(self.process.pid)
            victims += _group(self.process.pid)
        pid = self.cluster.postmaster_pid()
        if pid is not None:
            from secondbox_scheduler.infrastructure.tools.fault_injection.clusters import children

            victims += [pid, *children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(v) for v in victims):
            time.sleep(0.02)


def _group(pid: int) -> list[int]:
    """The processes of ``pid``'s session (runuser's child: Patroni itself)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 4 and int(fields[3]) == pid and int(stat.parent.name) != pid:
            found.append(int(stat.parent.name))
    return found


class PatroniCell:
    """Two Patroni nodes of one cell over ``etcd``: a leader and a (synchronous) standby."""

    def __init__(self, name: str, parent: Path, synchronous: bool, etcd: Etcd) -> None:
        binary = patroni_binary()
        if binary is None:
            raise RuntimeError("Patroni is missing: run scripts/failover-deps.sh")
        self.binary = binary
        self.name = name
        self.nodes = [
            PatroniNode(name, f"{name}-{i}", parent / f"{name}-{i}", etcd.port, synchronous)
            for i in range(2)
        ]
        self.lost: PatroniNode | None = None
        try:
            self.nodes[0].start(binary)
            self._wait(lambda: self.nodes[0].role() == "primary", 120, "a leader")
            self.nodes[1].start(binary)
            # in the DCS too: a standby that Patroni has not yet listed as synchronous
            # may not take over (it is not known to hold every commit)
            wanted = "sync_standby" if synchronous else "replica"
            self._wait(lambda: self._standby_role() == wanted, 120, f"a {wanted} streaming")
            self.nodes[0].cluster.sql(f"CREATE DATABASE {DATABASE}")
        except BaseException:
            self.remove()  # what was started of it
            raise

    def _standby_role(self) -> str:
        """The role of the second node in the cell's view (``sync_standby``, ``replica``),
        when it streams."""
        url = f"http://127.0.0.1:{self.nodes[0].api_port}/cluster"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                members = json.loads(response.read()).get("members", [])
        except (OSError, ValueError):
            return "unknown"
        for member in members:
            if member.get("name") == self.nodes[1].name and member.get("state") == "streaming":
                return str(member.get("role"))
        return "unknown"

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"cell {self.name}: no {what} in {timeout:g} s (see patroni.log)")

    def url(self) -> str:
        return multi_host_url([node.cluster for node in self.nodes], DATABASE)

    def leader(self) -> LocalCluster:
        return next(node.cluster for node in self.nodes if node.role() == "primary")

    def lag_leader(self) -> None:
        next(node for node in self.nodes if node.role() == "primary").link.partition()

    def kill_leader(self) -> str:
        self.lost = next(node for node in self.nodes if node.role() == "primary")
        self.lost.kill()
        self.lost.link.cut()
        return self.lost.name

    def replace_leader(self, timeout: float) -> bool:
        """Wait for Patroni to promote the standby, then start the lost node's Patroni
        again (it rejoins as the standby the strict synchronous mode waits for)."""
        assert self.lost is not None
        survivor = next(node for node in self.nodes if node is not self.lost)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and survivor.role() != "primary":
            time.sleep(0.2)
        if survivor.role() != "primary":
            return False
        self.lost.start(self.binary)
        return True

    def remove(self) -> None:
        for node in self.nodes:
            node.kill()
            node.link.close()
        for node in self.nodes:
            shutil.rmtree(node.directory, ignore_errors=True)
