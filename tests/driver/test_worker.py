"""The worker in-process, against the real cluster and the scripted loopback model server.

In-process where a unit is clearer than a subprocess: every failure class of the
summarizer contract, the statements one pass sends (10,000 idle conversations), the
source moving between plan, claim and read, heartbeats, scopes, sweep, admission.
"""

from __future__ import annotations

import re
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from unittest.mock import ANY

import psycopg
import pytest

from pycompactor import db
from pycompactor.errors import ModelUnreachable
from pycompactor.models import NextTarget, RangeClaim, RangeReply
from pycompactor.summarizers.openai_compatible import OpenAISummarizer, Summarizer
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig, WorkerReport
from tests.history import History
from tests.modelserver import (
    ModelServer,
    RecordedRequest,
    ScriptedResponse,
    content_filter,
    hang,
    http_error,
    length,
    malformed_json,
    multiple_choices,
    no_choices,
    refusal,
    reply,
    stop,
    too_long,
)
from tests.workerkit import (
    MODEL,
    StringLog,
    attempts,
    events_named,
    seed,
    source_digest,
    summaries,
    wait_for,
)

Conn = psycopg.Connection[Any]


def make_worker(dsn: str, summarizer: Summarizer, log: StringLog, *,
                connect: Callable[[], db.Connection] | None = None,
                **options: Any) -> Worker:
    config = WorkerConfig(model=summarizer.model, dsn=dsn, once=options.pop("once", True),
                          log_format="json", **options)
    return Worker(config, summarizer, connect=connect, log=EventLog("json", stream=log))


def run_once(dsn: str, base_url: str, *, timeout_seconds: float = 10.0,
             **options: Any) -> tuple[WorkerReport, StringLog]:
    log = StringLog()
    with OpenAISummarizer(MODEL, base_url=base_url, api_key="k",
                          timeout_seconds=timeout_seconds) as summarizer:
        report = make_worker(dsn, summarizer, log, **options).run()
    return report, log


@pytest.fixture
def one_range(conn: Conn) -> Iterator[str]:
    """A conversation with exactly one target (pairs 0-9); yields the source fingerprint."""
    seed(conn, "conv-1", 30)
    before = source_digest(conn)
    yield before
    assert source_digest(conn) == before  # a worker never touches the source


# --- acceptance 2: every failure class ends as a failed attempt with its reason ------------

FAILURES: list[tuple[str, list[ScriptedResponse], str]] = [
    # 5xx and 429 are retried once inside the attempt, so the server sees two requests.
    ("http_500", [http_error(500), http_error(500)], "http_500"),
    ("http_503_then_400", [http_error(503), http_error(400)], "http_400"),
    ("http_429", [http_error(429, retry_after="0"), http_error(429, retry_after="0")],
     "http_429"),
    ("http_401", [http_error(401)], "http_401"),
    ("malformed_json", [malformed_json()], "malformed_response"),
    ("zero_choices", [no_choices()], "malformed_response"),
    ("refusal", [refusal("I can't help with that.")], "refusal"),
    ("multiple_choices", [multiple_choices(2)], "multiple_choices"),
    ("finish_length", [length()], "not_stopped"),
    ("content_filter", [content_filter("partial")], "not_stopped"),
    ("tool_call_finish", [reply("text", finish_reason="tool_calls", tool_calls=1)],
     "not_stopped"),
    ("function_call", [reply("text", function_call=True)], "tool_calls"),
    ("empty", [stop(" \t\n ")], "empty"),
    ("null_content", [reply(None)], "empty"),
    ("too_long", [too_long(6001)], "too_long"),
]


@pytest.mark.parametrize(("script", "reason"), [(s, r) for _, s, r in FAILURES],
                         ids=[name for name, _, _ in FAILURES])
def test_failure_class_is_a_failed_attempt(conn: Conn, dsn: str, one_range: str,
                                           model_server: ModelServer,
                                           script: list[ScriptedResponse], reason: str) -> None:
    model_server.enqueue(*script)
    report, log = run_once(dsn, model_server.base_url)
    assert len(model_server.requests) == len(script), log.getvalue()
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn, "conv-1")] == [
        (1, "failed", reason)], log.getvalue()
    assert summaries(conn) == []
    [failed] = events_named(log.events(), "failed")
    assert (failed["outcome"], failed["reason"], failed["attempt"]) == ("failed", reason, 1)
    assert report.outcomes == {"failed": 1}


