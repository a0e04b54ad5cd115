"""The tracking triggers and what keeps the derived state honest (contract §2): logical
replication's apply role, TRUNCATE, writers at REPEATABLE READ, the rebuild, the repair,
and who may call what."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg
import pytest

from tests.history import History
from tests.sql.conftest import LoginRole, connect_as

Conn = psycopg.Connection[Any]


def state(conn: Conn) -> str:
    row = conn.execute("SELECT compaction.derived_state_status()").fetchone()
    assert row is not None
    return str(row[0])


def problems(conn: Conn, conversation_id: str) -> list[tuple[str, str]]:
    return [(str(p), str(d)) for p, d in conn.execute(
        "SELECT problem, detail FROM compaction.verify_conversation(%s)", (conversation_id,))]


def pair_indexes(conn: Conn, conversation_id: str) -> list[int]:
    return [int(r[0]) for r in conn.execute(
        "SELECT pair_index FROM compaction.pairs WHERE conversation_id = %s"
        " ORDER BY pair_index", (conversation_id,))]


def test_a_migrated_database_uses_its_derived_state(conn: Conn) -> None:
    assert state(conn) == "in_use"
    History(conn).pairs("c", 31)
    assert pair_indexes(conn, "c") == list(range(31))
    row = conn.execute("SELECT pair_count FROM compaction.conversation_state"
                       " WHERE conversation_id = 'c'").fetchone()
    assert row == (31,)
    assert problems(conn, "c") == []


def test_writes_under_replica_role_are_tracked(conn: Conn) -> None:
    """Logical replication's apply runs with session_replication_role = replica."""
    history = History(conn)
    history.pairs("c", 9)
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        history.pair("c")
    assert pair_indexes(conn, "c") == list(range(10))
    assert conn.execute("SELECT count(*) FROM compaction.ranges WHERE conversation_id = 'c'"
                        ).fetchone() == (1,)
    assert problems(conn, "c") == []


def test_truncate_takes_the_derived_state_out_of_use(conn: Conn) -> None:
    History(conn).pairs("c", 35)
    conn.execute("TRUNCATE compaction_source.messages")
    assert state(conn) == "not_rebuilt"
    # Exact meanwhile: judged from the views.
    assert conn.execute("SELECT count(*) FROM compaction.eligible_pairs('c')").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM compaction.plan_targets('c')").fetchone() == (0,)
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert state(conn) == "in_use"
    assert problems(conn, "c") == []
    assert pair_indexes(conn, "c") == []


def test_rebuild_reports_progress_with_a_rate(conn: Conn) -> None:
    history = History(conn)
    for k in range(5):
        history.pairs(f"c{k}", 3)
    notices: list[str] = []
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    conn.execute("CALL compaction.rebuild_derived_state(2)")
    assert notices[0] == "derived state: rebuilding about 5 conversations"
    assert re.fullmatch(r"derived state: 5 conversations \(5 this run, [0-9.]+ a second\)",
                        notices[-1]), notices
    assert conn.execute("SELECT count(*) FROM compaction.rebuild_progress").fetchone() == (0,)


