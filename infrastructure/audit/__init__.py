"""Audit and what-if replay over a stored history (I/O side of domain.audit and domain.whatif)."""
