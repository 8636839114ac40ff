"""Bounds on every input: the documented limits (docs/operations.md, "Limits").

A value past a limit is refused with :class:`InvalidRequestError` naming the field and
the rule, before anything is written. Identifiers and names are short, printable
Unicode (no control, format, separator, private-use or unassigned characters, no lone
surrogates, which no store can encode, no leading or trailing whitespace); free
text (map values) may be longer; collections are bounded so that no event, snapshot or
read-model row can be made arbitrarily large by a caller.
"""

from __future__ import annotations

import unicodedata
from datetime import UTC, datetime, timedelta

from secondbox_scheduler.domain.errors import InvalidRequestError

MAX_NAME_LENGTH = 256  # ids, names, digests, capability names, proof keys' and maps' keys
MAX_TEXT_LENGTH = 4096  # values of string maps (resolved artifacts, assignment command)
MIN_FENCING_TOKEN_BYTES = 32
MAX_FENCING_TOKEN_BYTES = 512
MAX_ITEMS = 64  # capabilities, egress contexts, digests, materializations, map entries
MAX_PROOF_ENTRIES = 16
MAX_PROOF_VALUE_LENGTH = 1024
MAX_HEARTBEAT_TIMEOUT = timedelta(days=1)
# The most a runner may have reserved on any one dimension, checked or not (the read
# models store reserved totals as BIGINT): with "physical-storage-admission" disk is not
# checked against allocatable, and this alone bounds the sum of its reservations.
MAX_RESERVED_TOTAL = 2**63 - 1
MAX_CLAIM_DURATION = timedelta(hours=1)  # claim_reconcile: until - now
MAX_DEADLINE_AHEAD = timedelta(days=7)  # ScheduleRequest deadlines after its now
MAX_RETRY_LIMIT = 1000  # an assignment's failure retries
MAX_SERIALIZATION_RETRY_LIMIT = 4096  # lost optimistic-concurrency races per call
# Every time field of an HTTP body lies in [EARLIEST_TIME, LATEST_TIME) (the clock checks
# bound some of them closer): no stored time is so far out that arithmetic on it fails.
EARLIEST_TIME = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_TIME = datetime(2200, 1, 1, tzinfo=UTC)
DEFAULT_CLOCK_TOLERANCE = timedelta(seconds=5)
MAX_CLOCK_TOLERANCE = timedelta(seconds=300)  # also what audit verify allows a record


# Categories an identifier may not contain (docs/spec.md, "Limits"): characters that
# print as nothing, or as something else, so that two ids could look alike.
_NAME_REFUSED_CATEGORIES = {
    "Cc": "control characters",
    "Cf": "format characters (invisible or reordering, e.g. U+202E, U+200D, U+FEFF)",
    "Zl": "line or paragraph separators",
    "Zp": "line or paragraph separators",
    "Co": "private-use characters",
    "Cn": "unassigned characters or noncharacters",
}


def text_problem(value: str, *, max_length: int, name: bool) -> str | None:
    """Why ``value`` is not acceptable text (None: it is). ``name``: an identifier-like
    value, which must also be free of every control, format, separator (other than an
    inner space), private-use and unassigned character, and must not begin or end with
    whitespace: no two accepted ids look alike."""
    if len(value) > max_length:
        return f"must be at most {max_length} characters (got {len(value)})"
    if name and value != value.strip():
        return "must not begin or end with whitespace"
    if value.isprintable():  # no control, format or surrogate character: the usual case
        return None
    if "\x00" in value:
        return "must not contain NUL characters"
    for character in value:
        category = unicodedata.category(character)
        if category == "Cs":
            return "must be valid Unicode (a lone surrogate cannot be stored)"
        if name and category in _NAME_REFUSED_CATEGORIES:
            kind = _NAME_REFUSED_CATEGORIES[category]
            return f"must not contain {kind} (found U+{ord(character):04X}, {category})"
    return None


def check_name(field: str, value: str) -> str:
    problem = text_problem(value, max_length=MAX_NAME_LENGTH, name=True)
    if problem:
        raise InvalidRequestError(field, problem)
    return value


def check_items(field: str, count: int, limit: int = MAX_ITEMS) -> None:
    if count > limit:
        raise InvalidRequestError(field, f"must have at most {limit} entries (got {count})")
