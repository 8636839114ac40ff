"""A command whose extra is missing says which in one line and exits 2
(infrastructure/extras.py); nothing runs. The modules are hidden from the import
system's finder, as in an installation without them."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from typer.testing import CliRunner

import secondbox_scheduler.infrastructure.extras as extras
from secondbox_scheduler.infrastructure.cli import cli


def hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name in modules else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(
    ("args", "hidden", "extra"),
    [
        (["serve", "--port", "0"], "uvicorn", "server"),
        (["serve"], "prometheus_client", "server"),
        (["bench", "--quick"], "httpx", "bench"),
        (["bench", "history"], "fastapi", "bench"),
    ],
)
def test_a_missing_extra_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, args: list[str], hidden: str, extra: str
) -> None:
    hide(monkeypatch, hidden)
    result = CliRunner().invoke(
        cli, [*args], env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"}
    )
    assert result.exit_code == 2, result.output
    command = args[0]
    assert result.stderr.splitlines() == [
        f"error: secondbox-scheduler {command} needs the [{extra}] extra (no module named "
        f"'{hidden}'): pip install 'secondbox-scheduler[{extra}]'"
    ]
    assert not (tmp_path / "x.db").exists()


def test_the_help_needs_no_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "fastapi", "uvicorn", "httpx")
    for command in ("serve", "bench"):
        shown = CliRunner().invoke(cli, [command, "--help"])
        assert shown.exit_code == 0, shown.output


def test_what_each_extra_needs() -> None:
    assert extras.modules_of("bench") == (
        "typer", "rich", "fastapi", "starlette", "uvicorn", "anyio", "prometheus_client", "httpx",
    )  # fmt: skip
    assert set(extras.modules_of("all")) == {
        module for modules in extras.EXTRA_MODULES.values() for module in modules
    }
