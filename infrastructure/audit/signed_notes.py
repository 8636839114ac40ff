"""Signed checkpoints: C2SP ``tlog-checkpoint`` bodies in C2SP ``signed-note`` form, with
Ed25519 keys (docs/audit.md, "Signed checkpoints").

A checkpoint's body is three lines: the log's origin, the tree size in decimal, the
tree head in standard base64; each line ends with a newline. The note is the body, a
blank line, then one signature line per signer: ``— <key name> <base64(4-byte key hash
|| 64-byte Ed25519 signature over the body)>`` (an em dash, U+2014). A key's hash is the
first four bytes of ``SHA-256(name || 0x0A || 0x01 || 32-byte public key)``. The
verifier key is ``<name>+<8 hex digits of key hash>+<base64(0x01 || public key)>``; the
private key file holds ``PRIVATE+KEY+<name>+<8 hex digits>+<base64(0x01 || 32-byte
seed)>`` (the form of Go's ``golang.org/x/mod/sumdb/note``, which the C2SP spec derives
from). A witness adds a signature line of its own key in the same form.

Ed25519 is ``cryptography``'s, imported when a key is used: it comes with the ``[cli]``
extra (the command line and ``serve``, which includes it); parsing needs nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from secondbox_scheduler.infrastructure.extras import MissingExtraError

ED25519 = 0x01  # the signed-note algorithm byte of Ed25519
DASH = "\u2014"  # the em dash that starts a signature line
PRIVATE_PREFIX = "PRIVATE+KEY+"
MAX_NOTE_BYTES = 1 << 20  # a checkpoint note is a few hundred bytes; refuse far more
MAX_SIGNATURES = 100


class NoteError(ValueError):
    """A key, note or checkpoint that is malformed, or a signature that does not verify."""


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - the [cli] extra is missing
        raise MissingExtraError("cli", "cryptography", "signed checkpoints") from None
    return ed25519


def valid_name(name: str) -> bool:
    """A key name: not empty, no ``+``, no whitespace, no control character."""
    return (
        bool(name)
        and "+" not in name
        and not any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    )


def key_hash(name: str, public: bytes) -> int:
    return int.from_bytes(
        hashlib.sha256(name.encode() + b"\n" + bytes([ED25519]) + public).digest()[:4], "big"
    )


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise NoteError(f"{what}: not standard base64") from None


def _key_parts(text: str, what: str) -> tuple[str, int, bytes]:
    parts = text.strip().split("+", 2)
    if len(parts) != 3 or not valid_name(parts[0]) or not re.fullmatch(r"[0-9a-f]{8}", parts[1]):
        raise NoteError(f"{what}: not NAME+8 hex digits+base64 key")
    raw = _b64decode(parts[2], what)
    if len(raw) != 33 or raw[0] != ED25519:
        raise NoteError(f"{what}: not an Ed25519 key (0x01 and 32 bytes)")
    return parts[0], int(parts[1], 16), raw[1:]


@dataclass(frozen=True)
class Verifier:
    """A verifier key: the name, its key hash and the Ed25519 public key."""

    name: str
    hash: int
    public: bytes

    @classmethod
    def parse(cls, text: str) -> Verifier:
        name, hash_, public = _key_parts(text, "verifier key")
        if key_hash(name, public) != hash_:
            raise NoteError("verifier key: its key hash is not that of its name and key")
        return cls(name, hash_, public)

    def __str__(self) -> str:
        encoded = base64.b64encode(bytes([ED25519]) + self.public).decode()
        return f"{self.name}+{self.hash:08x}+{encoded}"

    def verifies(self, message: bytes, signature: bytes) -> bool:
        ed25519 = _ed25519()
        from cryptography.exceptions import InvalidSignature

        try:
            ed25519.Ed25519PublicKey.from_public_bytes(self.public).verify(signature, message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class Signer:
    """A private key: the name and the Ed25519 seed (32 bytes)."""

    name: str
    seed: bytes = field(repr=False)

    @classmethod
    def generate(cls, name: str) -> Signer:
        if not valid_name(name):
            raise NoteError(
                f"key name {name!r}: give a name without '+', whitespace or control characters"
            )
        from cryptography.hazmat.primitives import serialization

        key = _ed25519().Ed25519PrivateKey.generate()
        seed = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return cls(name, seed)

    @classmethod
    def parse(cls, text: str) -> Signer:
        text = text.strip()
        if not text.startswith(PRIVATE_PREFIX):
            raise NoteError("private key: not PRIVATE+KEY+NAME+HASH+KEY")
        name, hash_, seed = _key_parts(text[len(PRIVATE_PREFIX) :], "private key")
        signer = cls(name, seed)
        if signer.verifier.hash != hash_:
            raise NoteError("private key: its key hash is not that of its name and key")
        return signer

    def _key(self) -> Any:
        return _ed25519().Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def verifier(self) -> Verifier:
        from cryptography.hazmat.primitives import serialization

        public = (
            self._key()
            .public_key()
            .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        )
        return Verifier(self.name, key_hash(self.name, public), public)

    def __str__(self) -> str:
        encoded = base64.b64encode(bytes([ED25519]) + self.seed).decode()
        return f"{PRIVATE_PREFIX}{self.name}+{self.verifier.hash:08x}+{encoded}"

    def sign(self, message: bytes) -> bytes:
        return bytes(self._key().sign(message))


@dataclass(frozen=True)
class Signature:
    name: str
    hash: int
    signature: bytes

    def line(self) -> str:
        encoded = base64.b64encode(self.hash.to_bytes(4, "big") + self.signature).decode()
        return f"{DASH} {self.name} {encoded}\n"


@dataclass(frozen=True)
class Note:
    """A signed note: its text (ending with a newline) and its signature lines."""

    text: str
    signatures: tuple[Signature, ...] = ()

    @classmethod
    def parse(cls, note: str | bytes) -> Note:
        raw = note.encode() if isinstance(note, str) else note
        if len(raw) > MAX_NOTE_BYTES:
            raise NoteError(f"note: more than {MAX_NOTE_BYTES} bytes")
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise NoteError("note: not UTF-8") from None
        if any((ord(c) < 0x20 and c != "\n") or ord(c) == 0x7F for c in decoded):
            raise NoteError("note: a control character other than newline")
        split = decoded.rfind("\n\n")
        if split < 0 or not decoded.endswith("\n"):
            raise NoteError("note: no blank line before the signatures, or no final newline")
        text, lines = decoded[: split + 1], decoded[split + 2 :].splitlines()
        if not lines:
            raise NoteError("note: no signature")
        if len(lines) > MAX_SIGNATURES:
            raise NoteError(f"note: more than {MAX_SIGNATURES} signatures")
        signatures = []
        for line in lines:
            found = re.fullmatch(f"{DASH} (\\S+) (\\S+)", line)
            if found is None or not valid_name(found.group(1)):
                raise NoteError(f"note: a malformed signature line {line[:80]!r}")
            blob = _b64decode(found.group(2), "signature")
            if len(blob) < 5:
                raise NoteError("signature: shorter than a key hash and a signature")
            signatures.append(Signature(found.group(1), int.from_bytes(blob[:4], "big"), blob[4:]))
        return cls(text, tuple(signatures))

    def __str__(self) -> str:
        return self.text + "\n" + "".join(s.line() for s in self.signatures)

    def signed(self, signer: Signer) -> Note:
        """This note with ``signer``'s signature added (one per key: a second replaces
        none, it is refused)."""
        verifier = signer.verifier
        if any(s.name == verifier.name and s.hash == verifier.hash for s in self.signatures):
            raise NoteError(f"the note is signed by {verifier.name} already")
        signature = Signature(verifier.name, verifier.hash, signer.sign(self.text.encode()))
        return Note(self.text, (*self.signatures, signature))

    def verified_by(self, verifier: Verifier) -> bool:
        """Whether a signature line of ``verifier``'s name and key hash verifies."""
        return any(
            s.name == verifier.name
            and s.hash == verifier.hash
            and len(s.signature) == 64
            and verifier.verifies(self.text.encode(), s.signature)
            for s in self.signatures
        )


