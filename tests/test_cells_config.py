"""The cells file: what it holds, and every way a bad one is refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.infrastructure.cells.config import load_cells, parse_cells
from secondbox_scheduler.infrastructure.cells.directory import directory_cell
from secondbox_scheduler.infrastructure.settings import settings_from_url

TWO_CELLS = """
[cells.east]
database_url = "postgresql://app:secret@pg-e1:5432,pg-e2:5433/scheduler?target_session_attrs=read-write"
pools = ["general", "gpu"]

[cells.west]
database_url = "postgresql://app@pg-w1/scheduler"
pools = ["edge"]
directory = false
"""


def test_a_cells_file_names_each_cell_its_store_and_its_pools(tmp_path: Path) -> None:
    path = tmp_path / "cells.toml"
    path.write_text(TWO_CELLS)
    config = load_cells(path)
    assert config.names == ("east", "west")
    assert config.cell_of_pool("gpu").name == "east"
    assert config.cell_of_pool("edge").name == "west"
    assert config.directory_cells == ("east",)
    assert config.cells[0].shown_url.startswith("postgresql://app:***@pg-e1:5432,pg-e2:5433/")
    settings = settings_from_url(config.cells[0].database_url)
    assert settings["POSTGRES_HOST"] == "pg-e1,pg-e2"
    assert settings["POSTGRES_PORT"] == "5432,5433"
    assert settings["POSTGRES_TARGET_SESSION_ATTRS"] == "read-write"


def test_a_pool_given_twice_is_refused_naming_both_cells() -> None:
    text = TWO_CELLS.replace('pools = ["edge"]', 'pools = ["edge", "gpu"]')
    with pytest.raises(InvalidRequestError) as caught:
        parse_cells(text)
    assert caught.value.field == "cells.west.pools"
    assert "'gpu'" in caught.value.rule
    assert "'east'" in caught.value.rule
    assert "'west'" in caught.value.rule


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("", "cells"),
        ("[cells]\n", "cells"),
        ("x = 1\n", "x"),
        ('[cells.a]\ndatabase_url = "postgresql://h/db"\n', "cells.a.pools"),
        ('[cells.a]\ndatabase_url = "postgresql://h/db"\npools = []\n', "cells.a.pools"),
        ('[cells.a]\ndatabase_url = "postgresql://h/db"\npools = ["p", "p"]\n', "cells.a.pools"),
        ('[cells.a]\npools = ["p"]\n', "cells.a.database_url"),
        ('[cells.a]\ndatabase_url = "mysql://h/db"\npools = ["p"]\n', "cells.a.database_url"),
        (
            '[cells.a]\ndatabase_url = "postgresql://h:99999/db"\npools = ["p"]\n',
            "cells.a.database_url",
        ),
        (
            '[cells.a]\ndatabase_url = "postgresql://h/db?target_session_attrs=bogus"\n'
            'pools = ["p"]\n',
            "cells.a.database_url",
        ),
        (
            '[cells.a]\ndatabase_url = "postgresql://h/db"\npools = ["p"]\nport = 1\n',
            "cells.a.port",
        ),
        ('[cells.A]\ndatabase_url = "postgresql://h/db"\npools = ["p"]\n', "cells.A"),
        (
            '[cells.a]\ndatabase_url = "postgresql://h/db"\npools = ["p"]\ndirectory = false\n',
            "cells",
        ),
        ("[cells.a]\n[cells.a]\n", "cells"),  # TOML refuses a table given twice
    ],
)
def test_a_bad_cells_file_is_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_cells(text)
    assert caught.value.field == field


def test_a_missing_cells_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="cannot read the cells file"):
        load_cells(tmp_path / "nowhere.toml")


def test_the_directory_cell_depends_on_the_id_and_the_directory_cells_alone() -> None:
    ids = [f"sbx-{n}" for n in range(400)]
    chosen = [directory_cell(["a", "b"], "sandbox", i) for i in ids]
    assert chosen == [directory_cell(["b", "a"], "sandbox", i) for i in ids]  # order-free
    assert 120 < chosen.count("a") < 280  # spread over both
    # a third directory cell takes ids only from the others, never moves one between them
    three = [directory_cell(["a", "b", "c"], "sandbox", i) for i in ids]
    assert all(new in (old, "c") for old, new in zip(chosen, three, strict=True))
