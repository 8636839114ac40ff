"""The steps of ``audit verify`` on one stored row, shared by the serial verify
(:mod:`.verify`) and its parts in several processes (:mod:`.parallel_verify`), so that
both judge a row alike: the violations of a row that cannot be decoded or folded (the
decoding and the fold stay inline on the hot loop), and feeding its chain link and
Merkle leaf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from secondbox_scheduler.domain.audit.chain import ChainedEvent, ChainVerifier, Link
from secondbox_scheduler.domain.audit.merkle import MerkleRefold, leaf_data
from secondbox_scheduler.domain.audit.state import Violation


def unreadable(notification: Any, error: Exception) -> Violation:
    """The violation of a row whose event cannot be decoded."""
    return Violation(notification.id, str(notification.originator_id),
                     notification.topic.rpartition(":")[2], "unreadable",
                     f"the event cannot be decoded ({type(error).__name__})")  # fmt: skip


def unfoldable(notification: Any, event: Any, error: Exception) -> Violation:
    """The violation of an event the fold cannot apply."""
    return Violation(notification.id, str(notification.originator_id),
                     type(event).__qualname__, "unfoldable",
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
    notification: Any,
    link: Link | None,
    chained: bool,
) -> None:
    """The row's Merkle leaf added, and (``chained``) the row with its link fed."""
    state: Any = notification.state
    stored = state.encode() if isinstance(state, str) else bytes(state)
    topic = str(notification.topic)
    position, originator_id = notification.id, notification.originator_id
    version = notification.originator_version
    refold.add(position, leaf_data(position, originator_id, version, topic, stored))
    if chained:
        verifier.feed(ChainedEvent(position, originator_id, version, topic, stored), link)
