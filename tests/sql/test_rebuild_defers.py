"""While a rebuild runs and the derived state is not in use, a tracked write
to a conversation the rebuild has not reached is left to the rebuild, which derives it
from a snapshot holding the write; and a TRUNCATE clears the rebuild's resume point."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.history import History
from tests.sql.test_tracking import generations, pair_indexes, problems, state

Conn = psycopg.Connection[Any]


def take_out_of_use(conn: Conn) -> None:
    """The tracking triggers replaced (as a re-pointed source would be): not in use."""
    conn.execute("ALTER TABLE compaction_source.messages DISABLE TRIGGER messages_track_update")
    conn.execute("ALTER TABLE compaction_source.messages"
                 " ENABLE ALWAYS TRIGGER messages_track_update")
    assert state(conn) == "not_rebuilt"


def stop_rebuild_after(conn: Conn, conversation_id: str, total: int) -> None:
    """A rebuild under the current source, stopped after `conversation_id`."""
    conn.execute("UPDATE compaction.source_tracking SET rebuild_stamp = compaction.source_stamp(),"
                 " rebuild_after = %s, rebuild_done = 0, rebuild_total = %s,"
                 " rebuild_started_at = now(), rebuild_updated_at = now()",
                 (conversation_id, total))


def waiting_pids(conn: Conn) -> list[int]:
    return [int(p) for (p,) in conn.execute(
        "SELECT pid FROM pg_catalog.pg_locks WHERE NOT granted")]


class InThread:
    """`work` on a connection of its own, in a thread, so the test can hold rows and locks
    against it (or go on while it waits); an error is kept for the test's thread."""

    def __init__(self, conn: Conn, work: Callable[[Conn], object]) -> None:
        self.pid = conn.info.backend_pid
        self.failure: list[BaseException] = []

        def run() -> None:
            try:
                work(conn)
            except BaseException as exc:  # handed to the test's thread
                self.failure.append(exc)

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def wait_until_blocked(self, conn: Conn, why: str) -> None:
        """Until the work waits on a lock (the barrier); it must not end first."""
        while self.pid not in waiting_pids(conn):
            assert self.thread.is_alive(), self.failure or why

    def wait_until_done_or_blocked(self, conn: Conn) -> None:
        while self.thread.is_alive() and self.pid not in waiting_pids(conn):
            pass

    def join(self) -> None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


class RebuildInThread(InThread):
    """`CALL compaction.rebuild_derived_state(batch, restart)` in a thread."""

    def __init__(self, rebuilder: Conn, batch: int = 100, restart: bool = False) -> None:
        super().__init__(rebuilder, lambda conn: conn.execute(
            "CALL compaction.rebuild_derived_state(%s, %s)", (batch, restart)))


def all_clean(conn: Conn) -> dict[str, list[tuple[str, str]]]:
    """The conversations verify_conversation finds a difference in, with the differences."""
    found = {str(c): problems(conn, str(c)) for (c,) in conn.execute(
        "SELECT DISTINCT conversation_id FROM compaction_source.runs")}
    return {c: p for c, p in found.items() if p}


def test_a_write_after_the_resume_point_is_left_to_the_rebuild(conn: Conn) -> None:
    history = History(conn)
    for k in range(6):
        history.pairs(f"c{k}", 3)
    take_out_of_use(conn)
    stop_rebuild_after(conn, "c2", 6)
    before = generations(conn)

    history.pair("c4")  # after the resume point: left to the rebuild
    history.pair("c9")  # a new conversation after it: the same
    history.pair("c1")  # before it: derived at once, as ever
    assert pair_indexes(conn, "c4") == [0, 1, 2]
    assert pair_indexes(conn, "c9") == []
    assert generations(conn)["c4"] > before["c4"]  # its writers still serialise on the row
    assert pair_indexes(conn, "c1") == [0, 1, 2, 3]
    assert problems(conn, "c1") == []
    assert problems(conn, "c4") != []  # not in use meanwhile: every call judges the views

    notices: list[str] = []
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert notices[0].startswith("derived state: resuming after conversation c2")
    assert state(conn) == "in_use"
    assert pair_indexes(conn, "c4") == [0, 1, 2, 3]
    assert pair_indexes(conn, "c9") == [0]
    assert all_clean(conn) == {}