def test_case_a_good_text_plus_a_tool_call_is_not_a_summary(
        conn: Conn, dsn: str, one_range: str, model_server: ModelServer) -> None:
    """The article's Case A: excellent prose with a normal stop, but also a tool call."""
    prose = "Funds F0-F9 were compared on last week's NAV; this is not the current NAV."
    model_server.enqueue(reply(prose, finish_reason="stop", tool_calls=1))
    run_once(dsn, model_server.base_url)
    [row] = attempts(conn, "conv-1")
    assert (row.state, row.reason) == ("failed", "tool_calls")
    assert summaries(conn) == []
    detail = conn.execute("SELECT finish_reason, tool_call_count, summary_chars"
                          " FROM compaction.attempts").fetchone()
    assert detail == ("stop", 1, len(prose))


def test_timeout(conn: Conn, dsn: str, one_range: str, model_server: ModelServer) -> None:
    model_server.enqueue(hang())
    _report, log = run_once(dsn, model_server.base_url, timeout_seconds=0.5)
    assert [(a.state, a.reason) for a in attempts(conn, "conv-1")] == [("failed", "timeout")]
    assert summaries(conn) == []
    [failed] = events_named(log.events(), "failed")
    assert failed["latency_ms"] >= 500


def test_connection_error(conn: Conn, dsn: str, one_range: str) -> None:
    with socket.socket() as s:  # a port nobody listens on any more
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The first call of the process cannot connect: the worker records the attempt and
    # stops, naming the URL (docs/models.md).
    with pytest.raises(ModelUnreachable, match=f"at http://127.0.0.1:{port}/v1/"):
        run_once(dsn, f"http://127.0.0.1:{port}/v1")
    assert [(a.state, a.reason) for a in attempts(conn, "conv-1")] == [
        ("failed", "connection_error")]
    assert summaries(conn) == []


def test_exactly_6000_characters_is_a_summary(conn: Conn, dsn: str, one_range: str,
                                              model_server: ModelServer) -> None:
    model_server.enqueue(too_long(6000))
    run_once(dsn, model_server.base_url)
    assert [len(text) for _, _, text in summaries(conn)] == [6000]


# --- acceptance 8: one pass touches only the conversation that got new history -----------

_STATEMENTS: list[tuple[str, Any]] = []


