"""scripts/bootstrap.sh installs only when the project's dependencies changed.

The script runs as written, in a copy of the project whose ``.venv/bin/python`` is a
stand-in that logs how it is called (so no test installs anything): the first run
installs and stamps the hash of pyproject.toml; a run with the same pyproject.toml
installs nothing; a changed pyproject.toml, or ``SECONDBOX_REINSTALL=1``, installs
again; a failed install leaves no stamp, so that the next run tries again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
case "$1" in
  -V) echo "Python 3.11.99" ;;
  -m) if [ "$2" = pip ] && [ -f "$(dirname "$0")/../fail-install" ]; then exit 1; fi ;;
esac
exit 0
"""


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "bootstrap.sh", root / "scripts" / "bootstrap.sh")
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "secondbox-scheduler"):
        (bin_dir / name).write_text(FAKE_PYTHON)
        (bin_dir / name).chmod(0o755)
    return root


def bootstrap(root: Path, **env: str) -> tuple[int, list[str]]:
    """Run the script; its exit code and the pip installs it ran."""
    log = root / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    result = subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh")],
        env={**os.environ, "PYTHON": str(root / ".venv" / "bin" / "python"), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    calls = log.read_text().splitlines() if log.exists() else []
    return result.returncode, [call for call in calls if call.startswith("-m pip install")]


def test_it_installs_only_when_pyproject_changed(tmp_path: Path) -> None:
    root = project(tmp_path)
    assert bootstrap(root) == (0, ["-m pip install --quiet --disable-pip-version-check -e .[test]"])
    stamp = (root / ".venv" / ".secondbox-installed").read_text()
    assert stamp.split() == [stamp.split()[0], "Python", "3.11.99"]
    assert bootstrap(root) == (0, [])
    assert bootstrap(root) == (0, [])
    with (root / "pyproject.toml").open("a") as pyproject:
        pyproject.write("# a new dependency, say\n")
    code, installs = bootstrap(root)
    assert (code, len(installs)) == (0, 1)
    assert (root / ".venv" / ".secondbox-installed").read_text() != stamp
    assert bootstrap(root) == (0, [])
    code, installs = bootstrap(root, SECONDBOX_REINSTALL="1")
    assert (code, len(installs)) == (0, 1)


def test_a_failed_install_is_tried_again(tmp_path: Path) -> None:
    root = project(tmp_path)
    (root / ".venv" / "fail-install").write_text("")
    code, installs = bootstrap(root)
    assert (code != 0, len(installs)) == (True, 1)
    assert not (root / ".venv" / ".secondbox-installed").exists()
    (root / ".venv" / "fail-install").unlink()
    code, installs = bootstrap(root)
    assert (code, len(installs)) == (0, 1)
    assert bootstrap(root) == (0, [])
