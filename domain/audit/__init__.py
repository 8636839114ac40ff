"""Audit: the fold that re-checks every invariant over the log, and the hash chain."""
