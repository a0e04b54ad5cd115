"""Source binding: the SHA-256 over a range's ten pairs, byte for byte as the SQL computes it.

enc(s) is the 4-byte big-endian length of UTF-8(s) followed by UTF-8(s); the hash input is
enc(user id) enc(user text) enc(assistant id) enc(assistant text) for each pair in order.
No normalisation: NFC and NFD spellings of the same text hash differently, on purpose.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

PAIRS_PER_RANGE = 10


class PairLike(Protocol):
    """Anything with the four attributes the hash binds (pycompactor.models.Pair has them)."""

    @property
    def user_message_id(self) -> str: ...
    @property
    def user_content(self) -> str: ...
    @property
    def assistant_message_id(self) -> str: ...
    @property
    def assistant_content(self) -> str: ...


def source_message_ids(pairs: Sequence[PairLike]) -> list[str]:
    """The range's ids in contract order: [u0, a0, u1, a1, ..., u9, a9]."""
    return [i for p in pairs for i in (p.user_message_id, p.assistant_message_id)]


def source_hash(pairs: Sequence[PairLike]) -> str:
    """Lowercase hex SHA-256 binding exactly 10 pairs (ids and texts of both sides).

    Raises ValueError for another number of pairs, and for text that is not valid
    Unicode (lone surrogates cannot be UTF-8 encoded, nor stored in PostgreSQL).
    """
    if len(pairs) != PAIRS_PER_RANGE:
        raise ValueError(f"source_hash binds exactly {PAIRS_PER_RANGE} pairs, got {len(pairs)}")
    # One buffer, one update: 80 small update() calls cost more than hashing the ~40 KB
    # itself (each call over 2 KB releases and retakes the GIL); bench/hashing.py measures it.
    parts: list[bytes] = []
    append = parts.append
    for pair in pairs:
        for field in (
            pair.user_message_id,
            pair.user_content,
            pair.assistant_message_id,
            pair.assistant_content,
        ):
            data = field.encode("utf-8")
            append(len(data).to_bytes(4, "big"))
            append(data)
    return hashlib.sha256(b"".join(parts)).hexdigest()
