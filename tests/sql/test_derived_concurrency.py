"""Derived state under concurrent writers (contract §2; notes on derived state, trap 1).

Processes append Runs to one conversation while others claim, complete and project it, all
released by one barrier; afterwards the pairs equal tests/recompute.py's recomputation,
pair_index runs 0..N-1 without gaps and verify_conversation is empty. Two deterministic
two-connection interleavings pin the serialisation of one conversation's writers: the
second writer waits for the first (observed in pg_locks, never a sleep) and numbers after
its commit, or, at REPEATABLE READ, fails with a serialization error rather than number
from a stale snapshot.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pycompactor import db, project_history
from tests.history import History
from tests.recompute import (
    assert_c_collation,
    assert_matches,
    derived_state_in_use,
    engine_pairs,
    pairs_of,
    read_reference,
    targets_of,
    verify,
)
from tests.sql.engine import GOOD, MODEL, V3, wait_until_blocked

Conn = psycopg.Connection[Any]
HOT = "hot"
INITIAL = 25
APPENDERS = 3
RUNS_PER_APPENDER = 25
PROJECTORS = 2
_CTX = mp.get_context("fork")

CLAIM_REASONS = {"claimed", "already_completed", "already_running", "source_mismatch",
                 "not_eligible"}


def append_run(conn: Conn, run_id: str, *, one_transaction: bool) -> None:
    """A Run as an agent writes it: run, user message, streaming reply, then settled."""

    def statements() -> None:
        conn.execute("INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
                     " VALUES (%s, %s, 'running')", (run_id, HOT))
        conn.execute(
            "INSERT INTO compaction_source.messages"
            " (message_id, conversation_id, run_id, role, status, content, seq) VALUES"
            " (%s, %s, %s, 'user', 'completed', %s, nextval('public.append_seq')),"
            " (%s, %s, %s, 'assistant', 'streaming', %s, nextval('public.append_seq'))",
            (f"{run_id}:u", HOT, run_id, f"question of {run_id}",
             f"{run_id}:a", HOT, run_id, f"answer of {run_id}"))
        conn.execute("UPDATE compaction_source.messages SET status = 'completed'"
                      " WHERE message_id = %s", (f"{run_id}:a",))
        conn.execute("UPDATE compaction_source.runs SET status = 'completed' WHERE run_id = %s",
                     (run_id,))

    if one_transaction:
        with conn.transaction():
            statements()
    else:
        statements()


def _appender(dsn: str, barrier: Any, results: Any, name: str) -> None:
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait(timeout=60)
            for i in range(RUNS_PER_APPENDER):
                append_run(conn, f"{name}-{i:02d}", one_transaction=i % 3 != 0)
        results.put(("appender", name, None))
    except Exception as exc:  # reported to the test process
        results.put(("appender", name, repr(exc)))


def _claim_round(conn: Conn, name: str) -> Counter[str]:
    """Claim and complete every target of the plan as it is now."""
    outcomes: Counter[str] = Counter()
    for t in db.plan_targets(conn, HOT):
        c = db.claim(conn, HOT, "default", t.from_pair, t.source_message_ids, t.source_hash,
                     MODEL, V3, name)
        outcomes[f"claim:{c.reason}"] += 1
        if c.claimed:
            assert c.job_id is not None
            assert c.attempt is not None
            done = db.complete(conn, c.job_id, c.attempt, f"{GOOD} {t.from_pair}", "stop", 0)
            outcomes[f"complete:{done.reason}"] += 1
    return outcomes


def _projector(dsn: str, barrier: Any, stop: Any, results: Any, name: str) -> None:
    """Claims, completes and projects until the appenders are done, then one last round."""
    try:
        outcomes: Counter[str] = Counter()
        seen = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait(timeout=60)
            while True:
                last = stop.is_set()
                outcomes += _claim_round(conn, name)
                for budget in (2_000, 1_000_000):
                    p = project_history(conn, HOT, budget_bytes=budget)
                    indices = [pp.pair_index for pp in p.pairs]
                    assert indices == list(range(len(indices))), indices
                    assert len(indices) >= seen, (len(indices), seen)  # appends only
                    seen = len(indices)
                    assert p.used_bytes <= budget
                outcomes["projections"] += 1
                if last:
                    break
        results.put(("projector", name, dict(outcomes)))
    except Exception as exc:  # reported to the test process
        results.put(("projector", name, repr(exc)))


@pytest.mark.slow
def test_appends_claims_and_projections_of_one_conversation(conn: Conn, dsn: str) -> None:
    assert_c_collation(conn)
    conn.execute("CREATE SEQUENCE public.append_seq START 1000")
    History(conn).pairs(HOT, INITIAL)
    assert derived_state_in_use(conn)

    barrier = _CTX.Barrier(APPENDERS + PROJECTORS)
    stop = _CTX.Event()
    results: Any = _CTX.Queue()
    appenders = [_CTX.Process(target=_appender, args=(dsn, barrier, results, f"w{i}"),
                              daemon=True) for i in range(APPENDERS)]
    projectors = [_CTX.Process(target=_projector, args=(dsn, barrier, stop, results, f"p{i}"),
                               daemon=True) for i in range(PROJECTORS)]
    for p in appenders + projectors:
        p.start()
    reports: list[tuple[str, str, Any]] = []
    while sum(r[0] == "appender" for r in reports) < APPENDERS:
        reports.append(results.get(timeout=300))
    stop.set()
    while len(reports) < APPENDERS + PROJECTORS:
        reports.append(results.get(timeout=300))
    assert [r for r in reports if r[0] == "appender" and r[2] is not None] == []
    for p in appenders + projectors:
        p.join(timeout=60)
        assert p.exitcode == 0

    outcomes: Counter[str] = Counter()
    for kind, name, report in reports:
        if kind == "projector":
            assert isinstance(report, dict), f"{name}: {report}"
            outcomes.update(report)
    assert {k.split(":", 1)[1] for k in outcomes if k.startswith("claim:")} <= CLAIM_REASONS
    assert outcomes["claim:claimed"] >= 1
    assert outcomes["claim:claimed"] == outcomes["complete:completed"]

    raw = read_reference(conn, [HOT])
    pairs = pairs_of(raw, HOT)
    total = INITIAL + APPENDERS * RUNS_PER_APPENDER
    assert len(pairs) == total
    assert [p[0] for p in engine_pairs(conn, HOT)] == list(range(total))
    assert_matches(conn, raw, [HOT])
    assert verify(conn, HOT) == []

    # The last rounds ran after every append: each final target holds a completed summary
    # of its current source, and no identity holds two.
    for from_pair, _, ids, digest in targets_of(pairs):
        assert conn.execute(
            "SELECT count(*) FROM compaction.summaries WHERE conversation_id = %s"
            " AND from_pair = %s AND source_hash = %s AND source_message_ids = %s",
            (HOT, from_pair, digest, ids)).fetchone() == (1,), from_pair
    assert conn.execute(
        "SELECT count(*) = count(DISTINCT (from_pair, source_hash, model, prompt_version))"
        " FROM compaction.summaries WHERE conversation_id = %s", (HOT,)).fetchone() == (True,)
    final = project_history(conn, HOT, budget_bytes=1_000_000)
    assert [p.pair_index for p in final.pairs] == list(range(total))
    assert {r.reason for r in final.rejected_summaries} <= {"stale_source", "superseded"}


# ---------------------------------------------------------------------------------------
# Deterministic interleavings of two writers of one conversation
# ---------------------------------------------------------------------------------------


def settled_run(conn: Conn, run_id: str, seq: int) -> None:
    """Run, user, assistant and the status update, inside the caller's transaction."""
    conn.execute("INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
                 " VALUES (%s, 'c', 'running')", (run_id,))
    conn.execute(
        "INSERT INTO compaction_source.messages"
        " (message_id, conversation_id, run_id, role, status, content, seq) VALUES"
        " (%s, 'c', %s, 'user', 'completed', 'q', %s),"
        " (%s, 'c', %s, 'assistant', 'completed', 'a', %s)",
        (f"{run_id}:u", run_id, seq, f"{run_id}:a", run_id, seq + 1))
    conn.execute("UPDATE compaction_source.runs SET status = 'completed' WHERE run_id = %s",
                 (run_id,))