def test_writes_are_derived_at_once_while_the_derived_state_is_in_use(conn: Conn) -> None:
    """A rebuild stopped midway over a derived state in use (a repair): the calls read the
    derived state, so every write keeps it."""
    history = History(conn)
    for k in range(3):
        history.pairs(f"c{k}", 3)
    stop_rebuild_after(conn, "c0", 3)
    assert state(conn) == "in_use"
    history.pair("c2")
    assert pair_indexes(conn, "c2") == [0, 1, 2, 3]
    assert problems(conn, "c2") == []


def test_a_repeatable_read_writer_derives_at_once(dsn: str, conn: Conn) -> None:
    """Its snapshot may predate the resume point it would read under the lock (which would
    fail it): it derives at once, as it would with no rebuild running."""
    history = History(conn)
    for k in range(3):
        history.pairs(f"c{k}", 3)
    take_out_of_use(conn)
    stop_rebuild_after(conn, "c0", 3)
    with psycopg.connect(dsn) as writer:
        writer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        History(writer).pair("c2")
        writer.commit()
    assert pair_indexes(conn, "c2") == [0, 1, 2, 3]
    assert problems(conn, "c2") == []


def test_a_conversation_created_while_the_rebuild_passes_it_is_derived(
        dsn: str, conn: Conn) -> None:
    """A conversation a writer creates is invisible to the rebuild's ordered reads until
    the writer commits. The writer holds source_tracking FOR KEY SHARE; the rebuild waits
    for it before its last commit, then finds the conversation and derives it before it
    puts the derived state in use."""
    history = History(conn)
    history.pairs("c0", 3)
    history.pairs("c2", 3)
    take_out_of_use(conn)
    stop_rebuild_after(conn, "", 2)
    with psycopg.connect(dsn) as writer, \
            psycopg.connect(dsn, autocommit=True) as rebuilder:
        History(writer).pair("c1")  # uncommitted: left to the rebuild
        rebuild = RebuildInThread(rebuilder)
        rebuild.wait_until_blocked(conn, "the rebuild did not wait for the writer")
        writer.commit()
        rebuild.join()
    assert rebuild.failure == []
    assert state(conn) == "in_use"
    assert pair_indexes(conn, "c1") == [0]
    assert all_clean(conn) == {}


def test_truncate_clears_a_stopped_rebuild(conn: Conn) -> None:
    """The conversations before the resume point lost rows that no trigger re-derived: the
    next rebuild starts over."""
    history = History(conn)
    for k in range(4):
        history.pairs(f"c{k}", 3)
    stop_rebuild_after(conn, "c2", 4)
    conn.execute("TRUNCATE compaction_source.messages")
    assert conn.execute("SELECT count(*) FROM compaction.rebuild_progress").fetchone() == (0,)
    history.pairs("c0", 2)  # out of use and no rebuild under way: left to the next one
    assert pair_indexes(conn, "c0") == [0, 1, 2]
    notices: list[str] = []
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert notices[0].startswith("derived state: rebuilding about ")
    assert state(conn) == "in_use"
    assert pair_indexes(conn, "c0") == [0, 1]
    assert all_clean(conn) == {}


