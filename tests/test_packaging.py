"""The wheel installs one import name, ``secondbox_scheduler``, beside a host's own packages.

An embedding application usually has packages named ``domain``, ``projections`` or
``infrastructure`` of its own. The wheel must install nothing under those names at top
level, and everything must import from ``secondbox_scheduler`` while the host's
``domain`` stays the host's.

The wheel is built from a copy of the source tree (so no ``build/`` is left in the
checkout) and installed without dependencies into a new virtual environment; the
dependencies, already installed for the tests, are made visible to it by a path file,
so that the test needs no network. Only the wheel's own files land in its
site-packages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

import secondbox_scheduler

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "secondbox_scheduler", "domain", "projections",
           "infrastructure")  # fmt: skip


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
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
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
