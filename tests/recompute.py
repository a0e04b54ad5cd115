"""A from-scratch recomputation of contract §3-§5, written independently of the engine.

The tests of the derived state compare the engine's read functions with this: raw source
rows read with plain SELECTs, judged by the rules of contract §3 in Python, numbered, cut into
ranges of 10 pairs and hashed with hashlib as contract §5 defines it. The recomputation
uses neither pycompactor nor any compaction.* function; the engine_* functions below are the
other side of the comparison.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

#: contract §3: the six ASCII whitespace characters; anything else (NBSP too) is content.
WHITESPACE = frozenset(" \t\n\r\f\v")
PAIR_RUN_STATUSES = frozenset({"completed", "partial", "clarify_pending"})
PAIRS_PER_RANGE = 10
#: contract §4: range k is a target iff 10k + 30 <= N.
PAIRS_BEFORE_FIRST_TARGET = 30

#: (pair_index, run_id, user_message_id, user_content, assistant_message_id,
#:  assistant_content): a row of compaction.eligible_pairs
PairRow = tuple[int, str, str, str, str, str]
#: (from_pair, to_pair, source_message_ids, source_hash): a row of compaction.plan_targets
TargetRow = tuple[int, int, list[str], str]


@dataclass(frozen=True)
class RawRun:
    run_id: str
    conversation_id: str
    status: str


@dataclass(frozen=True)
class RawMessage:
    message_id: str
    conversation_id: str
    run_id: str | None
    role: str
    status: str
    content: str
    seq: int


@dataclass(frozen=True)
class Raw:
    """Source rows in the contract's vocabulary, in creation order."""

    runs: tuple[RawRun, ...]
    messages: tuple[RawMessage, ...]


def has_content(text: str) -> bool:
    return any(ch not in WHITESPACE for ch in text)


def pairs_of(raw: Raw, conversation_id: str, *, foreign: bool = True) -> list[PairRow]:
    """contract §3, rule by rule, then the order (user seq, user message id).

    A message belongs to its own conversation's run of its run id; a user/assistant
    message whose own conversation has no run of that id is foreign and breaks the run of
    that id in every conversation that has one. (The raw rows must hold every
    conversation whose messages may name this one's runs.) foreign=False leaves that rule
    out: the pairs the conversation's own rows make, which its derived state keeps.
    """
    runs_held = {(r.conversation_id, r.run_id) for r in raw.runs}
    belonging: dict[tuple[str, str], list[RawMessage]] = defaultdict(list)
    named_elsewhere: set[str] = set()
    for m in raw.messages:
        if m.run_id is None or m.role not in ("user", "assistant"):
            continue
        if (m.conversation_id, m.run_id) in runs_held:
            belonging[(m.conversation_id, m.run_id)].append(m)
        else:
            named_elsewhere.add(m.run_id)
    found: list[tuple[int, bytes, str, RawMessage, RawMessage]] = []
    for run in raw.runs:
        if run.conversation_id != conversation_id or run.status not in PAIR_RUN_STATUSES:
            continue
        own = belonging[(conversation_id, run.run_id)]
        users = [m for m in own if m.role == "user"]
        assistants = [m for m in own if m.role == "assistant"]
        if len(users) != 1 or len(assistants) != 1:
            continue
        user, assistant = users[0], assistants[0]
        if assistant.status != "completed":
            continue
        if foreign and run.run_id in named_elsewhere:
            continue
        if not has_content(user.content) or not has_content(assistant.content):
            continue
        # Ties on seq go by message id in the database's collation, which the suite's
        # cluster fixes to C (byte order); see assert_c_collation.
        found.append((user.seq, user.message_id.encode(), run.run_id, user, assistant))
    found.sort(key=lambda f: (f[0], f[1]))
    return [(i, run_id, u.message_id, u.content, a.message_id, a.content)
            for i, (_, _, run_id, u, a) in enumerate(found)]


def _enc(text: str) -> bytes:
    data = text.encode("utf-8")
    return len(data).to_bytes(4, "big") + data


def range_hash(pairs: Sequence[PairRow]) -> str:
    """contract §5: SHA-256 over enc(uid) enc(user) enc(aid) enc(assistant), pair by pair."""
    assert len(pairs) == PAIRS_PER_RANGE
    digest = hashlib.sha256()
    for _, _, uid, user, aid, assistant in pairs:
        digest.update(_enc(uid) + _enc(user) + _enc(aid) + _enc(assistant))
    return digest.hexdigest()


def ranges_of(pairs: Sequence[PairRow]) -> dict[int, tuple[list[str], str]]:
    """Every complete range: from_pair -> ([u0, a0, ..., u9, a9], hash)."""
    out = {}
    for start in range(0, len(pairs) - PAIRS_PER_RANGE + 1, PAIRS_PER_RANGE):
        chunk = pairs[start:start + PAIRS_PER_RANGE]
        out[start] = ([i for p in chunk for i in (p[2], p[4])], range_hash(chunk))
    return out


def targets_of(pairs: Sequence[PairRow]) -> list[TargetRow]:
    return [(start, start + PAIRS_PER_RANGE - 1, ids, digest)
            for start, (ids, digest) in sorted(ranges_of(pairs).items())
            if start + PAIRS_BEFORE_FIRST_TARGET <= len(pairs)]