class RecordingCursor(psycopg.Cursor[Any]):
    """Records every statement the worker sends (its text and parameters: a bound call's
    are separate, an inline call's are in its text)."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        _STATEMENTS.append((str(query), params))
        return super().execute(query, params, **kwargs)


def _inline(query: str) -> bool:
    """An engine call sent as one query: its transaction-local timeouts come first."""
    return query.startswith("SELECT pg_catalog.set_config('lock_timeout', '")


def _named_args(query: str) -> dict[str, str]:
    """The named arguments of an inline call, as the literals its text holds."""
    return dict(re.findall(r"p_(\w+) => ('(?:[^']|'')*'(?:::\w+(?:\[\])?)*|[^,)]+)", query))


def test_one_pass_touches_only_the_conversation_with_new_history(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    # 10,000 conversations: 9,999 idle ones of 3 pairs, written in one statement per
    # table, and one of 25 pairs.
    conn.execute("""
        INSERT INTO compaction_source.conversations
        SELECT 'idle-' || c FROM generate_series(1, 9999) c;
        INSERT INTO compaction_source.runs (run_id, conversation_id, status)
        SELECT 'idle-' || c || '-r' || p, 'idle-' || c, 'completed'
        FROM generate_series(1, 9999) c, generate_series(1, 3) p;
        INSERT INTO compaction_source.messages
            (message_id, conversation_id, run_id, role, status, content, seq)
        SELECT 'idle-' || c || '-' || role || p, 'idle-' || c, 'idle-' || c || '-r' || p,
               role, 'completed', role || ' text ' || p, 2 * p + (role = 'assistant')::int
        FROM generate_series(1, 9999) c, generate_series(1, 3) p,
             unnest(ARRAY['user', 'assistant']) role;
    """)
    history = History(conn)
    history.pairs("conv-hot", 25)
    assert conn.execute("SELECT count(*) FROM compaction_source.conversations").fetchone() == (
        10000,)
    # Nothing is waiting: every conversation was looked at long ago.
    conn.execute("DELETE FROM compaction.queue")
    # 10 more pairs arrive in one of them (25 -> 35 pairs: range 0-9 becomes a target);
    # the reference tables' trigger enqueues it.
    history.pairs("conv-hot", 10)
    assert conn.execute("SELECT conversation_id FROM compaction.queue").fetchall() == [
        ("conv-hot",)]

    model_server.enqueue(stop("Summary of conv-hot."))
    _STATEMENTS.clear()
    run_once(dsn, model_server.base_url, connect=lambda: psycopg.connect(
        dsn, autocommit=True, cursor_factory=RecordingCursor))

    assert summaries(conn) == [("conv-hot", 0, "Summary of conv-hot.")]
    # The model call runs in its own thread, so complete and the main thread's second
    # dequeue interleave either way: compare the statements as a multiset.
    calls = Counter(_function_of(query) for query, _ in _STATEMENTS
                    if query != db.TIMEOUTS_SQL)
    # Each engine call runs in its own transaction, after its transaction-local timeouts:
    # the statement before it, or the first of its own query.
    assert sum(query == db.TIMEOUTS_SQL or _inline(query)
               for query, _ in _STATEMENTS) == calls.total()
    assert calls == Counter({
        "start-up check": 1,            # schema revision and grants, before `started`
        "compaction.reap": 1,
        "compaction.dequeue": 2,        # one queued conversation, then an empty queue
        # The look and the claim of every target of the conversation, one judgement.
        "compaction.claim_next_targets": 1,
        "compaction.ack": 1,            # the examined entry
        "compaction.range_replies": 1,  # the claimed range's 10 replies, nothing else
        "compaction.complete": 1,
    }), _STATEMENTS
    conversations = {v for _, params in _STATEMENTS if isinstance(params, dict)
                     for k, v in params.items() if k == "conversation_id"}
    conversations |= {_named_args(query).get("conversation_id") for query, _ in _STATEMENTS
                      if _inline(query) and "p_conversation_id" in query}
    assert conversations == {"conv-hot", "'conv-hot'::text"}
    assert not any("idle-" in query for query, _ in _STATEMENTS)


def _function_of(query: str) -> str:
    """The engine function a statement calls (every worker statement calls exactly one,
    but the start-up check of the worker's grants)."""
    if query == db.WORKER_ACCESS_SQL:
        return "start-up check"
    start = query.index("compaction.")
    return query[start:query.index("(", start)]


# --- the claimed source is the summarized source --------------------------------------


def _rewrite_reply(conn: Conn, message_id: str, text: str) -> None:
    conn.execute("UPDATE compaction_source.messages SET content = %s WHERE message_id = %s",
                 (text, message_id))


def test_source_moving_between_the_look_and_a_later_claim_is_refused(
        conn: Conn, dsn: str, model_server: ModelServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One model call free, two targets: the look claims range 0 and leaves range 10 for a
    later batch. History edited before that batch's claim: the claim binds the hash that
    was looked at, so the database refuses it (source_mismatch), the stale text never
    reaches the model, and the conversation is put back; the next pass summarizes the
    edited reply."""
    seed(conn, "conv-1", 40)
    real_claim = db.claim_targets

    def edit_then_claim(c: db.Connection, *args: Any, **kwargs: Any) -> list[RangeClaim]:
        _rewrite_reply(conn, "conv-1-a013", "Edited after the look: NAV 99.99 on 2026-04-01.")
        return real_claim(c, *args, **kwargs)

    monkeypatch.setattr(db, "claim_targets", edit_then_claim)
    model_server.enqueue(stop("range 0"))
    _report, log = run_once(dsn, model_server.base_url, conversation="conv-1",
                            concurrency=1)
    assert [(e["from_pair"], e["reason"]) for e in events_named(log.events(),
                                                                "claim_refused")] == [
        (10, "source_mismatch")]
    assert [(a.attempt, a.state) for a in attempts(conn)] == [(1, "completed")]
    [request] = model_server.requests
    assert b"Edited after the look" not in request.body
    assert conn.execute("SELECT conversation_id FROM compaction.queue").fetchall() == [
        ("conv-1",)]

    monkeypatch.setattr(db, "claim_targets", real_claim)
    model_server.enqueue(stop("range 10"))
    run_once(dsn, model_server.base_url)
    assert b"Edited after the look: NAV 99.99 on 2026-04-01." in model_server.requests[1].body
    assert summaries(conn) == [("conv-1", 0, "range 0"), ("conv-1", 10, "range 10")]


def test_source_moving_between_claim_and_read_fails_the_attempt_unsent(
        conn: Conn, dsn: str, model_server: ModelServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Edited after the claim, before its replies are read: range_replies returns nothing
    for the claimed hash, so the attempt is failed source_moved without a model call, and
    the next pass summarizes the edited range under its new hash."""
    seed(conn, "conv-1", 30)
    real_read = db.range_replies

    def edit_then_read(c: db.Connection, *args: Any) -> list[RangeReply]:
        _rewrite_reply(conn, "conv-1-a005", "Edited after the claim.")
        return real_read(c, *args)

    monkeypatch.setattr(db, "range_replies", edit_then_read)
    _report, log = run_once(dsn, model_server.base_url, conversation="conv-1")
    assert [(e["reason"], e["outcome"]) for e in events_named(log.events(), "failed")] == [
        ("source_moved", "failed")]
    assert model_server.requests == []
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn)] == [
        (1, "failed", "source_moved")]
    assert conn.execute("SELECT conversation_id FROM compaction.queue").fetchall() == [
        ("conv-1",)]

    monkeypatch.setattr(db, "range_replies", real_read)
    model_server.enqueue(stop("ok"))
    run_once(dsn, model_server.base_url)
    [request] = model_server.requests
    assert b"Edited after the claim." in request.body
    assert summaries(conn) == [("conv-1", 0, "ok")]
    # A new identity (the new hash): its first attempt, not the old identity's second.
    assert sorted((a.attempt, a.state) for a in attempts(conn)) == [
        (1, "completed"), (1, "failed")]


