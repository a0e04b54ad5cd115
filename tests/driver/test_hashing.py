"""pycompactor.source_hash as a pure function (no database)."""

from __future__ import annotations

import pytest

from pycompactor import Pair, source_hash
from pycompactor.hashing import source_message_ids


def pairs(n: int, text: str = "t") -> list[Pair]:
    return [Pair(i, f"r{i}", f"u{i}", f"{text}{i}", f"a{i}", f"{text}!{i}") for i in range(n)]


@pytest.mark.parametrize("n", [0, 9, 11])
def test_exactly_ten_pairs(n: int) -> None:
    with pytest.raises(ValueError, match="exactly 10 pairs"):
        source_hash(pairs(n))


def test_lowercase_hex_sha256() -> None:
    digest = source_hash(pairs(10))
    assert len(digest) == 64
    assert digest == digest.lower()
    int(digest, 16)


def test_every_field_is_bound() -> None:
    base = pairs(10)
    reference = source_hash(base)
    for field in ("user_message_id", "user_content", "assistant_message_id", "assistant_content"):
        changed = list(base)
        p = changed[7]
        changed[7] = Pair(**{**{f: getattr(p, f) for f in p.__slots__}, field: "changed"})
        assert source_hash(changed) != reference, field


def test_order_is_bound() -> None:
    base = pairs(10)
    assert source_hash(base[::-1]) != source_hash(base)


def test_lone_surrogate_is_refused() -> None:
    bad = pairs(10)
    bad[0] = Pair(0, "r0", "u0", "\ud800", "a0", "x")
    with pytest.raises(UnicodeEncodeError):
        source_hash(bad)


def test_source_message_ids_order() -> None:
    assert source_message_ids(pairs(2)) == ["u0", "a0", "u1", "a1"]
