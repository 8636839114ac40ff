"""CPU seconds of given processes, and of the PostgreSQL backends of one database, from
``/proc`` (Linux; elsewhere nothing is found and the figures are None).

The bench's ``http`` section reports the CPU per placement of the ``serve`` processes
and of PostgreSQL separately from the whole machine's: the serve processes by their pid,
PostgreSQL by its backends whose process title names the bench's database
(``postgres: [cluster: ]user database host(port) state``). The server's own background
processes (WAL writer, checkpointer) serve every database of the server and are not
counted; a backend that exits during the window loses what it used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from secondbox_scheduler.infrastructure.settings import (
    DATABASE_URL,
    POSTGRES_MODULE,
    settings_from_url,
)

PROC = "/proc"


def process_cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of ``pid`` so far (None: no such process here)."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text.rsplit(b")", 1)[-1].split()  # the name, in parentheses, may hold spaces
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    except (IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def processes_cpu(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds of each of ``pids`` that exists."""
    found = {}
    for pid in pids:
        seconds = process_cpu_seconds(pid)
        if seconds is not None:
            found[pid] = seconds
    return found


def backend_title_names(title: str, dbname: str) -> bool:
    """Whether a PostgreSQL process title is a backend of database ``dbname``."""
    if not title.startswith("postgres:"):
        return False
    words = title[len("postgres:") :].split()
    if words and words[0].endswith(":"):  # the cluster's name
        words = words[1:]
    return len(words) >= 3 and words[1] == dbname


def database_backends(dbname: str) -> dict[int, float]:
    """CPU seconds of every PostgreSQL backend (on this machine) of database ``dbname``."""
    pids = []
    try:
        entries = os.listdir(PROC)
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{PROC}/{entry}/cmdline", "rb") as cmdline:
                title = cmdline.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        if backend_title_names(title, dbname):
            pids.append(int(entry))
    return processes_cpu(pids)


def used_since(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU seconds used between two readings (a process new since ``before``: all of it)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat (Linux);
    (0, 0) elsewhere. Busy includes the database server and every worker."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def database_name(env: dict[str, str]) -> str | None:
    """The PostgreSQL database of the run (None on SQLite)."""
    found = settings_from_url(env[DATABASE_URL])
    if found.get("PERSISTENCE_MODULE") != POSTGRES_MODULE:
        return None
    return found.get("POSTGRES_DBNAME") or None