def test_the_rebuild_writes_its_progress_with_jit_off(conn: Conn) -> None:
    """Each of the rebuild's transactions prices sequential scans out, so its one-row
    writes cost above jit_above_cost: with JIT on they compiled at every commit (60% of a
    rebuild's time). A probe trigger on the progress row records the
    settings every write of it ran under."""
    history = History(conn)
    for k in range(5):
        history.pairs(f"c{k}", 3)
    conn.execute("CREATE TABLE public.jit_probe (jit text, seqscan text)")
    conn.execute("""
        CREATE FUNCTION public.record_jit() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
            INSERT INTO public.jit_probe
            VALUES (current_setting('jit'), current_setting('enable_seqscan'));
            RETURN NEW;
        END $$""")
    conn.execute("CREATE TRIGGER jit_probe BEFORE UPDATE ON compaction.source_tracking"
                 " FOR EACH ROW EXECUTE FUNCTION public.record_jit()")
    conn.execute("SET jit = on")
    conn.execute("CALL compaction.rebuild_derived_state(1)")
    seen = conn.execute("SELECT jit, seqscan, count(*) FROM public.jit_probe"
                        " GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
    # The first write (the rebuild's start) runs before any setting; every later one
    # (five batches of one conversation, then the stamp) under the rebuild's settings.
    assert seen == [("off", "off", 6), ("on", "on", 1)], seen
    assert state(conn) == "in_use"


def generations(conn: Conn) -> dict[str, int]:
    return {str(c): int(g) for c, g in conn.execute(
        "SELECT conversation_id, generation FROM compaction.conversation_state")}


def test_a_cancelled_rebuild_resumes_after_its_last_commit(dsn: str, conn: Conn) -> None:
    """The rebuild keeps its resume point in the database. Cancelled while
    it waits for conversation c3 (another connection holds that row), it has committed
    c0-c2; the next CALL derives c3-c5 only (a re-derivation bumps the conversation's
    generation, so the generations say which conversations each run touched)."""
    history = History(conn)
    names = [f"c{k}" for k in range(6)]
    for name in names:
        history.pairs(name, 3)
    before = generations(conn)
    failure: list[BaseException] = []
    with psycopg.connect(dsn) as blocker, \
            psycopg.connect(dsn, autocommit=True) as rebuilder:
        blocker.execute("SELECT 1 FROM compaction.conversation_state"
                        " WHERE conversation_id = 'c3' FOR UPDATE")
        pid = rebuilder.info.backend_pid

        def rebuild() -> None:
            try:
                rebuilder.execute("CALL compaction.rebuild_derived_state(1)")
            except BaseException as exc:  # handed to the test's thread
                failure.append(exc)

        thread = threading.Thread(target=rebuild)
        thread.start()
        # The barrier: the rebuild waits for the row the blocker holds.
        while pid not in [int(p) for (p,) in conn.execute(
                "SELECT pid FROM pg_catalog.pg_locks WHERE NOT granted")]:
            assert thread.is_alive(), failure
        assert conn.execute("SELECT done, resume_after, resumable, total"
                            " FROM compaction.rebuild_progress").fetchone() == (
            3, "c2", True, 6)
        conn.execute("SELECT pg_catalog.pg_cancel_backend(%s)", (pid,))
        thread.join()
        blocker.rollback()
    assert len(failure) == 1
    assert isinstance(failure[0], psycopg.errors.QueryCanceled)
    assert state(conn) == "in_use"  # the stamp is the same: the rebuild did not restamp
    first = generations(conn)
    assert [first[n] - before[n] for n in names] == [1, 1, 1, 0, 0, 0]

    notices: list[str] = []
    conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert notices[0] == "derived state: resuming after conversation c2 (3 of about 6 done)"
    assert notices[-1].startswith("derived state: 6 conversations (3 this run, ")
    second = generations(conn)
    assert [second[n] - first[n] for n in names] == [0, 0, 0, 1, 1, 1]
    assert conn.execute("SELECT count(*) FROM compaction.rebuild_progress").fetchone() == (0,)
    assert state(conn) == "in_use"
    for name in names:
        assert problems(conn, name) == []
    # Finished: the next CALL starts over.
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert [generations(conn)[n] - second[n] for n in names] == [1] * 6


def test_a_rebuild_under_another_source_starts_over(conn: Conn) -> None:
    """The resume point holds only under the source stamp it was made under: re-pointed
    views may derive the finished conversations otherwise."""
    history = History(conn)
    for k in range(3):
        history.pairs(f"c{k}", 3)
    conn.execute("UPDATE compaction.source_tracking SET rebuild_stamp = 'another source',"
                 " rebuild_after = 'c1', rebuild_done = 2, rebuild_total = 3,"
                 " rebuild_started_at = now(), rebuild_updated_at = now()")
    before = generations(conn)
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert [generations(conn)[f"c{k}"] - before[f"c{k}"] for k in range(3)] == [1, 1, 1]


def test_repair_after_writes_with_the_triggers_disabled(conn: Conn) -> None:
    history = History(conn)
    history.pairs("c", 30)
    conn.execute("ALTER TABLE compaction_source.messages DISABLE TRIGGER messages_track_update")
    assert state(conn) == "untracked"
    conn.execute("UPDATE compaction_source.messages SET content = 'edited'"
                 " WHERE message_id = (SELECT assistant_message_id FROM compaction.pairs"
                 "                     WHERE conversation_id = 'c' AND pair_index = 3)")
    conn.execute("ALTER TABLE compaction_source.messages"
                 " ENABLE ALWAYS TRIGGER messages_track_update")
    # The stale range is named, and not used: the triggers changed since the stamp.
    assert state(conn) == "not_rebuilt"
    assert [p for p, _ in problems(conn, "c")] == ["pair_differs", "range_hash_differs"]
    conn.execute("SELECT compaction.rederive_conversation('c')")
    assert problems(conn, "c") == []
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert state(conn) == "in_use"


def test_repeatable_read_writers_of_one_conversation_conflict(dsn: str, conn: Conn) -> None:
    """A writer whose snapshot misses another writer's commit fails; it never numbers
    pairs from a stale view."""
    history = History(conn)
    history.pairs("c", 5)
    run = history.run("c", status="running")
    history.message("c", run, "user", "q", seq=1000)
    history.message("c", run, "assistant", "a", seq=1001)
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        second.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        second.execute("SELECT 1 FROM compaction_source.runs LIMIT 1")  # take the snapshot
        first.execute("UPDATE compaction_source.runs SET status = 'completed'"
                      " WHERE run_id = %s", (run,))
        first.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            second.execute(
                "INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
                " VALUES ('c:late', 'c', 'completed')")
        second.rollback()
    assert pair_indexes(conn, "c") == list(range(6))
    assert problems(conn, "c") == []


def wait_for_lock_wait(conn: Conn, pid: int, timeout: float = 30.0) -> None:
    """Until backend `pid` waits on a lock (polled from pg_stat_activity, bounded)."""
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                       (pid,)).fetchone() != ("Lock",):
        assert time.monotonic() < deadline, "the second writer never waited"
        time.sleep(0.01)


