"""contract §5: Python's source_hash and SQL's compaction.source_hash agree byte for byte."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycompactor import db, source_hash

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class P:
    user_message_id: str
    user_content: str
    assistant_message_id: str
    assistant_content: str


def store(conn: Conn, conversation_id: str, pairs: list[P]) -> None:
    """Write 10 pairs as a fresh conversation (inside the caller's transaction)."""
    conn.execute("INSERT INTO compaction_source.conversations VALUES (%s)", (conversation_id,))
    for i, p in enumerate(pairs):
        run_id = f"{conversation_id}/{i}"
        conn.execute(
            "INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
            " VALUES (%s, %s, 'completed')", (run_id, conversation_id))
        conn.execute(
            "INSERT INTO compaction_source.messages"
            " (message_id, conversation_id, run_id, role, status, content, seq) VALUES"
            " (%s, %s, %s, 'user', 'completed', %s, %s),"
            " (%s, %s, %s, 'assistant', 'completed', %s, %s)",
            (p.user_message_id, conversation_id, run_id, p.user_content, 2 * i,
             p.assistant_message_id, conversation_id, run_id, p.assistant_content, 2 * i + 1))


def sql_hash(conn: Conn, pairs: list[P]) -> str | None:
    """Store, hash in SQL, roll back: one database serves every hypothesis example."""
    with conn.transaction(force_rollback=True):
        store(conn, "parity", pairs)
        return db.source_hash(conn, "parity", 0)


# Text PostgreSQL can store (no NUL, no surrogates) that counts as content (§3).
content = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1, max_size=300,
).filter(lambda s: s.strip(" \t\n\r\f\v") != "")


@st.composite
def ten_pairs(draw: st.DrawFn) -> list[P]:
    texts = draw(st.lists(content, min_size=20, max_size=20))
    prefix = draw(st.text(alphabet="abcé🎉_-", min_size=0, max_size=5))
    return [P(f"{prefix}u{i}", texts[2 * i], f"{prefix}a{i}", texts[2 * i + 1])
            for i in range(10)]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=ten_pairs())
def test_python_and_sql_agree_on_random_text(conn: Conn, pairs: list[P]) -> None:
    assert sql_hash(conn, pairs) == source_hash(pairs)


def fixed(user: str, assistant: str) -> list[P]:
    return [P(f"u{i}", f"{user} {i}", f"a{i}", f"{assistant} {i}") for i in range(10)]


# Written out by hand so that a change on both sides at once still fails a test.
VECTORS = [
    (fixed("q", "a"),
     "abcf895f067f33175b974f29f3e1026d55a8c88ec172aca7a6ac0319147a7bcc"),
    (fixed("你好", "🎉 NAV 1.23"),
     "21fb82f0af25ddb914ceb918cfba9f4b423368f65564fbcb6e3c9965ffd67684"),
    # also checked with printf '\0\0\0\1u\0\0\0\1x\0\0\0\1a\0\0\0\1y' x10 | sha256sum
    ([P("u", "x", "a", "y")] * 10,
     "584adf9b643638d93f0d030f83319d0a080cdb498e9bb69dcd6507f9be5fa10c"),
]


def test_fixed_vectors(conn: Conn) -> None:
    for pairs, expected in VECTORS:
        assert source_hash(pairs) == expected
        if len({p.user_message_id for p in pairs}) == 10:
            assert sql_hash(conn, pairs) == expected


def test_nfc_and_nfd_hash_differently(conn: Conn) -> None:
    nfc = unicodedata.normalize("NFC", "Café résumé")
    nfd = unicodedata.normalize("NFD", "Café résumé")
    assert nfc != nfd
    a, b = fixed(nfc, "same"), fixed(nfd, "same")
    assert source_hash(a) != source_hash(b)
    assert sql_hash(conn, a) == source_hash(a)
    assert sql_hash(conn, b) == source_hash(b)


def test_empty_looking_texts_and_combining_marks(conn: Conn) -> None:
    for text in ["\u00a0", "\u3000", "\u200b", "e\u0301\u0301", "\U0001f468\u200d\U0001f469"]:
        pairs = fixed(text, text)
        assert sql_hash(conn, pairs) == source_hash(pairs)


def test_one_megabyte_texts(conn: Conn) -> None:
    big = ("NAV 1.2345 净值 🎉 " * 60_000)[:1_000_000]
    pairs = [P(f"u{i}", big + str(i), f"a{i}", big[::-1]) for i in range(10)]
    assert sql_hash(conn, pairs) == source_hash(pairs)


def test_field_boundaries_are_bound() -> None:
    # Moving a character across the id/text boundary must change the hash (length prefix).
    a = [P("u1", "0x", "a1", "y"), *fixed("q", "a")[1:]]
    b = [P("u10", "x", "a1", "y"), *fixed("q", "a")[1:]]
    assert source_hash(a) != source_hash(b)
