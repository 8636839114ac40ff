"""The optional parts of the installation (the extras of ``pyproject.toml``) and the one
line a command says when the extra it needs is missing.

``pip install secondbox-scheduler`` is the library alone (eventsourcing, psycopg,
pydantic). The command line needs ``[cli]``, ``serve`` ``[server]``, ``bench``
``[bench]``; ``[all]`` brings everything. A command whose extra is missing exits with
the usage code, 2, after one line naming the extra and the command that installs it
(docs/spec.md (section 8.4)): the installation, not the store or the scheduler, must
change, and retrying cannot help. This module imports nothing outside the standard
library, so that it can say so before anything optional is imported.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "secondbox-scheduler"

# extra: the modules it brings that the code imports (by import name; httptools and
# uvloop: only to ask uvicorn for them, infrastructure/http/server.py)
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "fast": ("orjson", "httptools", "uvloop"),
    "cli": ("typer", "rich", "cryptography"),
    "server": ("fastapi", "starlette", "uvicorn", "anyio", "prometheus_client"),
    "bench": ("httpx",),
    "yaml": ("yaml",),
    "testing": ("hypothesis",),
}
# extra: the extras it needs (pyproject.toml spells them as self-references; [server]
# also brings [fast], which nothing needs: without orjson, json encodes the events)
INCLUDES: dict[str, tuple[str, ...]] = {
    "server": ("cli",),
    "bench": ("server",),
    "all": ("cli", "fast", "server", "bench", "yaml", "testing"),
}


class MissingExtraError(Exception):
    """An optional part of the installation that a command needs is not installed."""

    def __init__(self, extra: str, module: str, needed_by: str) -> None:
        self.extra = extra
        self.module = module
        self.needed_by = needed_by
        super().__init__(
            f"{needed_by} needs the [{extra}] extra (no module named {module!r}): "
            f"pip install '{DISTRIBUTION}[{extra}]'"
        )


def modules_of(extra: str) -> tuple[str, ...]:
    """The import names that ``extra`` brings, those of the extras it includes first."""
    found: list[str] = []
    for included in INCLUDES.get(extra, ()):
        found.extend(name for name in modules_of(included) if name not in found)
    found.extend(name for name in EXTRA_MODULES.get(extra, ()) if name not in found)
    return tuple(found)


def missing_module(extra: str) -> str | None:
    """The first module of ``extra`` that cannot be imported here, or None."""
    for module in modules_of(extra):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def require_extra(extra: str, needed_by: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extra`` is installed."""
    module = missing_module(extra)
    if module is not None:
        raise MissingExtraError(extra, module, needed_by)
