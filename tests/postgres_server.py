"""Find the PostgreSQL server the tests use, or start a throwaway one.

1. ``POSTGRES_HOST`` (with ``POSTGRES_PORT``, ``POSTGRES_USER``, ``POSTGRES_PASSWORD``,
   ``POSTGRES_DBNAME``) names a running server: use it.
2. Otherwise start a throwaway cluster from local PostgreSQL binaries (``initdb`` and
   ``pg_ctl`` on PATH or under /usr/lib/postgresql/*/bin) in a temporary directory.
3. Otherwise fail, naming what to install.

Tests never mock PostgreSQL and never skip it silently.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import make_conninfo

INSTALL_HINT = (
    "PostgreSQL tests need a server: set POSTGRES_HOST/POSTGRES_PORT/POSTGRES_USER/"
    "POSTGRES_PASSWORD/POSTGRES_DBNAME for a running one, or install the server "
    "binaries (initdb, pg_ctl; Debian/Ubuntu: apt-get install postgresql; macOS: "
    "brew install postgresql@15) so that a throwaway one can be started"
)


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    password: str
    dbname: str

    def env(self) -> dict[str, str]:
        return {
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_HOST": self.host,
            "POSTGRES_PORT": str(self.port),
            "POSTGRES_USER": self.user,
            "POSTGRES_PASSWORD": self.password,
            "POSTGRES_DBNAME": self.dbname,
        }

    def conninfo(self, dbname: str | None = None) -> str:
        return make_conninfo(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password or None,
            dbname=dbname or self.dbname,
        )

    def url(self, schema: str | None = None) -> str:
        auth = self.user + (f":{self.password}" if self.password else "")
        query = f"?schema={schema}" if schema else ""
        return f"postgresql://{auth}@{self.host}:{self.port}/{self.dbname}{query}"


def from_environment() -> PostgresServer | None:
    host = os.environ.get("POSTGRES_HOST")
    if not host:
        return None
    return PostgresServer(
        host=host,
        port=int(os.environ.get("POSTGRES_PORT", "5432")),
        user=os.environ.get("POSTGRES_USER", "postgres"),
        password=os.environ.get("POSTGRES_PASSWORD", ""),
        dbname=os.environ.get("POSTGRES_DBNAME", "postgres"),
    )


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowawayCluster:
    """A PostgreSQL cluster in a temporary directory, stopped and removed by stop()."""

    def __init__(self) -> None:
        initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
        if not initdb or not pg_ctl:
            raise RuntimeError(INSTALL_HINT)
        self.pg_ctl = pg_ctl
        self.directory = Path(tempfile.mkdtemp(prefix="secondbox-pg-"))
        self.data = self.directory / "data"
        self.port = _free_port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:  # initdb refuses to run as root
            self.prefix = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.directory, "postgres")
        self._run([initdb, "-D", str(self.data), "-U", "postgres", "-A", "trust"])
        self.start()
        self.server = PostgresServer("127.0.0.1", self.port, "postgres", "", "postgres")

    def start(self) -> None:
        """Start the cluster (again, after :meth:`halt`), waiting until it accepts."""
        self._run(
            [
                self.pg_ctl,
                "-D",
                str(self.data),
                "-l",
                str(self.directory / "log"),
                "-o",
                f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1",
                "-w",
                "start",
            ]
        )

    def halt(self) -> None:
        """Stop the server at once (``-m immediate``), keeping its data: :meth:`start`
        starts it again on the same port."""
        self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"])

    def _run(self, command: list[str]) -> None:
        subprocess.run(self.prefix + command, check=True, capture_output=True)

    def stop(self) -> None:
        try:
            self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"])
        except subprocess.CalledProcessError:
            pass  # already halted
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
