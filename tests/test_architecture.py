"""The shape of the code, checked: layers import downward only, no import cycle (not
even under ``TYPE_CHECKING`` or inside a function), small modules, a slim application
service, and the placement decision in one place (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "secondbox_scheduler"
LAYERS = ("domain", "projections", "infrastructure")  # lowest first
MAX_MODULE_LINES = 600
MAX_APPLICATION_LINES = 500


def _modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name."""
    found: dict[str, Path] = {}
    sources = [(ROOT / layer, f"{PACKAGE}.{layer}") for layer in LAYERS]
    sources.append((ROOT / PACKAGE, PACKAGE))
    for folder, prefix in sources:
        for path in folder.rglob("*.py"):
            in_links = path.is_relative_to(ROOT / PACKAGE) and path.parent != ROOT / PACKAGE
            if in_links and not path.is_relative_to(ROOT / PACKAGE / "testing"):
                continue  # the links to the layer folders, read from the folders
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, wherever the import stands."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for candidate in candidates:
            if candidate in MODULES and candidate != name:
                targets.add(candidate)
    return targets


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_the_modules_are_found() -> None:
    assert f"{PACKAGE}.domain.placement.deciding" in MODULES
    assert f"{PACKAGE}.infrastructure.application" in MODULES
    assert len(MODULES) > 100


def test_no_import_cycle() -> None:
    assert _cycles() == []


def test_a_planted_cycle_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    domain_values = f"{PACKAGE}.domain.values"
    errors = f"{PACKAGE}.domain.errors"
    monkeypatch.setitem(GRAPH, errors, GRAPH[errors] | {domain_values})
    monkeypatch.setitem(GRAPH, domain_values, GRAPH[domain_values] | {errors})
    assert any({errors, domain_values} <= set(cycle) for cycle in _cycles())


def test_layers_import_downward_only() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if (mine := _layer(module)) is not None
        and (theirs := _layer(target)) is not None
        and theirs > mine
    ]
    assert upward == []


def test_no_module_over_600_lines() -> None:
    long = {
        name: lines
        for name, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_the_application_service_is_slim() -> None:
    path = MODULES[f"{PACKAGE}.infrastructure.application"]
    tree = ast.parse(path.read_text())
    (service,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "SchedulerApplication"
    ]
    assert service.end_lineno is not None
    assert service.end_lineno - service.lineno + 1 <= MAX_APPLICATION_LINES


def test_the_placement_decision_exists_once() -> None:
    """Only the domain's decision fences a sandbox and reserves on a runner; every other
    module (and the tests' helpers) calls it."""
    deciding = f"{PACKAGE}.domain.placement.deciding"
    places = sorted(
        name for name, path in MODULES.items() if ".fence(" in path.read_text() and name != deciding
    )
    assert places == []
    helpers = (ROOT / "tests" / "aggregates.py").read_text()
    assert ".fence(" not in helpers
    assert "decide_placement(" in helpers
