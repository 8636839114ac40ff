"""The steps of ``audit verify`` on one stored row, shared by the serial verify
(:mod:`.verify`) and its parts in several processes (:mod:`.parallel_verify`), so that
both judge a row alike: the violations of a row that cannot be decoded or folded (the
decoding and the fold stay inline on the hot loop), and feeding its chain link and
Merkle leaf. A row is the notification's ``notification_reader.Row``: position,
originator id, originator version, topic, state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from secondbox_scheduler.domain.audit.chain import ChainedEvent, ChainVerifier, Link
from secondbox_scheduler.domain.audit.merkle import MerkleRefold, leaf_data
from secondbox_scheduler.domain.audit.state import Violation
from secondbox_scheduler.projections.notification_reader import Row


def unreadable(row: Row, error: Exception) -> Violation:
    """The violation of a row whose event cannot be decoded."""
    return Violation(row[0], str(row[1]), str(row[3]).rpartition(":")[2], "unreadable",
                     f"the event cannot be decoded ({type(error).__name__})")  # fmt: skip


def unfoldable(row: Row, event: Any, error: Exception) -> Violation:
    """The violation of an event the fold cannot apply."""
    return Violation(row[0], str(row[1]), type(event).__qualname__, "unfoldable",
                     f"the fold cannot apply it ({type(error).__name__}: {error})")  # fmt: skip


def link_at(
    verifier: ChainVerifier, links: Sequence[Link], index: int, position: int
) -> tuple[int, Link | None]:
    """The links before ``position`` fed as links whose event was deleted; the index of
    the next link and the link at ``position`` (None: none)."""
    while index < len(links) and links[index].position < position:
        verifier.feed(None, links[index])  # a link whose event was deleted
        index += 1
    if index < len(links) and links[index].position == position:
        return index + 1, links[index]
    return index, None


def feed_row(
    verifier: ChainVerifier,
    refold: MerkleRefold,
    row: Row,
    link: Link | None,
    chained: bool,
) -> None:
    """The row's Merkle leaf added, and (``chained``) the row with its link fed."""
    position, originator_id, version, topic, state = row
    if type(state) is not bytes or type(topic) is not str:
        stored = state.encode() if isinstance(state, str) else bytes(state)
        row = (position, originator_id, version, str(topic), stored)
        topic, state = row[3], row[4]
    refold.add(position, leaf_data(position, originator_id, version, topic, state))
    if chained:
        verifier.feed(tuple.__new__(ChainedEvent, row), link)
