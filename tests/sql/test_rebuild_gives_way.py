"""The rebuild never waits for a writer long while it holds a batch, so an
application transaction never deadlocks with it; and two rebuilds may run at once.

Each test builds its interleaving with real connections and the lock waits they show in
pg_locks (the barrier); a rebuild that waited for the writer while holding its batch would
end each of them in a deadlock or a CP021.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.history import History
from tests.sql.test_rebuild_defers import (
    InThread,
    RebuildInThread,
    all_clean,
    stop_rebuild_after,
    take_out_of_use,
)
from tests.sql.test_tracking import pair_indexes, state

Conn = psycopg.Connection[Any]


def write_in_thread(writer: Conn, conversation_id: str) -> InThread:
    """One more pair written by the writer's open transaction, in a thread: the write may
    wait for the rebuild, and the test must go on meanwhile."""
    return InThread(writer, lambda conn: History(conn).pair(conversation_id))


@pytest.mark.parametrize("c2_held_by", ["the writer", "another transaction"])
def test_a_writer_that_needs_a_conversation_of_the_batch_never_deadlocks(
        dsn: str, conn: Conn, c2_held_by: str) -> None:
    """The rebuild has derived c0 and c1 when it meets c2, which a transaction holds. The
    writer's transaction has left a conversation to the rebuild (so it holds
    source_tracking's row), then writes c1. Waiting for c2 while holding c1, or for the
    writer at the batch's end, closed a cycle that PostgreSQL broke by failing the writer
    (when it began waiting first) or the rebuild. Now the rebuild gives way: the writer's
    statement completes, then the rebuild finishes, and every conversation is exact."""
    history = History(conn)
    for name in ("c0", "c1", "c2", "c5"):
        history.pairs(name, 3)
    take_out_of_use(conn)
    stop_rebuild_after(conn, "", 4)
    with psycopg.connect(dsn) as writer, psycopg.connect(dsn) as other, \
            psycopg.connect(dsn, autocommit=True) as rebuilder:
        if c2_held_by == "the writer":
            History(writer).pair("c2")  # left to the rebuild: holds c2 and the row
        else:
            History(writer).pair("c5")  # left to the rebuild: holds c5 and the row
            other.execute("SELECT FROM compaction.conversation_state"
                          " WHERE conversation_id = 'c2' FOR UPDATE")
        rebuild = RebuildInThread(rebuilder)
        rebuild.wait_until_blocked(conn, "the rebuild did not wait at c2")
        write = write_in_thread(writer, "c1")
        write.wait_until_done_or_blocked(conn)
        other.rollback()
        write.join()
        if not write.failure:
            writer.commit()
        rebuild.join()
    assert write.failure == []
    assert rebuild.failure == []
    assert state(conn) == "in_use"
    assert pair_indexes(conn, "c1") == [0, 1, 2, 3]
    assert pair_indexes(conn, "c2") == ([0, 1, 2, 3] if c2_held_by == "the writer"
                                        else [0, 1, 2])
    assert all_clean(conn) == {}


def test_a_writer_creating_a_conversations_first_row_never_deadlocks(
        dsn: str, conn: Conn) -> None:
    """c2 was written before the tracking was attached (it has no derived rows at all,
    as every conversation has when an install's rebuild starts). The writer's first
    tracked write to it creates its conversation_state row, unseen by the rebuild, and
    leaves it to the rebuild; then the writer writes c1. A rebuild that inserted c2's row
    while holding c0 and c1 waited for the writer and deadlocked with it; now it ends the
    batch before c2."""
    history = History(conn)
    for name in ("c0", "c1", "c2"):
        history.pairs(name, 3)
    take_out_of_use(conn)
    for table in ("ranges", "pairs", "conversation_state"):
        conn.execute(f"DELETE FROM compaction.{table} WHERE conversation_id = 'c2'")
    stop_rebuild_after(conn, "", 3)
    with psycopg.connect(dsn) as writer, psycopg.connect(dsn, autocommit=True) as rebuilder:
        History(writer).pair("c2")  # creates c2's row, uncommitted; left to the rebuild
        rebuild = RebuildInThread(rebuilder)
        rebuild.wait_until_blocked(conn, "the rebuild did not wait at c2")
        write = write_in_thread(writer, "c1")
        write.wait_until_done_or_blocked(conn)
        write.join()
        if not write.failure:
            writer.commit()
        rebuild.join()
    assert write.failure == []
    assert rebuild.failure == []
    assert state(conn) == "in_use"
    assert pair_indexes(conn, "c1") == [0, 1, 2, 3]
    assert pair_indexes(conn, "c2") == [0, 1, 2, 3]
    assert all_clean(conn) == {}


def test_two_rebuilds_at_once_both_succeed_and_leave_every_conversation_exact(
        dsn: str, conn: Conn) -> None:
    """Each process of a deploy runs `pycompactor migrate`, so two rebuilds run at once.
    Both wait for a writer that created c9; once it commits they race through the same
    conversations: one puts the derived state in use, and the other, finding it in use
    under its source stamp, returns (it failed with CP021 before)."""
    history = History(conn)
    for k in range(6):
        history.pairs(f"c{k}", 3)
    take_out_of_use(conn)
    stop_rebuild_after(conn, "", 6)
    notices: list[str] = []
    with psycopg.connect(dsn) as writer, \
            psycopg.connect(dsn, autocommit=True) as first, \
            psycopg.connect(dsn, autocommit=True) as second:
        History(writer).pair("c9")  # a new conversation, left to the rebuild
        for rebuilder in (first, second):
            rebuilder.add_notice_handler(
                lambda diag: notices.append(diag.message_primary or ""))
        rebuilds = [RebuildInThread(first)]
        rebuilds[0].wait_until_blocked(conn, "the first rebuild did not wait for c9")
        rebuilds.append(RebuildInThread(second))
        rebuilds[1].wait_until_blocked(conn, "the second rebuild did not wait")
        writer.commit()
        for rebuild in rebuilds:
            rebuild.join()
    assert [r.failure for r in rebuilds] == [[], []]
    assert state(conn) == "in_use"
    assert len([n for n in notices if "put there by another rebuild" in n]) == 1, notices
    assert pair_indexes(conn, "c9") == [0]
    assert all_clean(conn) == {}


def test_the_resume_point_never_moves_back(dsn: str, conn: Conn) -> None:
    """A rebuild has derived c0-c3 (the shared resume point is c3) when a second one
    starts over. Had the second moved the resume point back to its own position, a write
    to c3 would be left to it, while the first could put the derived state in use before
    the second reached c3: c3 would be in use stale. The write derives c3 at once."""
    history = History(conn)
    for k in range(6):
        history.pairs(f"c{k}", 3)
    take_out_of_use(conn)  # every conversation derived, as the first rebuild left them
    stop_rebuild_after(conn, "c3", 6)
    with psycopg.connect(dsn) as other, psycopg.connect(dsn, autocommit=True) as rebuilder:
        other.execute("SELECT FROM compaction.conversation_state"
                      " WHERE conversation_id = 'c2' FOR UPDATE")
        rebuild = RebuildInThread(rebuilder, batch=1, restart=True)
        rebuild.wait_until_blocked(conn, "the second rebuild did not wait for c2")
        resume_after = conn.execute("SELECT resume_after FROM compaction.rebuild_progress"
                                    ).fetchone()
        history.pair("c3")
        c3_after_the_write = pair_indexes(conn, "c3")
        other.rollback()
        rebuild.join()
    assert resume_after == ("c3",)
    assert c3_after_the_write == [0, 1, 2, 3]
    assert rebuild.failure == []
    assert state(conn) == "in_use"
    assert all_clean(conn) == {}
