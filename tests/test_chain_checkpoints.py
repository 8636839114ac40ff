"""Audit checkpoints on the pure event chain (domain/audit/chain.py), exactly.

Found by the mutation run of 2026-12-01 (docs/verification.md, section 5): most of the
surviving mutants of ``domain/audit/chain.py`` were in ``Checkpoint.parse`` and
``ChainVerifier.check``, which the store-level tests reach only through a valid
checkpoint. Here each outcome of a checkpoint is checked on its own, with its exact
finding (position, kind, detail), on a chain made by ``Chain.links`` and fed to the
verifier event by event. A pinned digest guards the link and seal formats.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

from secondbox_scheduler.domain.audit.chain import (
    Chain,
    ChainedEvent,
    ChainVerifier,
    Checkpoint,
    Finding,
)

EVENTS = [
    ChainedEvent(position, uuid.UUID(int=position), 1, f"topic{position}", b"{}")
    for position in (1, 2, 3)
]
HEX = "ab" * 32


def verified(checkpoint: Checkpoint | bytes, key: bytes | None = b"k") -> list[Finding]:
    chain = Chain(key)
    verifier = ChainVerifier(chain)
    verifier.expect(checkpoint)
    for event, link in zip(EVENTS, chain.links(None, EVENTS), strict=True):
        verifier.feed(event, link)
    verifier.check(checkpoint)
    return verifier.findings


def links() -> list[bytes]:
    return [link.digest for link in Chain(b"k").links(None, EVENTS)]


def test_parse_a_checkpoint_with_and_without_its_position() -> None:
    assert Checkpoint.parse(f"12:{HEX}") == Checkpoint(12, bytes.fromhex(HEX))
    assert Checkpoint.parse(f" {HEX.upper()}\n") == bytes.fromhex(HEX)  # digest only
    assert Checkpoint.parse(f"0:{HEX.upper()}") == Checkpoint(0, bytes.fromhex(HEX))
    assert str(Checkpoint(12, bytes.fromhex(HEX))) == f"12:{HEX}"


@pytest.mark.parametrize("text", ["", "12:", HEX[:-1], f"{HEX}0", f"x:{HEX}", f"-1:{HEX}"])
def test_parse_refuses_what_is_not_a_checkpoint(text: str) -> None:
    with pytest.raises(ValueError, match="POSITION:DIGEST or DIGEST"):
        Checkpoint.parse(text)


def test_a_checkpoint_the_log_extends_finds_nothing() -> None:
    digests = links()
    assert verified(Checkpoint(2, digests[1])) == []
    assert verified(digests[2]) == []


def test_a_digest_no_link_has_is_rewritten_after_the_last_position() -> None:
    assert verified(bytes(32)) == [
        Finding(4, "rewritten", "no link of the log has the checkpoint's digest "
                "(truncated or rewritten)"),
    ]  # fmt: skip


def test_a_checkpoint_past_the_end_is_truncated() -> None:
    assert verified(Checkpoint(9, links()[2])) == [
        Finding(4, "truncated", "the log ends at position 3, before the checkpoint's position 9")
    ]


def test_a_checkpoint_whose_position_has_no_link_is_rewritten() -> None:
    chain = Chain(b"k")
    verifier = ChainVerifier(chain)
    checkpoint = Checkpoint(2, links()[1])
    verifier.expect(checkpoint)
    made = chain.links(None, [EVENTS[0], EVENTS[2]])  # position 2 never linked
    verifier.feed(EVENTS[0], made[0])
    verifier.feed(EVENTS[2], made[1])
    verifier.check(checkpoint)
    assert verifier.findings == [Finding(2, "rewritten", "no link at the checkpoint's position")]


def test_a_checkpoint_with_another_digest_is_rewritten() -> None:
    assert verified(Checkpoint(2, links()[2])) == [
        Finding(2, "rewritten", "the digest there differs from the checkpoint's (history "
                "rewritten, or another audit key)"),
    ]  # fmt: skip
    assert verified(Checkpoint(2, links()[1]), key=None)[0].kind == "rewritten"  # another key


def test_the_link_and_seal_formats_are_pinned() -> None:
    """A change of the bytes a digest covers breaks every stored chain: pinned here."""
    unkeyed = Chain().links(None, EVENTS[:1])[0]
    assert (unkeyed.position, unkeyed.previous) == (1, 0)
    assert unkeyed.digest == hashlib.sha256(
        b"secondbox-chain-v1" + bytes(32) + (0).to_bytes(8, "big") + (1).to_bytes(8, "big")
        + (16).to_bytes(8, "big") + uuid.UUID(int=1).bytes + (1).to_bytes(8, "big")
        + (6).to_bytes(8, "big") + b"topic1" + (2).to_bytes(8, "big") + b"{}"
    ).digest()  # fmt: skip
    seal = Chain().seal(b"d", "s1", 3, "T", b"x")
    assert seal == hashlib.sha256(
        b"secondbox-snapshot-seal-v1" + (1).to_bytes(8, "big") + b"d"
        + (2).to_bytes(8, "big") + b"s1" + (3).to_bytes(8, "big")
        + (1).to_bytes(8, "big") + b"T" + (1).to_bytes(8, "big") + b"x"
    ).digest()  # fmt: skip
    assert Chain(b"k").seal(b"d", "s1", 3, "T", b"x") != seal
