"""Which PostgreSQL server ``verify --restart-postgres`` may restart: only the one that
``--database-url`` names, once it is proved to be a cluster of this machine that
``pg_ctl`` controls (docs/verification.md, "Restarting PostgreSQL").

Found by a red team: the run restarted ``pg_ctlcluster <newest> main`` whatever the URL
named, and reported success. Now, before anything runs, :func:`prove_local_cluster`
establishes, or refuses with :class:`RestartRefused` (exit 2):

1. the URL's host is this machine (a loopback address or a socket directory);
2. the server says where its data is and which port it listens on (``SHOW
   data_directory``, ``SHOW port``: a superuser or ``pg_read_all_settings``);
3. that directory is here, and its ``postmaster.pid`` names the same directory and
   port and a postmaster process;
4. the backend serving this very connection (``pg_backend_pid()``) is a child of that
   postmaster (``/proc``): the server connected to is that process, not another with
   the same paths (a container, another host behind a forwarded port);
5. a ``pg_ctl`` of the server's major version is installed.

The restart is then ``pg_ctl -D <data_directory> -m fast -w restart`` (as the data
directory's owner when run as root), which starts the server again with the options
it had (``postmaster.opts``); its output then goes to ``postgres-restart.log`` in the
run's log directory.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

RESTART_TIMEOUT_SECONDS = 120


class RestartRefused(ValueError):
    """``--restart-postgres`` cannot prove which local cluster the URL names."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"--restart-postgres refused: {why}; verify restarts only a PostgreSQL cluster "
            "of this machine that it can prove --database-url names (docs/verification.md)"
        )


@dataclass(frozen=True)
class ServerFacts:
    """What the server says of itself over the connection."""

    data_directory: str
    port: int
    backend_pid: int
    major_version: int


@dataclass(frozen=True)
class LocalCluster:
    """A cluster of this machine, proved to be the server the URL names."""

    data_directory: Path
    port: int
    pg_ctl: str
    owner: str

    def restart(self, log: Path) -> bool:
        """Restart it with ``pg_ctl`` (fast shutdown, waiting for the start); its log
        goes to ``log``. False when pg_ctl fails."""
        prefix: list[str] = []
        if os.geteuid() == 0 and self.owner != "root":  # pg_ctl refuses to run as root
            prefix = ["runuser", "-u", self.owner, "--"]
        command = [self.pg_ctl, "-D", str(self.data_directory), "-m", "fast", "-w", "restart"]
        # the server's output goes to ``log``, opened here: the server inherits the file
        # (never a pipe, which would hold this call open for the server's life), and its
        # owner need not be able to open the path itself
        with log.open("ab") as output:
            result = subprocess.run(
                [*prefix, *command],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                timeout=RESTART_TIMEOUT_SECONDS,
                check=False,
            )
        return result.returncode == 0


def is_local_host(host: str) -> bool:
    """Whether ``host`` is this machine: a socket directory or only loopback addresses."""
    if host.startswith("/"):
        return True
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(
        ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses
    )


def server_facts(database_url: str) -> tuple[ServerFacts, int | None]:
    """What the server says of itself, and the parent of the connection's backend as this
    machine sees it, read while the connection is open (once it closes, its backend
    exits and its parent is no longer visible: a refusal by a race)."""
    try:
        with psycopg.connect(database_url, autocommit=True, connect_timeout=10) as conn:
            row = conn.execute(
                "SELECT current_setting('data_directory'), current_setting('port')::int, "
                "pg_backend_pid(), current_setting('server_version_num')::int / 10000"
            ).fetchone()
            assert row is not None
            backend_parent = parent_pid(int(row[2]))
    except psycopg.errors.InsufficientPrivilege:
        raise RestartRefused(
            "the role of --database-url may not read data_directory (it needs to be a "
            "superuser or a member of pg_read_all_settings)"
        ) from None
    except psycopg.Error as error:
        raise RestartRefused(f"cannot ask the server where its data is ({error})") from None
    return ServerFacts(str(row[0]), int(row[1]), int(row[2]), int(row[3])), backend_parent


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (None: no such process visible here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def proof_problem(facts: ServerFacts, pid_file: str | None, backend_parent: int | None) -> str:
    """Why ``facts`` (the server's word) and this machine's view (``postmaster.pid`` of
    its data directory, the parent of its backend) do not prove one cluster ("" when
    they do)."""
    if pid_file is None:
        return f"the server's data directory {facts.data_directory} is not on this machine"
    lines = pid_file.splitlines()
    if len(lines) < 4 or not lines[0].strip().isdigit() or not lines[3].strip().isdigit():
        return f"{facts.data_directory}/postmaster.pid is not a running server's"
    postmaster, directory, port = int(lines[0]), lines[1].strip(), int(lines[3])
    if Path(directory) != Path(facts.data_directory) or port != facts.port:
        return (
            f"{facts.data_directory}/postmaster.pid names {directory} on port {port}, "
            f"not the server's {facts.data_directory} on port {facts.port}"
        )
    if backend_parent is None:
        return f"the server's processes (backend {facts.backend_pid}) are not visible here"
    if backend_parent != postmaster:
        return (
            f"the connection's backend {facts.backend_pid} is not a child of the "
            f"postmaster {postmaster} of {facts.data_directory}"
        )
    return ""


def pg_ctl_for(major: int) -> str | None:
    """A ``pg_ctl`` of PostgreSQL ``major``: ``pg_config --bindir``'s, or Debian's."""
    candidates = []
    try:
        bindir = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
        candidates.append(Path(bindir) / "pg_ctl")
    except (OSError, subprocess.CalledProcessError):
        pass
    candidates.append(Path(f"/usr/lib/postgresql/{major}/bin/pg_ctl"))
    for candidate in candidates:
        if not candidate.is_file():
            continue
        version = subprocess.run(
            [str(candidate), "--version"], capture_output=True, text=True, check=False
        ).stdout.split()
        if version and version[-1].split(".")[0] == str(major):
            return str(candidate)
    return None


def prove_local_cluster(database_url: str) -> LocalCluster:
    """The cluster of this machine that ``database_url`` names, or RestartRefused."""
    host = urlsplit(database_url).hostname or ""
    if not host or not is_local_host(host):
        raise RestartRefused(f"{host or 'the URL'!s} is not this machine")
    facts, backend_parent = server_facts(database_url)
    data = Path(facts.data_directory)
    try:
        pid_file: str | None = (data / "postmaster.pid").read_text()
    except OSError:
        pid_file = None
    problem = proof_problem(facts, pid_file, backend_parent)
    if problem:
        raise RestartRefused(problem)
    pg_ctl = pg_ctl_for(facts.major_version)
    if pg_ctl is None:
        raise RestartRefused(f"no pg_ctl of PostgreSQL {facts.major_version} is installed")
    owner = pwd.getpwuid(data.stat().st_uid).pw_name
    return LocalCluster(data, facts.port, pg_ctl, owner)
