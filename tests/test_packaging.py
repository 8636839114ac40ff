"""The wheel: one import name, ``secondbox_scheduler``, beside a host's own packages; a
lean install without extras that runs README's embedding example; ``bench`` from its
extra.

An embedding application usually has packages named ``domain``, ``projections`` or
``infrastructure`` of its own. The wheel must install nothing under those names at top
level, and everything must import from ``secondbox_scheduler`` while the host's
``domain`` stays the host's.

The wheel is built from a copy of the source tree (so no ``build/`` is left in the
checkout) and installed without dependencies into a new virtual environment; the
dependencies, already installed for the tests, are made visible to it by a path file,
so that the test needs no network. Only the wheel's own files land in its
site-packages.

The lean install is real: ``pip install secondbox_scheduler-*.whl`` (no extras) into a
new virtual environment, its dependencies resolved by pip as an embedder's would be
(from pip's cache or the package index this machine is set up with), once per run of
the tests. There, with only eventsourcing, psycopg, pydantic and what they need:
README's embedding example runs, every module of the library imports, and the console
script says in one line that the command line needs ``[cli]``. Then ``[bench]`` is
installed into the same environment and a small ``bench`` runs its HTTP section (which
failed from a wheel before: ``No module named 'httpx'``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest

import secondbox_scheduler

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "secondbox_scheduler", "domain", "projections",
           "infrastructure")  # fmt: skip
README = ROOT / "README.md"
OPTIONAL = ("typer", "rich", "fastapi", "starlette", "uvicorn", "prometheus_client", "httpx",
            "orjson", "hypothesis", "yaml", "click", "cryptography")  # fmt: skip
# the modules of the extras (infrastructure/extras.py): imported only with them
NOT_LIBRARY = ("secondbox_scheduler.infrastructure.cli", "secondbox_scheduler.infrastructure.http",
               "secondbox_scheduler.infrastructure.prometheus_export",
               "secondbox_scheduler.infrastructure.tools.bench", "secondbox_scheduler.testing",
               "secondbox_scheduler.__main__")  # fmt: skip
PIP_TIMEOUT = 900  # seconds: resolving and unpacking the dependencies on a busy machine


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source, tree / name, symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )  # fmt: skip
        else:
            shutil.copy2(source, tree / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(out), str(tree)],
        check=True, capture_output=True,
    )  # fmt: skip
    (built,) = out.glob("secondbox_scheduler-*.whl")
    return built


def test_the_wheel_holds_only_the_secondbox_scheduler_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names}
    version = secondbox_scheduler.__version__
    assert tops == {"secondbox_scheduler", f"secondbox_scheduler-{version}.dist-info"}
    for layer in ("domain", "projections", "infrastructure"):
        assert f"secondbox_scheduler/{layer}/py.typed" in names
        # every module of the layer, subpackages included (setuptools lists them by name)
        for module in (ROOT / layer).rglob("*.py"):
            assert f"secondbox_scheduler/{layer}/{module.relative_to(ROOT / layer)}" in names
    assert "secondbox_scheduler/py.typed" in names
    for module in (ROOT / "secondbox_scheduler" / "testing").glob("*.py"):
        assert f"secondbox_scheduler/testing/{module.name}" in names


def test_the_installed_wheel_imports_beside_a_hosts_own_domain_package(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    before = {path.name for path in site.iterdir()}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    added = {path.name for path in site.iterdir()} - before
    version = secondbox_scheduler.__version__
    assert added == {"secondbox_scheduler", f"secondbox_scheduler-{version}.dist-info"}
    for layer in ("domain", "projections", "infrastructure"):
        assert not (site / layer).exists()
    # the dependencies installed for the tests, visible after the venv's own packages
    dependencies = sysconfig.get_paths()["purelib"]
    (site / "zz_test_dependencies.pth").write_text(dependencies + "\n")

    host = tmp_path / "host"
    (host / "domain").mkdir(parents=True)
    (host / "domain" / "__init__.py").write_text("OWNER = 'host'\n")
    (host / "domain" / "assignment.py").write_text("OWNER = 'host assignment'\n")
    probe = textwrap.dedent(
        """
        import json, domain, domain.assignment
        import secondbox_scheduler
        from secondbox_scheduler import (
            Capacity, Requirements, SchedulerApplication, PostgresStore, select_runner,
            InvalidRequestError,
        )
        from secondbox_scheduler.domain import Capacity as DomainCapacity
        from secondbox_scheduler.infrastructure import SchedulerApplication as App
        app = SchedulerApplication(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})
        app.register_runner(
            runner_id="r1", pool_name="p", backend_kind="firecracker", architecture="x86_64",
            capabilities={"compute"}, allocatable=Capacity(vcpu_count=1),
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )
        from secondbox_scheduler.testing import runner_snapshots, requirements
        from hypothesis import given, settings
        drawn = []

        @settings(max_examples=5, database=None)
        @given(runner=runner_snapshots("r7"), wanted=requirements())
        def embedder_property(runner, wanted):
            drawn.append((runner.id, type(wanted).__name__))

        embedder_property()
        print(json.dumps({
            "testing": sorted(set(drawn)),
            "host": [domain.OWNER, domain.assignment.OWNER],
            "package": secondbox_scheduler.__file__,
            "layer": secondbox_scheduler.domain.__file__,
            "same": [Capacity is DomainCapacity, SchedulerApplication is App],
            "runner": app.get_runner("r1").id,
            "names": sorted(secondbox_scheduler.__all__),
        }))
        """
    )
    result = subprocess.run(
        [str(python), "-c", probe], cwd=host, check=True, capture_output=True, text=True
    )
    found = json.loads(result.stdout)
    assert found["host"] == ["host", "host assignment"]
    assert found["package"].startswith(str(site))
    assert found["layer"].startswith(str(site / "secondbox_scheduler" / "domain"))
    assert found["same"] == [True, True]
    assert found["runner"] == "r1"
    assert found["testing"] == [["r7", "Requirements"]]
    assert set(found["names"]) >= {"SchedulerApplication", "PostgresStore", "select_runner"}


LEAN_PROBE = """
import importlib, json, pkgutil, sys
import secondbox_scheduler
skip = tuple(sys.argv[1].split(","))
failed = {}
for module in pkgutil.walk_packages(secondbox_scheduler.__path__, "secondbox_scheduler."):
    if module.name.startswith(skip):
        continue
    try:
        importlib.import_module(module.name)
    except Exception as error:
        failed[module.name] = f"{type(error).__name__}: {error}"