def test_a_truncate_under_a_running_rebuild_fails_it(dsn: str, conn: Conn) -> None:
    """The rebuild has committed c0-c2 and waits for c3 (another connection holds its row)
    when the messages are truncated: it must not go on to put c0-c2's stale rows in use."""
    history = History(conn)
    for k in range(6):
        history.pairs(f"c{k}", 3)
    with psycopg.connect(dsn) as blocker, \
            psycopg.connect(dsn, autocommit=True) as rebuilder, \
            psycopg.connect(dsn, autocommit=True) as truncater:
        blocker.execute("SELECT 1 FROM compaction.conversation_state"
                        " WHERE conversation_id = 'c3' FOR UPDATE")
        rebuild = RebuildInThread(rebuilder, batch=1)
        rebuild.wait_until_blocked(conn, "the rebuild did not wait for c3")
        truncate = threading.Thread(
            target=lambda: truncater.execute("TRUNCATE compaction_source.messages"))
        truncate.start()
        # Either order is covered: the TRUNCATE before the rebuild's next commit, or
        # after it (then it holds the messages until the rebuild's next batch reads them).
        while truncate.is_alive() and truncater.info.backend_pid not in waiting_pids(conn):
            pass
        blocker.rollback()
        truncate.join(timeout=60)
        assert not truncate.is_alive()
        rebuild.join()
    [failure] = rebuild.failure
    assert isinstance(failure, psycopg.Error)
    assert failure.sqlstate == "CP021"
    assert "truncated" in str(failure)
    assert state(conn) == "not_rebuilt"
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert state(conn) == "in_use"
    assert all_clean(conn) == {}


@pytest.mark.parametrize("in_transactions", [False, True])
def test_writers_racing_a_rebuild_leave_every_conversation_exact(
        dsn: str, conn: Conn, in_transactions: bool) -> None:
    """Eight writers and a rebuild in small batches, started together: writes before,
    inside and after the rebuild's batches, to old and new conversations, each pair in
    three autocommit statements or in one transaction. Every pair is counted and every
    conversation verifies."""
    history = History(conn)
    names = [f"c{k:02d}" for k in range(0, 40, 2)]
    for name in names:
        history.pairs(name, 4)
    take_out_of_use(conn)
    writers, per_writer = 8, 25
    plans = [[random.Random(w * 97 + i).choice(
        names + [f"c{k:02d}" for k in range(1, 40, 2)]) for i in range(per_writer)]
        for w in range(writers)]
    start = threading.Barrier(writers + 1)
    failure: list[BaseException] = []

    def write(plan: list[str]) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as writer:
                own = History(writer)
                start.wait()
                for name in plan:
                    if in_transactions:
                        with writer.transaction():
                            own.pair(name)
                    else:
                        own.pair(name)
        except BaseException as exc:  # reported by the test's thread
            failure.append(exc)

    def rebuild() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as rebuilder:
                start.wait()
                rebuilder.execute("CALL compaction.rebuild_derived_state(3)")
        except BaseException as exc:  # reported by the test's thread
            failure.append(exc)

    threads = [threading.Thread(target=write, args=(plan,)) for plan in plans]
    threads.append(threading.Thread(target=rebuild))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
        assert not thread.is_alive()
    assert failure == []
    assert state(conn) == "in_use"
    written = {name: 0 for name in names}
    for plan in plans:
        for name in plan:
            written[name] = written.get(name, 0) + 1
    for name, count in written.items():
        assert pair_indexes(conn, name) == list(range((4 if name in names else 0) + count))
    assert all_clean(conn) == {}


def test_a_repair_rebuild_reads_the_conversation_states_linearly(dsn: str, conn: Conn) -> None:
    """Before each commit the rebuild looks for conversations that appeared in its batch's
    span. Over a populated derived state (a repair with the state in use), a scan not
    bounded by the batch's end read every conversation after it at each commit: twice the
    conversations took four times the index entries. Counted, not timed."""
    history = History(conn)

    def entries_read(reader: Conn) -> int:
        conn.execute("SELECT pg_stat_force_next_flush()")
        reader.execute("SELECT pg_stat_clear_snapshot()")
        row = reader.execute(
            "SELECT idx_tup_read FROM pg_stat_user_indexes"
            " WHERE indexrelid = 'compaction.conversation_state_pkey'::regclass").fetchone()
        assert row is not None
        return int(row[0])

    reads = []
    with psycopg.connect(dsn, autocommit=True) as reader:
        for first in (0, 100):  # 100 conversations, then 200 in all
            for k in range(first, first + 100):
                history.pairs(f"c{k:04d}", 1)
            before = entries_read(reader)
            conn.execute("CALL compaction.rebuild_derived_state(5, p_restart => true)")
            reads.append(entries_read(reader) - before)
    assert state(conn) == "in_use"
    assert reads[1] <= 2.5 * reads[0], reads
