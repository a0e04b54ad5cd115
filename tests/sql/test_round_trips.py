"""One network round trip per engine call, read off the wire.

libpq's protocol trace lists every message the client sends (F) and receives (B). A call
costs one round trip when all of its messages leave before any answer comes back. The
driver has two forms (db._call). A bound call sends its statements in a pipeline that a
single Sync ends: the server answers nothing before a Sync or a Flush, so the client
cannot have waited in between (psycopg follows the closing Sync with a Flush request;
sent after the Sync, it adds no wait). An inline call sends one simple-protocol Query
holding both statements, its values written into the text.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import pq
from psycopg.rows import tuple_row

from pycompactor import db, project_history, source_hash
from pycompactor import projection as projection_module
from pycompactor.errors import InvalidLease, PycompactorError, StatementCanceled
from pycompactor.hashing import source_message_ids
from pycompactor.projection import Projection
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from tests.history import History

Conn = psycopg.Connection[Any]


def wire(conn: Conn, action: Callable[[], object]) -> list[tuple[str, str]]:
    """(direction, message type) of every protocol message `action` exchanged."""
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            action()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        lines = trace.read().splitlines()
    return [(fields[0], fields[2]) for fields in (line.split("\t") for line in lines)]


def assert_one_round_trip(messages: list[tuple[str, str]], statements: int = 2,
                          form: str = "bound") -> None:
    sent = [kind for direction, kind in messages if direction == "F"]
    first_answer = next(i for i, (direction, _) in enumerate(messages) if direction == "B")
    # The Flush psycopg sends after the Sync may be traced after the first answer arrived
    # (on a loaded machine): it asks for nothing the call waits on, so it is not a trip.
    assert all(direction == "B" or kind == "Flush"
               for direction, kind in messages[first_answer:]), messages
    received = [kind for direction, kind in messages if direction == "B"]
    assert received.count("ReadyForQuery") == 1
    assert received[-1] == "ReadyForQuery"
    if form == "inline":
        # One simple query, its statements answered in turn, one implicit transaction.
        assert sent == ["Query"], messages
        assert received.count("CommandComplete") == statements, messages
        return
    assert form == "bound", form
    assert sent.count("Sync") == 1, messages
    before_sync = sent[: sent.index("Sync")]
    assert set(sent[len(before_sync) + 1 :]) <= {"Flush"}, messages
    assert "Flush" not in before_sync, messages
    assert "Query" not in sent, messages  # no simple-query BEGIN or COMMIT
    assert before_sync.count("Execute") == statements, messages


def test_every_worker_call_is_one_round_trip(conn: Conn, dsn: str) -> None:
    """The worker's frequent calls, whose values are ids, numbers and codes, go inline;
    every call that carries a summary or a reason, and the rest, bind their values (the
    server logs a failing statement's text, never its bound values by default)."""
    History(conn).pairs("c", 30)
    with db.connect(dsn) as worker:
        [target] = db.plan_targets(worker, "c")
        calls: dict[str, tuple[str, Callable[[], object]]] = {
            "plan_targets": ("inline", lambda: db.plan_targets(worker, "c")),
            "eligible_pairs": ("bound", lambda: db.eligible_pairs(worker, "c")),
            "worker_targets": ("inline", lambda: db.worker_targets(
                worker, "c", "default", "m", PROMPT_VERSION)),
            "range_replies": ("inline", lambda: db.range_replies(
                worker, "c", 0, target.source_hash)),
            "reap": ("inline", lambda: db.reap(worker)),
            "enqueue": ("inline", lambda: db.enqueue(worker, "c")),
            "dequeue": ("inline", lambda: db.dequeue(worker, 10)),
            "conversations_after": ("bound", lambda: db.conversations_after(worker, "", 10)),
        }
        for name, (form, call) in calls.items():
            assert_one_round_trip(wire(worker, call), form=form)
            assert worker.info.transaction_status == pq.TransactionStatus.IDLE, name

        results: list[Any] = []
        messages = wire(worker, lambda: results.append(db.claim(
            worker, "c", "default", 0, target.source_message_ids, target.source_hash, "m",
            PROMPT_VERSION, "w")))
        assert_one_round_trip(messages, form="inline")
        [claimed] = results
        assert claimed.claimed, claimed
        token = (claimed.job_id, claimed.attempt)
        assert_one_round_trip(wire(worker, lambda: db.heartbeat(worker, *token)),
                              form="inline")
        assert_one_round_trip(wire(worker, lambda: db.complete(
            worker, *token, "A summary.", "stop", 0)), form="bound")
        assert_one_round_trip(wire(worker, lambda: db.fail(worker, *token, "late")),
                              form="bound")
        # Committed: another session sees the summary.
        assert conn.execute("SELECT count(*) FROM compaction.summaries").fetchone() == (1,)
        # Nothing of the call's settings outlives it.
        assert worker.execute("SHOW lock_timeout").fetchone() == ("0",)
        assert worker.execute("SHOW statement_timeout").fetchone() == ("0",)


def test_an_inline_call_inside_the_callers_pipeline_is_sent_bound(conn: Conn, dsn: str) -> None:
    """A pipeline cannot carry a simple query: inside the caller's pipeline an inline call
    takes the bound form, joins the pipeline's implicit transaction, and the pipeline goes
    on."""
    History(conn).pairs("c", 30)
    with db.connect(dsn) as worker:
        [target] = db.plan_targets(worker, "c")
        with worker.pipeline():
            claimed = db.claim(worker, "c", "default", 0, target.source_message_ids,
                               target.source_hash, "m", PROMPT_VERSION, "w")
            assert claimed.claimed, claimed
            assert [t.from_pair for t in db.plan_targets(worker, "c")] == [0]
        assert worker.info.transaction_status == pq.TransactionStatus.IDLE
        assert worker.execute("SHOW lock_timeout").fetchone() == ("0",)
    assert conn.execute("SELECT count(*) FROM compaction.attempts").fetchone() == (1,)


def test_a_failed_call_leaves_the_connection_idle_and_clean(conn: Conn, dsn: str) -> None:
    """The Sync that ends a failed call rolls its transaction back: no aborted transaction
    is left for the next call, and no setting outlives it."""
    History(conn).pairs("c", 30)
    with db.connect(dsn) as worker:
        [target] = db.plan_targets(worker, "c")
        claim_args = ("c", "default", 0, target.source_message_ids, target.source_hash, "m",
                      PROMPT_VERSION, "w")
        with pytest.raises(InvalidLease, match="between 1 second and 1 day"):
            db.claim(worker, *claim_args, lease=timedelta(0))  # a CP error in the call
        assert worker.info.transaction_status == pq.TransactionStatus.IDLE
        assert worker.execute("SHOW lock_timeout").fetchone() == ("0",)
        assert db.claim(worker, *claim_args).claimed


@pytest.mark.parametrize("inline", [False, True], ids=["bound", "inline"])
def test_the_calls_own_statement_timeout_governs_it_in_the_same_round_trip(
        dsn: str, inline: bool) -> None:
    """Sent in the same pipeline as the call, or in the same simple query, the set_config
    still decides the call's statement_timeout (each statement's timer starts with that
    statement), whatever the session's own setting, which it leaves as it was."""
    sleep: LiteralString = "SELECT pg_sleep(0.6)"
    generous = db.Timeouts(statement=timedelta(seconds=30))
    with db.connect(dsn, timeouts=generous) as c:
        c.execute("SET statement_timeout = '300ms'")
        with db._call(c, tuple_row, inline=inline) as cur:
            cur.execute(sleep, {})
            assert cur.fetchone() == ("",)
        assert c.execute("SHOW statement_timeout").fetchone() == ("300ms",)
    strict = db.Timeouts(statement=timedelta(milliseconds=200))
    with db.connect(dsn, timeouts=strict) as c:
        c.execute("SET statement_timeout = '30s'")
        with pytest.raises(StatementCanceled), db._call(c, tuple_row, inline=inline) as cur:
            cur.execute(sleep, {})
        assert c.info.transaction_status == pq.TransactionStatus.IDLE
        assert c.execute("SHOW statement_timeout").fetchone() == ("30s",)


def test_a_read_only_connection_makes_each_call_read_only(conn: Conn, dsn: str) -> None:
    """`connect(read_only=True)`: with no BEGIN, in either form, the call's transaction is
    made READ ONLY by its first statement; reads work, a write is refused and rolled back,
    and nothing is left on the session."""
    History(conn).pairs("c", 30)
    [target] = db.plan_targets(conn, "c")
    claimed = db.claim(conn, "c", "default", 0, target.source_message_ids,
                       target.source_hash, "m", PROMPT_VERSION, "w")
    assert claimed.job_id is not None
    assert claimed.attempt is not None
    with db.connect(dsn, read_only=True) as reader:
        assert [t.from_pair for t in db.plan_targets(reader, "c")] == [0]
        assert_one_round_trip(wire(reader, lambda: db.plan_targets(reader, "c")),
                              form="inline")
        assert_one_round_trip(wire(reader, lambda: db.eligible_pairs(reader, "c")))
        with pytest.raises(PycompactorError, match="read-only transaction"):
            db.enqueue(reader, "c")  # inline
        with pytest.raises(PycompactorError, match="read-only transaction"):
            db.fail(reader, claimed.job_id, claimed.attempt, "late")  # bound
        assert reader.info.transaction_status == pq.TransactionStatus.IDLE
        assert reader.execute("SHOW transaction_read_only").fetchone() == ("off",)
    assert [(a, s) for a, s in conn.execute(
        "SELECT attempt, state FROM compaction.attempts")] == [(1, "running")]


@pytest.mark.parametrize("inline", [False, True], ids=["bound", "inline"])
def test_a_commit_refused_at_the_sync_raises_its_sqlstate_and_the_connection_goes_on(
        conn: Conn, dsn: str, inline: bool) -> None:
    """A transaction can fail at its commit after every statement in it succeeded (a
    serialization failure under SERIALIZABLE, a deferred constraint): the server answers
    the Sync with the error. The call raises that error, by its SQLSTATE, and the same
    connection takes the next call, which is how an application retries a 40001."""
    conn.execute("CREATE TABLE public.deferred_check (k int"
                 " CONSTRAINT deferred_check_k_key UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    conn.execute("GRANT INSERT, SELECT ON public.deferred_check TO PUBLIC")
    with db.connect(dsn) as c:
        with pytest.raises(PycompactorError, match="23505") as refused, \
                db._call(c, tuple_row, inline=inline) as cur:
            cur.execute("INSERT INTO public.deferred_check VALUES (1), (1)", {})
        assert isinstance(refused.value.__cause__, psycopg.errors.UniqueViolation)
        assert c.info.transaction_status == pq.TransactionStatus.IDLE
        assert c.pgconn.pipeline_status == pq.PipelineStatus.OFF
        with db._call(c, tuple_row, inline=inline) as cur:
            cur.execute("INSERT INTO public.deferred_check VALUES (2) RETURNING k", {})
            assert cur.fetchone() == (2,)
        assert c.execute("SHOW lock_timeout").fetchone() == ("0",)
    assert conn.execute("SELECT k FROM public.deferred_check").fetchall() == [(2,)]


def projected_on_the_wire(dsn: str,
                          placements: list[str] | None = None) -> list[tuple[str, str]]:
    """The protocol messages of one projection of conversation "c" (40 pairs; every pair
    raw unless `placements` says otherwise) on a fresh autocommit connection, which it
    leaves idle."""
    with db.connect(dsn) as reader:
        results: list[Projection] = []
        messages = wire(reader, lambda: results.append(
            project_history(reader, "c", budget_bytes=64 * 1024)))
        assert reader.info.transaction_status == pq.TransactionStatus.IDLE
    [projection] = results
    assert [p.placement for p in projection.pairs] == (placements or ["raw"] * 40)
    return messages


def test_a_projection_is_one_statement_in_one_round_trip(conn: Conn, dsn: str) -> None:
    """project_history on an autocommit connection: one statement,
    compaction.projection_read, with no BEGIN or COMMIT: the statement's own snapshot
    holds the frame and the texts."""
    History(conn).pairs("c", 40)
    assert_one_round_trip(projected_on_the_wire(dsn), statements=1)


def test_judged_from_the_views_a_projection_is_one_statement_too(conn: Conn, dsn: str) -> None:
    """With the derived state out of use the same one statement judges the conversation
    from the views (its frame holds every pair and verdict), still in one round trip, not
    the pairs, then the summaries, then the texts read in a snapshot of the driver's
    own."""
    History(conn).pairs("c", 40)
    conn.execute("ALTER TABLE compaction_source.runs DISABLE TRIGGER runs_track_insert")
    assert conn.execute("SELECT compaction.derived_state_current()").fetchone() == (False,)
    assert_one_round_trip(projected_on_the_wire(dsn), statements=1)


def test_a_projection_the_statement_cannot_serve_reads_again_in_one_snapshot(
        conn: Conn, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the one statement did not send a text the driver's walk includes (told a
    wrong marker size, the engine's walk drops the summary block the driver takes), the
    frame and the texts are read again in one repeatable-read snapshot: BEGIN with the
    frame, COMMIT with the texts."""
    pairs = History(conn).pairs("c", 40)
    block = pairs[:10]
    conn.execute("SELECT compaction.import_summary('c', 'default', 0, %s, %s, 'test-model',"
                 " %s, 'summary of 0', now())",
                 (source_message_ids(block), source_hash(block), PROMPT_VERSION))
    monkeypatch.setattr(projection_module, "_MARKER_BYTES", 10_000_000)
    messages = projected_on_the_wire(dsn, ["summarized"] * 10 + ["raw"] * 30)
    assert "Query" not in [kind for direction, kind in messages if direction == "F"]
    batches: list[list[str]] = [[]]
    for direction, kind in messages:
        if direction == "F":
            batches[-1].append(kind)
        elif kind == "ReadyForQuery":
            batches.append([])
    # projection_read; BEGIN + frame; texts + COMMIT.
    assert [b.count("Execute") for b in batches if b] == [1, 2, 2], batches
