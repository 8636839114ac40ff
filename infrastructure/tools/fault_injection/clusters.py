"""Throwaway PostgreSQL clusters from the local binaries: a primary and its standby.

For the failover checks (``verify --profile failover``, the tests): :func:`primary` makes
a cluster with ``initdb`` on a free port (trust authentication on 127.0.0.1 only, WAL for
streaming replication), :func:`standby_of` one from a ``pg_basebackup`` of it that
streams from it (a synchronous standby when the primary names it in
``synchronous_standby_names``). :meth:`LocalCluster.kill` is a lost host: SIGKILL to the
postmaster and every backend at once (none of them writes another byte);
:meth:`LocalCluster.promote` is ``pg_ctl promote``. Every cluster lives in a directory of
its own under the run's directory; :meth:`LocalCluster.remove` kills it if it still runs
and deletes it. As root, the binaries run as the ``postgres`` user (PostgreSQL refuses
root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

POSTGRES_USER = "postgres"


def bindir() -> Path:
    """The directory of the local PostgreSQL binaries (``pg_config --bindir``)."""
    found = shutil.which("pg_config")
    if found:
        result = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(result.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    for directory in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(directory) / "initdb").exists():
            return Path(directory)
    raise RuntimeError(
        "no PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup): install them "
        "(Debian: apt-get install postgresql)"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def as_postgres() -> list[str]:
    """The prefix that runs a command as the ``postgres`` user when this process is root."""
    return ["runuser", "-u", POSTGRES_USER, "--"] if os.geteuid() == 0 else []


def clusters_directory(prefix: str = "secondbox-clusters-") -> Path:
    """A new directory for clusters (in the temporary directory: the ``postgres`` user
    must reach it), owned by ``postgres`` under root."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    own(directory)
    return directory


def own(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, POSTGRES_USER)


def run(command: list[str], log: Path | None = None) -> None:
    """Run a PostgreSQL binary (as ``postgres`` under root); its output to ``log``."""
    result = subprocess.run(as_postgres() + command, capture_output=True, text=True, check=False)
    if log is not None:
        with log.open("a") as out:
            out.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed: {result.stderr.strip()[-500:]}")


