"""Cells: pools on several PostgreSQL clusters (docs/operations.md, "Cells").

``config`` reads the cells file (``--cells FILE``, ``SECONDBOX_CELLS``); ``directory``
says which cell keeps the claim of an id; ``router`` holds :class:`CellRouter`, which
sends each command to its cell and reads across them; ``federation`` audits every cell
and makes the federation checkpoint.
"""
