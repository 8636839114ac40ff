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


def test_readme_following_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second example (following the events) continues the first, and prints what
    the README shows after it."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    for block in blocks[:2]:
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    shown = text.split(blocks[1], 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    assert printed == shown