class Writer:
    """A second writer: `write` on its own thread and connection, at `isolation`, its
    transaction committed at the end (an error is handed to the test thread)."""

    def __init__(self, dsn: str, write: Callable[[Conn], None],
                 isolation: psycopg.IsolationLevel = psycopg.IsolationLevel.READ_COMMITTED
                 ) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.isolation_level = isolation
        pid = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        assert pid is not None
        self.pid: int = pid[0]
        self.conn.commit()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                write(self.conn)
                self.conn.commit()
            except BaseException as exc:  # handed to the test thread
                self.error = exc
                self.conn.rollback()

        self.thread = threading.Thread(target=run, daemon=True)

    def join(self) -> BaseException | None:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        return self.error


def write_in_turn(conn: Conn, dsn: str, first_write: Callable[[Conn], None],
                  second_write: Callable[[Conn], None]) -> None:
    """first_write in a transaction left open; second_write from a Writer, which must
    block on it; then the first commits, and the second must finish without an error."""
    first = psycopg.connect(dsn)
    second = Writer(dsn, second_write)
    try:
        first_write(first)  # holds its transaction open
        second.thread.start()
        wait_until_blocked(conn, second.pid)
        first.commit()
        assert second.join() is None
    finally:
        first.close()
        second.conn.close()


@pytest.mark.parametrize("second_seq", [1000, 50], ids=["after", "before"])
def test_second_writer_waits_and_numbers_after_the_first_commits(
    conn: Conn, dsn: str, second_seq: int
) -> None:
    History(conn).pairs("c", 5)  # seqs 1..10
    first = psycopg.connect(dsn)
    second = Writer(dsn, lambda c: settled_run(c, "second", second_seq),
                    psycopg.IsolationLevel.READ_COMMITTED)
    try:
        settled_run(first, "first", 100)  # holds its transaction open
        second.thread.start()
        wait_until_blocked(conn, second.pid)
        assert [p[1] for p in engine_pairs(conn, "c")][5:] == []  # neither committed
        first.commit()
        assert second.join() is None
    finally:
        first.close()
        second.conn.close()
    runs = [p[1] for p in engine_pairs(conn, "c")]
    assert runs[5:] == (["first", "second"] if second_seq > 100 else ["second", "first"])
    assert [p[0] for p in engine_pairs(conn, "c")] == list(range(7))
    assert_matches(conn, read_reference(conn, ["c"]), ["c"])