class LocalCluster:
    """One PostgreSQL cluster of this machine: its data directory, port and log."""

    def __init__(self, directory: Path, port: int, name: str) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.port = port
        self.name = name
        self.log = directory / "postgres.log"
        self.bin = bindir()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={POSTGRES_USER} dbname={dbname}"

    def configure(self, **settings: str) -> None:
        """Append settings to postgresql.conf (the last one of a name wins)."""
        with (self.data / "postgresql.conf").open("a") as conf:
            for key, value in settings.items():
                conf.write(f"{key} = '{value}'\n")

    def start(self) -> None:
        """``pg_ctl start``. After a kill, the lock file names a postmaster that is gone
        but may not yet be reaped (a zombie, which PostgreSQL takes for a live one):
        those lock files (the data directory's, the socket's) are removed first."""
        locks = [self.data / "postmaster.pid", self.directory / f".s.PGSQL.{self.port}.lock"]
        for lock in locks:
            with contextlib.suppress(OSError, IndexError, ValueError):
                if not alive(int(lock.read_text().splitlines()[0])):
                    lock.unlink()
        run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t",
             "60", "start"], self.directory / "commands.log")  # fmt: skip

    def promote(self) -> None:
        """``pg_ctl promote``, waiting until the cluster takes writes."""
        run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"],
            self.directory / "commands.log")  # fmt: skip

    def stop(self) -> None:
        run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
            self.directory / "commands.log")  # fmt: skip

    def postmaster_pid(self) -> int | None:
        try:
            first = (self.data / "postmaster.pid").read_text().splitlines()[0]
            pid = int(first)
        except (OSError, IndexError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def kill(self) -> bool:
        """A lost host: SIGKILL to the postmaster and all its children (backends, WAL
        sender, checkpointer...) together. False when it was not running."""
        pid = self.postmaster_pid()
        if pid is None:
            return False
        victims = [pid, *children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(v) for v in victims):
            time.sleep(0.02)
        return True

    def is_primary(self) -> bool:
        try:
            with psycopg.connect(self.conninfo(), connect_timeout=2, autocommit=True) as conn:
                row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
        except psycopg.Error:
            return False
        return bool(row and row[0])

    def sql(self, statement: str, dbname: str = "postgres") -> list[tuple[object, ...]]:
        with psycopg.connect(self.conninfo(dbname), connect_timeout=5, autocommit=True) as conn:
            cursor = conn.execute(statement)
            return list(cursor.fetchall()) if cursor.description else []

    def wait_for(self, standby: str, timeout: float = 60) -> None:
        """Make ``standby`` (an ``application_name``) this primary's synchronous standby
        (``synchronous_standby_names``, ``synchronous_commit`` on: every commit is
        flushed there too before it returns), once it streams as one."""
        self.sql(f"ALTER SYSTEM SET synchronous_standby_names = '{standby}'")
        self.sql("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        query = (
            "SELECT count(*) FROM pg_stat_replication "
            f"WHERE application_name = '{standby}' AND sync_state = 'sync'"
        )
        while time.monotonic() < deadline:
            if self.sql(query)[0][0]:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{standby} is no synchronous standby of {self.name} in {timeout} s")

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


def kill_clusters_under(directory: Path) -> int:
    """SIGKILL every cluster whose data directory is under ``directory`` (the servers a
    run started, found by their lock files, also one that an interruption left
    unrecorded); how many."""
    killed = 0
    for lock in directory.glob("**/postmaster.pid"):
        cluster = LocalCluster.__new__(LocalCluster)
        cluster.data = lock.parent
        killed += cluster.kill()
    return killed


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields and int(fields[1]) == pid:
            found.append(int(Path(stat).parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _new_directory(parent: Path, name: str) -> Path:
    directory = parent / name
    directory.mkdir(parents=True)
    own(directory)
    return directory


def primary(parent: Path, name: str) -> LocalCluster:
    """A new primary under ``parent``/``name``, started, replicating asynchronously
    until :meth:`LocalCluster.wait_for` names a synchronous standby (a primary that
    names one before it streams would hold every commit, ``CREATE DATABASE`` too)."""
    directory = _new_directory(parent, name)
    cluster = LocalCluster(directory, free_port(), name)
    run([str(cluster.bin / "initdb"), "-D", str(cluster.data), "-U", POSTGRES_USER, "-A",
         "trust", "--no-sync"], directory / "commands.log")  # fmt: skip
    with (cluster.data / "pg_hba.conf").open("a") as hba:
        hba.write("host replication all 127.0.0.1/32 trust\n")
    cluster.configure(
        listen_addresses="127.0.0.1", port=str(cluster.port),
        unix_socket_directories=str(directory), wal_level="replica", max_wal_senders="10",
        hot_standby="on", wal_keep_size="256MB", synchronous_commit="on",
        synchronous_standby_names="", max_connections="200",
        shared_buffers="32MB", fsync="off", full_page_writes="off",
    )  # fmt: skip
    cluster.start()
    return cluster


def standby_of(
    source: LocalCluster, parent: Path, name: str, via_port: int | None = None
) -> LocalCluster:
    """A standby of ``source`` (``pg_basebackup -R``), streaming from it as
    ``application_name`` ``name`` (through ``via_port``, a relay to it, if given),
    started. Once promoted it waits for no standby of its own
    (``synchronous_standby_names`` empty)."""
    directory = _new_directory(parent, name)
    cluster = LocalCluster(directory, free_port(), name)
    # -R writes primary_conninfo (with this application_name) to postgresql.auto.conf
    port = via_port or source.port
    source_conninfo = f"host=127.0.0.1 port={port} user={POSTGRES_USER} application_name={name}"
    run([str(cluster.bin / "pg_basebackup"), "-D", str(cluster.data), "-d", source_conninfo,
         "-X", "stream", "-R", "--no-sync", "-c", "fast"], directory / "commands.log")  # fmt: skip
    cluster.configure(
        port=str(cluster.port), unix_socket_directories=str(directory),
        synchronous_standby_names="",
    )  # fmt: skip
    cluster.start()
    return cluster


def multi_host_url(clusters: list[LocalCluster], dbname: str) -> str:
    """The cell's URL: every cluster's host, the one that takes writes chosen."""
    hosts = ",".join(cluster.host for cluster in clusters)
    return f"postgresql://{POSTGRES_USER}@{hosts}/{dbname}?target_session_attrs=read-write"


def wait_for_replay(
    primary_cluster: LocalCluster, standby: LocalCluster, timeout: float = 30
) -> None:
    """Until ``standby`` has replayed everything ``primary_cluster`` wrote so far."""
    target = primary_cluster.sql("SELECT pg_current_wal_lsn()::text")[0][0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = standby.sql(f"SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn")[0][0]
        if done:
            return
        time.sleep(0.05)
    raise TimeoutError(f"standby {standby.name} did not replay up to {target} in {timeout} s")
