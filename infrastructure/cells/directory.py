"""The directory cell of an id: which cell keeps the claim (domain/cell_claims.py) that
says which cell holds a runner or sandbox id.

Rendezvous hashing: each directory cell scores SHA-256(cell name, kind, id) and the
highest score wins. It depends on the id and the directory cells' names alone, so every
router reading the same cells file agrees without talking to the others, and the
directory spreads evenly over the cells. The directory cells therefore never change
once ids are claimed (a cell added later says ``directory = false``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def directory_cell(directory_cells: Sequence[str], kind: str, subject_id: str) -> str:
    """The cell among ``directory_cells`` that keeps the claim of ``kind`` ``subject_id``."""
    if not directory_cells:
        raise ValueError("no directory cell")
    key = f"{kind}\x00{subject_id}".encode()

    def score(cell: str) -> bytes:
        return hashlib.sha256(cell.encode() + b"\x00" + key).digest()

    return max(directory_cells, key=score)