def test_repeatable_read_writer_fails_instead_of_numbering_from_a_stale_snapshot(
    conn: Conn, dsn: str
) -> None:
    History(conn).pairs("c", 5)
    first = psycopg.connect(dsn)
    second = Writer(dsn, lambda c: settled_run(c, "second", 1000),
                    psycopg.IsolationLevel.REPEATABLE_READ)
    try:
        settled_run(first, "first", 100)
        second.thread.start()
        wait_until_blocked(conn, second.pid)
        first.commit()
        error = second.join()
        assert isinstance(error, psycopg.errors.SerializationFailure), error
        # the retry an application makes on a serialization failure numbers exactly
        settled_run(second.conn, "second", 1000)
        second.conn.commit()
    finally:
        first.close()
        second.conn.close()
    assert [p[1] for p in engine_pairs(conn, "c")][5:] == ["first", "second"]
    assert [p[0] for p in engine_pairs(conn, "c")] == list(range(7))
    assert_matches(conn, read_reference(conn, ["c"]), ["c"])


@pytest.mark.parametrize("first_writer", ["source", "summary"])
def test_a_summary_and_a_source_write_of_its_range_judge_after_each_other(
    conn: Conn, dsn: str, first_writer: str
) -> None:
    """An edit inside range 0 and the import of a summary of range 0, in two transactions
    at once: whichever comes second waits for the first (observed in pg_locks) and then
    judges what it committed. The summary ends `stale_source` (its hash is the one before
    the edit) and verify_conversation is empty, in either order."""
    History(conn).pairs("c", 30)
    [target] = [t for t in db.plan_targets(conn, "c") if t.from_pair == 0]
    reply = conn.execute(
        "SELECT assistant_message_id FROM compaction.eligible_pairs('c') WHERE pair_index = 3"
    ).fetchone()
    assert reply is not None

    def edit(c: Conn) -> None:
        c.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                  " WHERE message_id = %s", reply)

    def summarize(c: Conn) -> None:
        c.execute("SELECT compaction.import_summary('c', 'default', 0, %s, %s, %s, %s,"
                  " 'a summary', now())",
                  (list(target.source_message_ids), target.source_hash, MODEL, V3))

    writes = {"source": edit, "summary": summarize}
    later = "summary" if first_writer == "source" else "source"
    write_in_turn(conn, dsn, writes[first_writer], writes[later])
    assert conn.execute("SELECT reason FROM compaction.summary_verdicts"
                        " WHERE conversation_id = 'c'").fetchall() == [("stale_source",)]
    assert verify(conn, "c") == []
    projection = project_history(conn, "c", budget_bytes=10_000_000)
    assert [(r.from_pair, r.reason) for r in projection.rejected_summaries] == [
        (0, "stale_source")]


