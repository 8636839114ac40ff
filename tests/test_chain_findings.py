"""The event chain's findings for deleted, planted and forked links, exactly.

Found by the mutation run of 2026-12-04 (docs/verification.md, section 5): the
store-level tamper tests check the kind of a finding more often than its position
and detail, so mutants of ``ChainVerifier._judge_orphan``, ``_missing`` and the
forked-link branch of ``feed`` survived. Here each case is fed to the verifier link by
link (``Chain.links`` over four events), and its findings are compared whole.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from secondbox_scheduler.domain.audit.chain import (
    Chain,
    ChainedEvent,
    ChainVerifier,
    Finding,
    Link,
)

EVENTS = [
    ChainedEvent(position, uuid.UUID(int=position), 1, f"topic{position}", b"{}")
    for position in (1, 2, 3, 4)
]
CHAIN = Chain(b"k")
LINKS = list(CHAIN.links(None, EVENTS))


def findings(
    fed: Sequence[tuple[ChainedEvent | None, Link | None]], stored: Sequence[Link] = ()
) -> list[Finding]:
    """Feed ``fed`` in order, then finish; ``stored``: the links a look-up finds."""
    by_position = {link.position: link for link in stored}
    verifier = ChainVerifier(CHAIN, lookup=by_position.get)
    for event, link in fed:
        verifier.feed(event, link)
    verifier.finish()
    return verifier.findings


def test_an_event_deleted_inside_the_log_leaves_a_link_the_next_one_follows() -> None:
    fed = [(EVENTS[0], LINKS[0]), (None, LINKS[1]), (EVENTS[2], LINKS[2]), (EVENTS[3], LINKS[3])]
    assert findings(fed) == [
        Finding(2, "deleted", "a chain link without its event (event deleted)")
    ]


def test_the_only_event_deleted_leaves_a_link_that_starts_the_chain() -> None:
    """Its link follows position 0, as the first link of a chain does: the event of a
    deleted first (and last) position, not a planted link."""
    detail = "a chain link without its event at the end of the log (event deleted)"
    assert findings([(None, LINKS[0])]) == [Finding(1, "deleted", detail)]


def test_a_link_planted_past_the_end_that_continues_nothing_is_a_stray() -> None:
    planted = Link(9, 5, bytes(32))
    fed = [(EVENTS[0], LINKS[0]), (EVENTS[1], LINKS[1]), (None, planted)]
    assert findings(fed) == [
        Finding(
            9,
            "stray-link",
            "a chain link at position 9 (following position 5) with no event at that "
            "position: no later link follows it (a link inserted; every later event is "
            "still checked against its own link)",
        )
    ]


def test_deleted_positions_at_the_start_and_inside_are_told_apart() -> None:
    start = [(EVENTS[1], LINKS[1]), (EVENTS[2], LINKS[2])]
    assert findings(start) == [
        Finding(
            1,
            "deleted",
            "the first link follows position 1, which is missing (the start of the chain "
            "was deleted)",
        )
    ]
    inside = [(EVENTS[0], LINKS[0]), (EVENTS[2], LINKS[2]), (EVENTS[3], LINKS[3])]
    assert findings(inside) == [
        Finding(
            2,
            "deleted",
            "the link at position 3 follows position 2, which is missing (events deleted "
            "after position 1)",
        )
    ]


def test_a_link_that_forks_from_an_earlier_one_is_an_edit() -> None:
    """The event at 3 is linked, with a right digest, to the link at 1 instead of the one
    at 2 (two links follow position 1): the log's order was changed."""
    forked = Link(3, 1, CHAIN.digest(LINKS[0], EVENTS[2]))
    fed = [(EVENTS[0], LINKS[0]), (EVENTS[1], LINKS[1]), (EVENTS[2], forked)]
    assert findings(fed, stored=LINKS[:2]) == [
        Finding(
            3,
            "edited",
            "its link follows position 1, not the link before it at position 2 (links "
            "reordered or forked)",
        )
    ]