def test_completed_identity_is_skipped_without_a_claim(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(stop("first"))
    run_once(dsn, model_server.base_url, conversation="conv-1")
    assert summaries(conn) == [("conv-1", 0, "first")]
    _STATEMENTS.clear()
    report, log = run_once(dsn, model_server.base_url, conversation="conv-1",
                           connect=lambda: psycopg.connect(
                               dsn, autocommit=True, cursor_factory=RecordingCursor))
    assert [(e["from_pair"], e["reason"]) for e in events_named(log.events(),
                                                                "target_skipped")] == [
        (0, "already_completed")]
    assert report.claimed == 0
    assert report.refused == {}
    assert Counter(_function_of(q) for q, _ in _STATEMENTS if q != db.TIMEOUTS_SQL) == Counter(
        {"start-up check": 1, "compaction.reap": 1, "compaction.claim_next_targets": 1})
    assert len(model_server.requests) == 1


# --- leases, scopes, sweep, admission ----------------------------------------------------


def test_heartbeats_keep_a_slow_call_alive_past_its_first_lease(
        conn: Conn, dsn: str, one_range: str, model_server: ModelServer) -> None:
    model_server.enqueue(hang(stop("Slow but fine.")))
    log = StringLog()
    result: list[WorkerReport] = []
    with OpenAISummarizer(MODEL, base_url=model_server.base_url, api_key="k",
                          timeout_seconds=30) as summarizer:
        worker = make_worker(dsn, summarizer, log, lease=timedelta(seconds=1.5))
        thread = threading.Thread(target=lambda: result.append(worker.run()))
        thread.start()
        try:
            assert model_server.hanging.wait(30)
            first = conn.execute("SELECT lease_expires_at FROM compaction.attempts").fetchone()
            assert first is not None
            # Real time passes the first lease while the call hangs; heartbeats renew it.
            wait_for(lambda: _db_now_after(conn, first[0]), timeout=10, what="first lease")
            wait_for(lambda: db.reap(conn) == 0 and _running_lease_after(conn, first[0]),
                     timeout=10, what="a renewed lease")
        finally:
            model_server.release()
            thread.join(30)
    assert result[0].outcomes == {"completed": 1}
    assert summaries(conn) == [("conv-1", 0, "Slow but fine.")]


def _db_now_after(conn: Conn, moment: Any) -> bool:
    row = conn.execute("SELECT now() > %s", (moment,)).fetchone()
    return bool(row and row[0])


def _running_lease_after(conn: Conn, moment: Any) -> bool:
    row = conn.execute("SELECT bool_and(state = 'running' AND lease_expires_at > now()"
                       " AND lease_expires_at > %s) FROM compaction.attempts",
                       (moment,)).fetchone()
    return bool(row and row[0])


def test_scope_lanes(conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """A worker compacts its --scope; queue entries of other lanes are left for them."""
    seed(conn, "conv-1", 30)  # the trigger queued ('conv-1', 'default')
    model_server.enqueue(stop("support lane"))
    db.enqueue(conn, "conv-1", "support")
    default_lane = conn.execute("SELECT * FROM compaction.queue WHERE scope = 'default'"
                                ).fetchall()
    report, _log = run_once(dsn, model_server.base_url, scope="support")
    assert report.outcomes == {"completed": 1}
    assert [(a.scope, a.state) for a in attempts(conn)] == [("support", "completed")]
    # The default lane's entry was never touched (same enqueued_at, never leased); the
    # support lane's work is done.
    assert conn.execute("SELECT * FROM compaction.queue").fetchall() == default_lane
    assert [(r[0], r[1], r[3]) for r in default_lane] == [("conv-1", "default", None)]


def test_sweep_finds_conversations_nobody_enqueued(conn: Conn, dsn: str) -> None:
    from pycompactor.summarizers.extractive import ExtractiveSummarizer

    for c in range(7):
        seed(conn, f"conv-{c}", 30)
    conn.execute("DELETE FROM compaction.queue")
    log = StringLog()
    report = make_worker(dsn, ExtractiveSummarizer(), log, sweep=True, batch_size=3).run()
    assert report.outcomes == {"completed": 7}
    assert [c for c, _, _ in summaries(conn)] == [f"conv-{c}" for c in range(7)]


def test_global_admission_full_puts_work_back(conn: Conn, dsn: str,
                                              model_server: ModelServer) -> None:
    """max_running = 1 across the database: one claim, the rest refused and re-queued."""
    for c in range(3):
        seed(conn, f"conv-{c}", 30)
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    # The first call holds the only slot until the pass has been refused and has put the
    # other two back (the queue then holds exactly them, under no lease; before the pass
    # it held all 3, and during it the pass leases them).
    model_server.enqueue(hang(stop("first")))

    def release_after_refusal() -> None:
        with psycopg.connect(dsn, autocommit=True) as watcher:
            wait_for(lambda: {r[0] for r in watcher.execute(
                "SELECT conversation_id FROM compaction.queue WHERE lease_token IS NULL")}
                == {"conv-1", "conv-2"},
                what="the refused conversations back on the queue")
        model_server.release()

    releaser = threading.Thread(target=release_after_refusal)
    releaser.start()
    report, log = run_once(dsn, model_server.base_url, concurrency=4)
    releaser.join()
    assert report.claimed == 1
    assert report.refused == {"admission_full": 1}
    assert len(model_server.requests) == 1
    queued = {r[0] for r in conn.execute("SELECT conversation_id FROM compaction.queue"
                                         " WHERE lease_token IS NULL")}
    assert queued == {"conv-1", "conv-2"}  # nothing lost, nothing held; conv-0 is done
    assert [e["reason"] for e in events_named(log.events(), "claim_refused")] == [
        "admission_full"]


def test_process_local_concurrency_bound(conn: Conn, dsn: str) -> None:
    """--concurrency 2: never more than two model calls in flight, over six targets."""
    for c in range(6):
        seed(conn, f"conv-{c}", 30)
    lock = threading.Lock()
    in_flight = [0, 0]  # current, max
    two = threading.Event()
    gate = threading.Event()

    def handler(_request: RecordedRequest) -> ScriptedResponse:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            if in_flight[0] == 2:
                two.set()
        gate.wait(30)
        with lock:
            in_flight[0] -= 1
        return stop("s")

    with ModelServer(handler=handler) as server:
        result: list[WorkerReport] = []
        thread = threading.Thread(target=lambda: result.append(
            run_once(dsn, server.base_url, concurrency=2)[0]))
        thread.start()
        try:
            assert two.wait(30)
            # Both slots are taken: the worker waits; its claims stop at two.
            wait_for(lambda: len(attempts(conn)) == 2, what="two claims")
        finally:
            gate.set()
            thread.join(60)
        assert len(server.requests) == 6
    assert in_flight[1] == 2
    assert result[0].outcomes == {"completed": 6}


def test_targets_are_claimed_in_one_call_for_the_free_model_calls(
        conn: Conn, dsn: str) -> None:
    """With four model calls free, a conversation's eight targets are claimed four in the
    call that looks at it (one judgement of the conversation), then in claim_targets
    batches as calls free up."""
    seed(conn, "conv-8", 100)
    gate = threading.Event()

    def handler(_request: RecordedRequest) -> ScriptedResponse:
        gate.wait(30)
        return stop("s")

    _STATEMENTS.clear()
    with ModelServer(handler=handler) as server:
        result: list[WorkerReport] = []
        thread = threading.Thread(target=lambda: result.append(run_once(
            dsn, server.base_url, concurrency=4, connect=lambda: psycopg.connect(
                dsn, autocommit=True, cursor_factory=RecordingCursor))[0]))
        thread.start()
        try:
            wait_for(lambda: len(attempts(conn)) == 4, what="four claims")
            first = [_named_args(query) for query, _ in list(_STATEMENTS)
                     if "compaction.claim_next_targets" in query
                     or "compaction.claim_targets" in query]
        finally:
            gate.set()
            thread.join(60)
    assert first == [{"conversation_id": "'conv-8'::text", "scope": "'default'::text",
                      "limit": "4::int", "model": ANY, "prompt_version": ANY, "worker": ANY,
                      "lease": ANY, "now": "NULL::timestamptz"}]
    assert [row[0] for row in conn.execute(
        "SELECT j.from_pair FROM compaction.jobs AS j ORDER BY j.job_id LIMIT 4")] == [
        0, 10, 20, 30]
    # The batch's attempts share the claim's one clock reading.
    assert len({row[0] for row in conn.execute(
        "SELECT started_at FROM compaction.attempts WHERE attempt = 1"
        " ORDER BY job_id LIMIT 4")}) == 1
    assert result[0].outcomes == {"completed": 8}
    batches = [_named_args(query)["from_pairs"] for query, _ in _STATEMENTS
               if "compaction.claim_targets" in query]
    assert sorted(int(p) for batch in batches
                  for p in batch.split("'")[1].strip("{}").split(",")) == list(range(40, 80, 10))


def test_database_error_mid_pass_loses_no_queued_conversation(
        conn: Conn, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loop mode: a pass cut short by a database error after dequeuing puts its batch
    back on the next pass (after a backoff), so both conversations still get compacted."""
    from pycompactor.errors import DatabaseUnavailable
    from pycompactor.summarizers.extractive import ExtractiveSummarizer

    seed(conn, "conv-0", 30)
    seed(conn, "conv-1", 30)
    real_look = db.claim_next_targets
    failures = [DatabaseUnavailable("cannot reach the database (test)")]

    def flaky_look(c: db.Connection, *args: Any, **kwargs: Any) -> list[NextTarget]:
        if failures:
            raise failures.pop()
        return real_look(c, *args, **kwargs)

    monkeypatch.setattr(db, "claim_next_targets", flaky_look)
    log = StringLog()
    worker = make_worker(dsn, ExtractiveSummarizer(), log, once=False, concurrency=2,
                         poll_seconds=0.1)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: len(summaries(conn)) == 2, timeout=30, what="both summaries")
    finally:
        worker.request_stop()
        thread.join(30)
    assert [e["event"] for e in log.events() if e["event"] == "db_error"] == ["db_error"]
    assert worker.report().outcomes == {"completed": 2}


def test_a_batch_above_the_dequeue_limit_is_taken_in_the_limit(conn: Conn, dsn: str,
                                                               one_range: str) -> None:
    """dequeue leases at most db.DEQUEUE_LIMIT entries a call (CP020 above it): a worker
    configured for more asks for the limit."""
    from pycompactor.summarizers.extractive import ExtractiveSummarizer

    report = make_worker(dsn, ExtractiveSummarizer(), StringLog(),
                         batch_size=db.DEQUEUE_LIMIT + 1).run()
    assert report.outcomes == {"completed": 1}
    assert len(summaries(conn)) == 1
