"""The README's embedding example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_embedding_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README has a python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    app = namespace["app"]
    assignment = app.get_assignment("sbx-1", 1)  # type: ignore[attr-defined]
    assert assignment.state == "released"
    assert (tmp_path / "scheduler.db").exists()