def hash_at(pairs: Sequence[PairRow], from_pair: int | None) -> str | None:
    if from_pair is None or from_pair < 0 or from_pair % PAIRS_PER_RANGE:
        return None
    found = ranges_of(pairs).get(from_pair)
    return None if found is None else found[1]


def hash_probes(n_pairs: int) -> list[int | None]:
    """Every multiple of 10 up to past the end, and invalid or absent ones."""
    return [*range(0, n_pairs + 30, PAIRS_PER_RANGE), -10, -1, 5, 15, 2_147_483_640, None]


# ---------------------------------------------------------------------------------------
# Reading the reference tables (plain SELECTs)
# ---------------------------------------------------------------------------------------

def read_reference(conn: psycopg.Connection[Any], conversations: Iterable[str]) -> Raw:
    """The reference tables' rows of these conversations (already the contract's vocabulary)."""
    ids = list(conversations)
    runs = conn.execute(
        "SELECT run_id, conversation_id, status FROM compaction_source.runs"
        " WHERE conversation_id = ANY (%s) ORDER BY length(run_id), run_id", (ids,)
    ).fetchall()
    messages = conn.execute(
        "SELECT message_id, conversation_id, run_id, role, status, content, seq"
        " FROM compaction_source.messages WHERE conversation_id = ANY (%s)"
        " ORDER BY length(message_id), message_id", (ids,)
    ).fetchall()
    return Raw(tuple(RawRun(*r) for r in runs), tuple(RawMessage(*m) for m in messages))


# ---------------------------------------------------------------------------------------
# What the engine says
# ---------------------------------------------------------------------------------------

def engine_pairs(conn: psycopg.Connection[Any], conversation_id: str) -> list[PairRow]:
    return [tuple(r) for r in conn.execute(
        "SELECT pair_index, run_id, user_message_id, user_content, assistant_message_id,"
        " assistant_content FROM compaction.eligible_pairs(%s)", (conversation_id,)
    ).fetchall()]


def engine_targets(conn: psycopg.Connection[Any], conversation_id: str) -> list[TargetRow]:
    return [tuple(r) for r in conn.execute(
        "SELECT from_pair, to_pair, source_message_ids, source_hash"
        " FROM compaction.plan_targets(%s)", (conversation_id,)
    ).fetchall()]


def engine_hashes(conn: psycopg.Connection[Any], conversation_id: str,
                  probes: Sequence[int | None]) -> list[tuple[int | None, str | None]]:
    return [(f, h) for f, h in conn.execute(
        "SELECT p.f, compaction.source_hash(%s, p.f)"
        " FROM unnest(%s::int[]) WITH ORDINALITY AS p (f, o) ORDER BY p.o",
        (conversation_id, list(probes)),
    ).fetchall()]


def verify(conn: psycopg.Connection[Any], conversation_id: str) -> list[tuple[str, str]]:
    return [(p, d) for p, d in conn.execute(
        "SELECT problem, detail FROM compaction.verify_conversation(%s)", (conversation_id,)
    ).fetchall()]


def assert_c_collation(conn: psycopg.Connection[Any]) -> None:
    """Pairs tied on seq are ordered by message id in the database's collation."""
    row = conn.execute(
        "SELECT datcollate FROM pg_database WHERE datname = current_database()").fetchone()
    assert row is not None
    assert row[0] in ("C", "C.UTF-8", "C.utf8", "POSIX"), (
        f"the recomputation orders ties by bytes; this database collates {row[0]}")


def assert_matches(conn: psycopg.Connection[Any], raw: Raw,
                   conversations: Iterable[str], *, verified: bool = True) -> None:
    """Every read function equals the recomputation and verify_conversation is clean.

    verified=False for a source without tracking triggers: there is no derived state to
    verify, the functions judge from the views.
    """
    for cid in conversations:
        pairs = pairs_of(raw, cid)
        assert engine_pairs(conn, cid) == pairs, f"eligible_pairs({cid!r})"
        assert engine_targets(conn, cid) == targets_of(pairs), f"plan_targets({cid!r})"
        probes = hash_probes(len(pairs))
        assert engine_hashes(conn, cid, probes) == [(f, hash_at(pairs, f)) for f in probes], (
            f"source_hash({cid!r}, ...)")
        # explain_runs (which reads the derived state while it is current): its
        # eligible runs are the recomputed pairs' runs, and every verdict is the one
        # judging the runs from the views gives.
        explained = conn.execute("SELECT run_id, run_status, eligible, reason"
                                 " FROM compaction.explain_runs(%s)", (cid,)).fetchall()
        assert {r[0] for r in explained if r[2]} == {p[1] for p in pairs}, (
            f"explain_runs({cid!r}) eligible runs")
        assert explained == conn.execute(
            "SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason"
            " FROM compaction.judge_runs(%s) AS j"
            " ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id", (cid,)).fetchall(), (
            f"explain_runs({cid!r}) verdicts")
        if verified:
            assert verify(conn, cid) == [], f"verify_conversation({cid!r})"


def derived_state_in_use(conn: psycopg.Connection[Any]) -> bool:
    """The functions read the derived state (not the views' fallback path)."""
    row = conn.execute("SELECT compaction.derived_state_current()").fetchone()
    assert row is not None
    return bool(row[0])
