"""What a worker reads after its claim (sql/35_worker_reads.sql): the claimed range's ten
replies, and only while their texts are the ones the claimed hash covers.

When the derived state is not in use (always on Citus, and on a source
without tracking triggers), `range_replies` reads the replies by the ids of the job the
claim bound, with the hash of those ids' texts as they are now, instead of judging the
whole conversation again (the claim had just judged it).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.projection import project_history
from tests.history import History, SeededPair
from tests.sql.engine import GOOD, claim, scalar

Conn = psycopg.Connection[Any]
BIG = 1 << 20


def replies(conn: Conn, conversation_id: str, from_pair: int,
            source_hash: str) -> list[tuple[int, str, str]]:
    return [(r.pair_index, r.assistant_message_id, r.assistant_content)
            for r in db.range_replies(conn, conversation_id, from_pair, source_hash)]


def expected(pairs: list[SeededPair], first: int) -> list[tuple[int, str, str]]:
    return [(first + k, p.assistant_message_id, p.assistant_content)
            for k, p in enumerate(pairs[first:first + 10])]


@pytest.fixture(params=["in_use", "untracked"])
def derived(request: pytest.FixtureRequest, conn: Conn) -> str:
    """The derived state in use, or a source whose tracking is off (judged from the views)."""
    if request.param == "untracked":
        conn.execute("ALTER TABLE compaction_source.messages"
                     " DISABLE TRIGGER messages_track_update")
    assert scalar(conn, "SELECT compaction.derived_state_status()") == request.param
    return str(request.param)


def test_replies_judged_from_the_views_come_from_the_claim_without_a_judgment(
        conn: Conn) -> None:
    conn.execute("ALTER TABLE compaction_source.messages DISABLE TRIGGER messages_track_update")
    pairs = History(conn).pairs("c", 40)
    t = db.plan_targets(conn, "c")[1]
    assert claim(conn, "c", t).claimed
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        got = replies(conn, "c", t.from_pair, t.source_hash)
        calls = dict(conn.execute(
            "SELECT funcname, calls::int FROM pg_stat_xact_user_functions"
            " WHERE schemaname = 'compaction'").fetchall())
    assert got == expected(pairs, 10)
    # Neither the eligibility of the conversation's runs nor the current range: judging
    # them would read all 40 runs again.
    assert "judge_runs" not in calls, calls
    assert "current_range" not in calls, calls


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_a_text_changed_after_the_claim_withholds_every_reply(
        conn: Conn, derived: str, role: str) -> None:
    pairs = History(conn).pairs("c", 40)
    t = db.plan_targets(conn, "c")[0]
    assert claim(conn, "c", t).claimed
    assert replies(conn, "c", 0, t.source_hash) == expected(pairs, 0)
    edited = pairs[4].user_message_id if role == "user" else pairs[4].assistant_message_id
    conn.execute("UPDATE compaction_source.messages SET content = content || '!'"
                 " WHERE conversation_id = 'c' AND message_id = %s", (edited,))
    assert replies(conn, "c", 0, t.source_hash) == []
    # The text as claimed again: the claimed hash covers it again.
    conn.execute("UPDATE compaction_source.messages SET content = rtrim(content, '!')"
                 " WHERE conversation_id = 'c' AND message_id = %s", (edited,))
    assert replies(conn, "c", 0, t.source_hash) == expected(pairs, 0)
    # A hash no job and no current range has: nothing.
    assert replies(conn, "c", 0, "f" * 64) == []


def test_without_a_claim_the_current_range_answers(conn: Conn, derived: str) -> None:
    pairs = History(conn).pairs("c", 40)
    t = db.plan_targets(conn, "c")[1]
    assert replies(conn, "c", 10, t.source_hash) == expected(pairs, 10)
    conn.execute("UPDATE compaction_source.messages SET content = 'changed'"
                 " WHERE conversation_id = 'c' AND message_id = %s",
                 (pairs[12].assistant_message_id,))
    assert replies(conn, "c", 10, t.source_hash) == []


def test_a_range_that_moved_after_the_claim(conn: Conn, derived: str) -> None:
    """Pair 0's run fails after range 0 was claimed: every pair moves down one place, and
    range 0 is now pairs 1-10, while the claimed texts are unchanged. With the derived
    state in use the current range says so and no reply is read; judged from the views,
    the replies the claim bound are read, and their summary is then stale_source: never
    projected, as any summary of a range that moved after it was written."""
    pairs = History(conn).pairs("c", 40)
    t = db.plan_targets(conn, "c")[0]
    claimed = claim(conn, "c", t, now=None)  # the server's clock: complete's lease
    assert claimed.claimed
    assert claimed.job_id is not None
    conn.execute("UPDATE compaction_source.runs SET status = 'failed'"
                 " WHERE conversation_id = 'c' AND run_id = %s", (pairs[0].run_id,))
    got = replies(conn, "c", 0, t.source_hash)
    if derived == "in_use":
        assert got == []
        return
    assert got == expected(pairs, 0)
    done = db.complete(conn, claimed.job_id, 1, GOOD, "stop", 0)
    assert done.ok
    assert done.summary_id is not None
    projection = project_history(conn, "c", budget_bytes=BIG)
    assert [(r.summary_id, r.from_pair, r.reason) for r in projection.rejected_summaries] == [
        (done.summary_id, 0, "stale_source")]
    assert done.summary_id not in {p.summary_id for p in projection.pairs}