@dataclass(frozen=True)
class SignedCheckpoint:
    """A C2SP ``tlog-checkpoint``: origin, tree size, tree head (and extension lines)."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def body(self) -> str:
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode()]
        return "".join(f"{line}\n" for line in [*lines, *self.extensions])

    @classmethod
    def from_body(cls, text: str) -> SignedCheckpoint:
        lines = text.split("\n")
        if len(lines) < 4 or lines[-1] != "":
            raise NoteError("checkpoint: not origin, size and root hash lines")
        origin, size, root, *extensions = lines[:-1]
        if not origin or origin != origin.strip():
            raise NoteError("checkpoint: an empty origin, or one with surrounding spaces")
        if not re.fullmatch(r"0|[1-9][0-9]{0,18}", size):
            raise NoteError("checkpoint: the tree size is not a decimal without leading zeros")
        digest = _b64decode(root, "checkpoint root hash")
        if len(digest) != 32:
            raise NoteError("checkpoint: the root hash is not 32 bytes")
        if any(not line for line in extensions):
            raise NoteError("checkpoint: an empty extension line")
        return cls(origin, int(size), digest, tuple(extensions))


def parse_checkpoint_note(text: str | bytes) -> tuple[Note, SignedCheckpoint]:
    note = Note.parse(text)
    return note, SignedCheckpoint.from_body(note.text)


def looks_like_note(text: str) -> bool:
    """Whether ``text`` is a signed note rather than ``POSITION:DIGEST`` or a file name."""
    return "\n\n" in text and DASH in text


def load_signer(value: str) -> Signer:
    """A private key given as itself (``PRIVATE+KEY+...``) or as the path of its file."""
    if value.strip().startswith(PRIVATE_PREFIX):
        return Signer.parse(value)
    try:
        with open(value, encoding="utf-8") as file:
            text = file.read(4096)
    except (OSError, UnicodeDecodeError) as error:
        raise NoteError(f"private key file {value!r}: {error}") from None
    return Signer.parse(text)


def load_verifier(value: str) -> Verifier:
    """A verifier key given as itself (``NAME+HASH+KEY``) or as the path of its file."""
    try:
        with open(value, encoding="utf-8") as file:
            value = file.read(4096)
    except (OSError, UnicodeDecodeError):
        pass  # not a file: the key itself
    return Verifier.parse(value)