def _settled_run_alone(conn: Conn) -> None:
    """A Run written settled before any of its messages (the worked example's order)."""
    conn.execute("INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
                 " VALUES ('late', 'c', 'completed')")


def _messages_of_late(conn: Conn) -> None:
    conn.execute(
        "INSERT INTO compaction_source.messages"
        " (message_id, conversation_id, run_id, role, status, content, seq) VALUES"
        " ('late:u', 'c', 'late', 'user', 'completed', 'q', 100),"
        " ('late:a', 'c', 'late', 'assistant', 'completed', 'a', 101)")


@pytest.mark.parametrize("run_first", [True, False], ids=["run-first", "messages-first"])
def test_a_settled_run_and_its_messages_from_two_writers_pair(
    conn: Conn, dsn: str, run_first: bool
) -> None:
    """A settled Run with no user message changes nothing derived, so its
    statement is not judged. Whichever writer holds the conversation first, the second
    waits for it and then decides on a snapshot that holds its commit: the Run's pair is
    there once both committed. (Messages first: the Run's writer must see them, or it
    would take the Run for one without messages and leave it unpaired.)"""
    History(conn).pairs("c", 5)  # seqs 1..10
    first_write, second_write = ((_settled_run_alone, _messages_of_late) if run_first
                                 else (_messages_of_late, _settled_run_alone))
    write_in_turn(conn, dsn, first_write, second_write)
    assert [p[1] for p in engine_pairs(conn, "c")][5:] == ["late"]
    assert [p[0] for p in engine_pairs(conn, "c")] == list(range(6))
    assert_matches(conn, read_reference(conn, ["c"]), ["c"])


def _stray_message(c: Conn) -> None:
    c.execute("INSERT INTO compaction_source.messages"
              " (message_id, conversation_id, run_id, role, status, content, seq)"
              " VALUES ('stray', 'e', 'shared', 'user', 'completed', 'q', 100)")


def _run_of_stray(c: Conn) -> None:
    c.execute("INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
              " VALUES ('shared', 'e', 'running')")


@pytest.mark.parametrize("run_first", [True, False], ids=["run_first", "message_first"])
def test_a_message_and_its_run_from_two_writers_leave_it_belonging(
    conn: Conn, dsn: str, run_first: bool
) -> None:
    """The record of foreign messages is kept under the conversation's
    row too. A message naming run 'shared' and that run, written to conversation e by two
    writers at once: whichever commits second judges on a snapshot holding the other's
    row, so the message ends up belonging to e's run, never recorded as foreign, and
    conversation c's own run 'shared' stays a pair."""
    h = History(conn)
    h.conversation("e")
    h.run("c", run_id="shared")
    h.message("c", "shared", "user", "question")
    h.message("c", "shared", "assistant", "answer")
    first_write, second_write = ((_run_of_stray, _stray_message) if run_first
                                 else (_stray_message, _run_of_stray))
    write_in_turn(conn, dsn, first_write, second_write)
    assert conn.execute("SELECT * FROM compaction.foreign_messages").fetchall() == []
    assert [p[1] for p in engine_pairs(conn, "c")] == ["shared"]
    assert_matches(conn, read_reference(conn, ["c", "e"]), ["c", "e"])