def test_read_committed_writers_wait_and_number_in_commit_order(dsn: str, conn: Conn) -> None:
    history = History(conn)
    history.pairs("c", 3)
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        first.execute("INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
                      " VALUES ('c:w0', 'c', 'completed')")
        first.execute("INSERT INTO compaction_source.messages (message_id, conversation_id,"
                      " run_id, role, status, content, seq) VALUES"
                      " ('c:w0u', 'c', 'c:w0', 'user', 'completed', 'q', 2000),"
                      " ('c:w0a', 'c', 'c:w0', 'assistant', 'completed', 'a', 2001)")
        failure: list[BaseException] = []

        def second_writes() -> None:
            try:
                second.execute("INSERT INTO compaction_source.runs (run_id, conversation_id,"
                               " status) VALUES ('c:w1', 'c', 'completed')")
                second.execute("INSERT INTO compaction_source.messages (message_id,"
                               " conversation_id, run_id, role, status, content, seq) VALUES"
                               " ('c:w1u', 'c', 'c:w1', 'user', 'completed', 'q', 1000),"
                               " ('c:w1a', 'c', 'c:w1', 'assistant', 'completed', 'a', 1001)")
                second.commit()
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)

        thread = threading.Thread(target=second_writes)
        thread.start()
        # The second writer waits on the conversation's derived state, held by the first.
        wait_for_lock_wait(conn, second.info.backend_pid)
        first.commit()
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert failure == []
    # The second run sorts before the first (lower seq) although it committed later.
    rows = conn.execute("SELECT run_id FROM compaction.pairs WHERE conversation_id = 'c'"
                        " ORDER BY pair_index").fetchall()
    assert [r[0] for r in rows][-2:] == ["c:w1", "c:w0"]
    assert pair_indexes(conn, "c") == list(range(5))
    assert problems(conn, "c") == []


def test_roles_reach_only_what_they_need(conn: Conn, login_role: LoginRole) -> None:
    History(conn).pairs("c", 30)
    with connect_as(login_role("compaction_auditor")) as auditor:
        assert auditor.execute(
            "SELECT * FROM compaction.verify_conversation('c')").fetchall() == []
        assert auditor.execute("SELECT compaction.derived_state_status()").fetchone() == (
            "in_use",)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            auditor.execute("SELECT compaction.rederive_conversation('c')")
    with connect_as(login_role("compaction_worker")) as worker:
        for statement in ("SELECT compaction.rederive_conversation('c')",
                          "SELECT * FROM compaction.verify_conversation('c')",
                          "SELECT * FROM compaction.pairs",
                          "CALL compaction.rebuild_derived_state()"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                worker.execute(statement)


def test_source_views_may_read_views(conn: Conn) -> None:
    """A source view reading a view of the host's is tracked when the
    tables behind both are; the inner view's rule is part of the stamp, so replacing it
    takes the derived state out of use until a rebuild. A materialized view behind the
    source is not tracked (REFRESH fires no trigger)."""
    History(conn).pairs("c", 12)
    conn.execute("CREATE VIEW public.host_runs AS"
                 " SELECT run_id, conversation_id, status FROM compaction_source.runs")
    conn.execute("CREATE OR REPLACE VIEW compaction.source_runs AS"
                 " SELECT r.run_id, r.conversation_id, r.status FROM public.host_runs AS r")
    conn.execute("GRANT SELECT ON public.host_runs TO compaction_owner")
    assert state(conn) == "not_rebuilt"
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert state(conn) == "in_use"
    History(conn).pairs("c", 3)
    assert pair_indexes(conn, "c") == list(range(15))
    assert problems(conn, "c") == []
    conn.execute("CREATE OR REPLACE VIEW public.host_runs AS"
                 " SELECT run_id, conversation_id, status FROM compaction_source.runs")
    assert state(conn) == "not_rebuilt"
    conn.execute("CALL compaction.rebuild_derived_state()")
    assert state(conn) == "in_use"
    conn.execute("CREATE MATERIALIZED VIEW public.frozen_runs AS"
                 " SELECT run_id, conversation_id, status FROM compaction_source.runs")
    conn.execute("CREATE OR REPLACE VIEW public.host_runs AS"
                 " SELECT run_id, conversation_id, status FROM public.frozen_runs")
    assert state(conn) == "untracked"
