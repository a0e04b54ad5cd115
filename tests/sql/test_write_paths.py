"""The short paths a write takes through the tracking and enqueue triggers (what an agent
pays per appended Run): a transaction bumps its conversation_state row once, later
statements of that transaction answer the no-change question without re-locking, and
the enqueue trigger leaves alone a queue entry the transaction already holds. Each must
keep what the long path guarantees: exact derived state, REPEATABLE READ writers that
fail rather than number from a stale snapshot, and a requeue for a leased entry."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db
from tests.history import History

Conn = psycopg.Connection[Any]


def problems(conn: Conn, conversation_id: str) -> list[tuple[str, str]]:
    return [(str(p), str(d)) for p, d in conn.execute(
        "SELECT problem, detail FROM compaction.verify_conversation(%s)", (conversation_id,))]


def state_row(conn: Conn, conversation_id: str) -> tuple[str, int, int]:
    """(ctid, generation, pair_count) of the conversation's conversation_state row."""
    row = conn.execute("SELECT ctid::text, generation, pair_count"
                       " FROM compaction.conversation_state WHERE conversation_id = %s",
                       (conversation_id,)).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), int(row[2])


def test_a_transaction_bumps_its_conversation_once_and_reads_it_after(conn: Conn) -> None:
    history = History(conn)
    history.pairs("c", 9)
    _, generation, _ = state_row(conn, "c")
    with conn.transaction():
        run = history.run("c", status="running")
        after_run = state_row(conn, "c")
        history.message("c", run, "user", "q")
        history.message("c", run, "assistant", "a")
        # No new row version for the two messages: the row is this transaction's own.
        assert state_row(conn, "c") == after_run == (after_run[0], generation + 1, 9)
        assert problems(conn, "c") == []
        conn.execute("UPDATE compaction_source.runs SET status = 'completed'"
                     " WHERE run_id = %s", (run,))
        # The tenth pair: numbered next, its range hashed, inside the transaction.
        assert state_row(conn, "c")[1:] == (generation + 1, 10)
        assert problems(conn, "c") == []
    assert problems(conn, "c") == []
    assert conn.execute("SELECT count(*) FROM compaction.ranges"
                        " WHERE conversation_id = 'c'").fetchone() == (1,)


@pytest.mark.parametrize("earlier_statement", [False, True])
def test_a_no_change_writer_fails_a_repeatable_read_settler(
        dsn: str, conn: Conn, earlier_statement: bool) -> None:
    """The first writer adds the assistant message of a Run that is not settled yet (its
    statement changes nothing derived; with `earlier_statement`, after another statement
    of its transaction already took the conversation). The second, at REPEATABLE READ
    with a snapshot from before that commit, settles the Run: it must fail, not number a
    pair without the message it cannot see."""
    history = History(conn)
    history.pairs("c", 3)
    run = history.run("c", status="running")
    history.message("c", run, "user", "q", seq=1000)
    other = history.run("c", status="running")
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        second.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        second.execute("SELECT 1 FROM compaction_source.runs LIMIT 1")  # take the snapshot
        if earlier_statement:
            first.execute("INSERT INTO compaction_source.messages (message_id,"
                          " conversation_id, run_id, role, status, content, seq) VALUES"
                          " ('c:other-u', 'c', %s, 'user', 'completed', 'q', 2000)", (other,))
        first.execute("INSERT INTO compaction_source.messages (message_id, conversation_id,"
                      " run_id, role, status, content, seq) VALUES"
                      " ('c:late-a', 'c', %s, 'assistant', 'completed', 'a', 1001)", (run,))
        first.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            second.execute("UPDATE compaction_source.runs SET status = 'completed'"
                           " WHERE run_id = %s", (run,))
        second.rollback()
    assert problems(conn, "c") == []
    conn.execute("UPDATE compaction_source.runs SET status = 'completed' WHERE run_id = %s",
                 (run,))
    assert conn.execute("SELECT pair_index FROM compaction.pairs WHERE run_id = %s",
                        (run,)).fetchone() == (3,)
    assert problems(conn, "c") == []


def test_a_transaction_that_leased_the_entry_then_writes_history_requeues_it(
        conn: Conn) -> None:
    """The entry is this transaction's own (its dequeue leased it), yet the write must
    mark it requeued: the worker's ack must not remove history it has not examined."""
    history = History(conn)
    history.pair("c")
    conn.execute("DELETE FROM compaction.queue")
    db.enqueue(conn, "c")
    with conn.transaction():
        [entry] = db.dequeue(conn, 1)
        run = history.run("c", status="running")
        history.message("c", run, "user", "q")  # held and requeued: nothing more to do
    assert conn.execute("SELECT lease_token IS NOT NULL, requeued_at IS NOT NULL"
                        " FROM compaction.queue WHERE conversation_id = 'c'"
                        ).fetchone() == (True, True)
    assert db.ack(conn, entry).reason == "requeued"


def test_later_statements_of_a_transaction_enqueue_once(conn: Conn) -> None:
    history = History(conn)
    conn.execute("DELETE FROM compaction.queue")
    with conn.transaction():
        run = history.run("c", status="running")
        history.message("c", run, "user", "q")
        history.message("c", run, "assistant", "a")
        conn.execute("UPDATE compaction_source.runs SET status = 'completed'"
                     " WHERE run_id = %s", (run,))
    assert conn.execute("SELECT conversation_id, lease_token, requeued_at"
                        " FROM compaction.queue").fetchall() == [("c", None, None)]
    assert problems(conn, "c") == []


@pytest.mark.parametrize("one_transaction", [True, False])
def test_a_run_written_settled_before_its_messages(conn: Conn, one_transaction: bool) -> None:
    """The Run's own statement changes nothing derived (no user message
    yet: it cannot pair), a lone assistant message neither; the user message makes the
    pair, numbered next with its range hashed, in one transaction or in three."""
    history = History(conn)
    history.pairs("c", 9)
    _, generation, _ = state_row(conn, "c")

    def write() -> None:
        run = history.run("c", status="completed")
        assert state_row(conn, "c")[1:] == (generation + 1, 9)
        history.message("c", run, "assistant", "a", seq=20)
        assert state_row(conn, "c")[2] == 9
        assert problems(conn, "c") == []
        history.message("c", run, "user", "q", seq=19)  # before the answer, as asked
        assert state_row(conn, "c")[2] == 10
        assert conn.execute("SELECT pair_index FROM compaction.pairs WHERE run_id = %s",
                            (run,)).fetchone() == (9,)

    if one_transaction:
        with conn.transaction():
            write()
    else:
        write()
    assert problems(conn, "c") == []
    assert conn.execute("SELECT count(*) FROM compaction.ranges"
                        " WHERE conversation_id = 'c'").fetchone() == (1,)
