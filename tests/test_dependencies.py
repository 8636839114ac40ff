"""Every import is declared, in the extra of the code that makes it (pyproject.toml).

The library (``pip install secondbox-scheduler``) depends on eventsourcing, psycopg and
pydantic only; the command line on ``[cli]``, the HTTP service and the Prometheus
exporter on ``[server]``, the benchmark on ``[bench]``, the testing kit on
``[testing]``. Read from the source (AST): each module's imports of other distributions
must be declared in its extra (with what that extra includes); an optional import
(``try: ... except ImportError``) or one inside a function must be declared in some
extra; the library's modules import no module of an extra at their top level; and every
declared distribution is imported somewhere. ``infrastructure/extras.py``, which the
commands use to say which extra is missing, agrees with pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from secondbox_scheduler.infrastructure.extras import EXTRA_MODULES, INCLUDES, modules_of

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME = PYPROJECT["project"]["name"]
USER_EXTRAS = ("fast", "cli", "server", "bench", "yaml", "testing")
CORE = ("eventsourcing", "psycopg", "pydantic")
# (folder or file, relative to the checkout): the extra its code belongs to; the rest is
# the library
EXTRA_OF = {
    "infrastructure/cli": "cli",
    "infrastructure/http": "server",
    "infrastructure/prometheus_export.py": "server",
    "infrastructure/tools/bench": "bench",
    "secondbox_scheduler/testing": "testing",
}
# modules that import an extra's module inside a function, and say so when it is missing
LAZY = {
    "infrastructure/cli/serve.py": "server",  # needs_extra("server", ...) first
    "infrastructure/cli/bench.py": "bench",  # needs_extra("bench", ...) first
    "infrastructure/application.py": "server",  # attach_metrics: the embedder's registry
    "infrastructure/audit/whatif_replay.py": "yaml",  # ImportError -> names the extra
    "infrastructure/tools/bench/over_http.py": "bench",
    # signed checkpoints: Ed25519 when a key is used, MissingExtraError names [cli]
    "infrastructure/audit/signed_notes.py": "cli",
}


def _name(requirement: str) -> tuple[str, set[str]]:
    found = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", requirement)
    assert found, requirement
    extras = {e.strip() for e in (found.group(2) or "").split(",") if e.strip()}
    return found.group(1).lower().replace("_", "-"), extras


def _provided(requirement: str) -> set[str]:
    """The distributions a requirement brings: itself and the requirements of its
    extras (``psycopg[pool]``: psycopg-pool), by the installed metadata."""
    name, extras = _name(requirement)
    found = {name}
    for extra in extras:
        for needed in importlib.metadata.requires(name) or ():
            if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", needed):
                found |= _provided(needed.split(";")[0])
    return found


def declared(extra: str | None) -> set[str]:
    """The distributions the library (None) or an extra (with the library) declares."""
    requirements = list(PYPROJECT["project"]["dependencies"])
    if extra is not None:
        requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    found: set[str] = set()
    for requirement in requirements:
        name, extras = _name(requirement)
        if name == NAME:  # a self-reference: the extras it names
            for included in extras:
                found |= declared(included)
        else:
            found |= _provided(requirement)
    return found


DISTRIBUTIONS = {
    module: {name.lower().replace("_", "-") for name in names}
    for module, names in importlib.metadata.packages_distributions().items()
}


def _distribution(module: str) -> str | None:
    """The distribution of a top-level import name; None for the standard library and
    the project itself."""
    if module in sys.stdlib_module_names or module in ("secondbox_scheduler", "__future__"):
        return None
    names = DISTRIBUTIONS.get(module)
    assert names, f"{module} is imported but installed by no distribution"
    return sorted(names)[0]


def _sources() -> dict[str, Path]:
    """Every module, by its path in the checkout (the layer folders, and the package's own
    files beside the links to them)."""
    found = {}
    for folder in ("domain", "projections", "infrastructure"):
        for path in (ROOT / folder).rglob("*.py"):
            found[path.relative_to(ROOT).as_posix()] = path
    package = ROOT / "secondbox_scheduler"
    for path in [*package.glob("*.py"), *(package / "testing").rglob("*.py")]:
        found[path.relative_to(ROOT).as_posix()] = path
    return found


SOURCES = _sources()


def _extra_of(relative: str) -> str | None:
    for prefix, extra in EXTRA_OF.items():
        if relative == prefix or relative.startswith(prefix + "/"):
            return extra
    return None


class Imports(ast.NodeVisitor):
    """A module's imports, by where they stand: top level, optional (``try`` with an
    ``except ImportError``), inside a function; ``if TYPE_CHECKING`` ones are left out."""

    def __init__(self) -> None:
        self.top: set[str] = set()
        self.optional: set[str] = set()
        self.lazy: set[str] = set()
        self.first_party_top: set[str] = set()
        self._depth = 0
        self._guarded = 0

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        guards = any(
            isinstance(handler.type, ast.Name)
            and handler.type.id in ("ImportError", "ModuleNotFoundError")
            for handler in node.handlers
        )
        self._guarded += guards
        for child in node.body:
            self.visit(child)
        self._guarded -= guards
        rest: list[ast.AST] = [*node.handlers, *node.orelse, *node.finalbody]
        for other in rest:
            self.visit(other)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def _add(self, module: str) -> None:
        top = module.split(".")[0]
        if self._guarded:
            self.optional.add(top)
        elif self._depth:
            self.lazy.add(top)
        else:
            self.top.add(top)
            if top == "secondbox_scheduler":
                self.first_party_top.add(module)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.level == 0:
            self._add(node.module)


def imports_of(path: Path) -> Imports:
    found = Imports()
    found.visit(ast.parse(path.read_text()))
    return found


IMPORTS = {relative: imports_of(path) for relative, path in SOURCES.items()}


def _everything() -> set[str]:
    found: set[str] = set()
    for extra in USER_EXTRAS:
        found |= declared(extra)
    return found


@pytest.mark.parametrize("relative", sorted(SOURCES))
def test_every_import_is_declared_in_its_extra(relative: str) -> None:
    imports = IMPORTS[relative]
    extra = _extra_of(relative)
    allowed = declared(extra)
    for module in sorted(imports.top):
        distribution = _distribution(module)
        assert distribution is None or distribution in allowed, (
            f"{relative} imports {module} ({distribution}) at its top level, which "
            f"[{extra or 'the library'}] does not declare"
        )
    lazy_extra = LAZY.get(relative)
    for module in sorted(imports.lazy):
        distribution = _distribution(module)
        if distribution is None or distribution in allowed:
            continue
        assert lazy_extra is not None, f"{relative} imports {module} in a function: say why"
        assert distribution in declared(lazy_extra), (relative, module, lazy_extra)
    for module in sorted(imports.optional):
        distribution = _distribution(module)
        assert distribution is None or distribution in _everything(), (relative, module)


def test_the_library_imports_no_module_of_an_extra_at_its_top_level() -> None:
    by_module = {}
    for relative in SOURCES:
        parts = relative.removesuffix(".py").removesuffix("/__init__").split("/")
        if parts[0] != "secondbox_scheduler":
            parts = ["secondbox_scheduler", *parts]
        by_module[".".join(parts)] = relative
    for relative, imports in IMPORTS.items():
        if _extra_of(relative) is not None:
            continue
        for module in imports.first_party_top:
            target = by_module.get(module) or by_module.get(module.rsplit(".", 1)[0])
            if target is not None:
                assert _extra_of(target) is None, f"{relative} imports {module} ({target})"


def test_the_library_declares_eventsourcing_psycopg_and_pydantic_only() -> None:
    names = {_name(r)[0] for r in PYPROJECT["project"]["dependencies"]}
    assert names == set(CORE)


def test_every_declared_distribution_is_imported_somewhere() -> None:
    imported = {
        _distribution(module)
        for imports in IMPORTS.values()
        for module in imports.top | imports.lazy | imports.optional
    }
    for extra in USER_EXTRAS:
        for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
            name, _ = _name(requirement)
            if name != NAME:
                assert name in imported, f"[{extra}] declares {name}, which nothing imports"


def test_all_brings_every_extra_a_user_runs() -> None:
    assert declared("all") == _everything()
    assert declared("bench") >= declared("server") >= declared("cli")


@pytest.mark.parametrize("extra", USER_EXTRAS)
def test_the_missing_extra_messages_name_what_pyproject_declares(extra: str) -> None:
    """infrastructure/extras.py: the modules each extra brings are the ones pyproject.toml
    declares for it (so a command never names the wrong extra)."""
    wanted = {_distribution(module) for module in modules_of(extra)}
    assert wanted <= declared(extra), (extra, wanted - declared(extra))
    own = {
        _name(r)[0]
        for r in PYPROJECT["project"]["optional-dependencies"][extra]
        if _name(r)[0] != NAME
    }
    assert {_distribution(module) for module in EXTRA_MODULES[extra]} == own
    for included in INCLUDES.get(extra, ()):
        assert f"{NAME}[" in " ".join(PYPROJECT["project"]["optional-dependencies"][extra])
        assert declared(included) <= declared(extra)