optional = {name: importlib.util.find_spec(name) is not None for name in sys.argv[2].split(",")}
print(json.dumps({"failed": failed, "optional": optional}))
"""


@pytest.fixture(scope="module")
def lean(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``pip install`` of the wheel without extras into a new environment, and what was
    found there right after (before ``[bench]`` is added to it)."""
    root = tmp_path_factory.mktemp("lean")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=PIP_TIMEOUT,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    found: dict[str, Any] = {"venv": venv, "python": python}
    probe = subprocess.run(
        [str(python), "-c", LEAN_PROBE, ",".join(NOT_LIBRARY), ",".join(OPTIONAL)],
        capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    found.update(json.loads(probe.stdout))
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)[:1]
    example = root / "example"
    example.mkdir()
    check = block + (
        "\nprint(app.get_assignment('sbx-1', 1).state, "
        "app.get_runner('runner-1').reserved.instances)\n"
    )
    found["readme"] = subprocess.run(
        [str(python), "-c", check], capture_output=True, text=True, timeout=300, cwd=example
    )
    found["readme_db"] = (example / "scheduler.db").exists()
    found["cli"] = subprocess.run(
        [str(venv / "bin" / "secondbox-scheduler"), "--version"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return found


def test_a_lean_install_brings_none_of_the_extras(lean: dict[str, Any]) -> None:
    assert lean["optional"] == dict.fromkeys(OPTIONAL, False)


def test_a_lean_install_runs_the_readme_embedding_example(lean: dict[str, Any]) -> None:
    readme = lean["readme"]
    assert readme.returncode == 0, readme.stderr
    assert readme.stdout.split() == ["released", "0"]
    assert lean["readme_db"]


def test_every_module_of_the_library_imports_without_extras(lean: dict[str, Any]) -> None:
    assert lean["failed"] == {}


def test_without_the_cli_extra_the_command_says_so_in_one_line(lean: dict[str, Any]) -> None:
    cli = lean["cli"]
    assert cli.returncode == 2, (cli.stdout, cli.stderr)
    assert cli.stderr.splitlines() == [
        "error: the secondbox-scheduler command line needs the [cli] extra (no module named "
        "'typer'): pip install 'secondbox-scheduler[cli]'"
    ]


def test_bench_runs_from_its_extra(lean: dict[str, Any], wheel: Path, tmp_path: Path) -> None:
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(lean["python"]), "install", "--quiet",
         "--disable-pip-version-check", f"{wheel}[bench]"],
        capture_output=True, text=True, timeout=PIP_TIMEOUT,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    bench = subprocess.run(
        [str(lean["venv"] / "bin" / "secondbox-scheduler"), "bench", "--quick", "--only", "http",
         "--workers", "1", "--runners", "5", "--seconds", "0.3", "--database-url",
         f"sqlite:///{tmp_path / 'bench.db'}", "--json"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = json.loads(bench.stdout)
    assert report["http"]["placed"] > 0
