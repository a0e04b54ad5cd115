"""`pycompactor worker` as a subprocess against the real cluster and a loopback model server.

Each test drives real processes: the worker runs `python -m pycompactor worker` with the
real `openai` client pointed (OPENAI_BASE_URL) at the scripted server of
tests/modelserver.py, which records every request byte for byte. Synchronisation is on
the worker's JSON log, the server's `hanging` event and the database state, never sleeps.
"""

from __future__ import annotations

import json
import re
import signal
from collections import Counter
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.summarizers.extractive import OFFLINE_MODEL, extractive_summary
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION, load_prompt
from tests.e2e.cli import run_cli
from tests.history import History
from tests.modelserver import ModelServer, RecordedRequest, hang, stop
from tests.modelserver import refusal as refusal_response
from tests.workerkit import (
    MODEL,
    WorkerProcess,
    assistant_text,
    attempts,
    events_named,
    run_worker_cli,
    seed,
    source_digest,
    stop_when,
    summaries,
    user_text,
    wait_for,
    worker_env,
)

Conn = psycopg.Connection[Any]



def test_request_carries_only_the_ten_assistant_replies(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """Acceptance 1: bytes received hold the 10 assistant texts with ids, no user text,
    the pinned prompt, the model named by --model, and no tools."""
    seeded = seed(conn, "conv-1", 30)
    model_server.enqueue(stop("Ten replies compared NAVs of funds F0 to F9."))
    code, events, stderr = run_worker_cli(
        "--once", "--model", MODEL, env=worker_env(dsn, model_server.base_url))
    assert code == 0, stderr

    [request] = model_server.requests
    body = request.body
    for p in seeded[:10]:
        assert p.assistant_content.encode() in body
        assert p.assistant_message_id.encode() in body
    for i, p in enumerate(seeded):
        assert b"USER-SECRET" not in body
        assert p.user_content.encode() not in body
        assert p.user_message_id.encode() not in body
        if i >= 10:  # pairs outside the range are not sent either
            assert p.assistant_content.encode() not in body
    payload = request.json
    assert payload["model"] == MODEL
    assert not {"tools", "functions", "tool_choice"} & set(payload)
    assert payload["messages"][0] == {"role": "system", "content": load_prompt()}
    replies = json.loads(payload["messages"][1]["content"])["assistant_replies"]
    assert [(r["assistant_message_id"], r["content"]) for r in replies] == [
        (p.assistant_message_id, p.assistant_content) for p in seeded[:10]]
    assert request.headers["authorization"] == "Bearer sk-test-key-never-logged"

    assert summaries(conn, "conv-1") == [
        ("conv-1", 0, "Ten replies compared NAVs of funds F0 to F9.")]
    [row] = attempts(conn, "conv-1")
    assert (row.model, row.scope, row.state, row.attempt) == (MODEL, "default", "completed", 1)
    [done] = events_named(events, "completed")
    assert {"job_id", "attempt", "conversation_id", "from_pair", "outcome",
            "latency_ms"} <= set(done)
    assert (done["conversation_id"], done["from_pair"], done["outcome"]) == ("conv-1", 0,
                                                                              "completed")
    assert "sk-test-key-never-logged" not in stderr


def test_no_model_is_a_usage_error(dsn: str) -> None:
    result = run_cli("worker", "--once", env=worker_env(dsn))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("usage: pycompactor worker")
    assert lines[-1].startswith("pycompactor worker: error: no model given")
    # The hint names the default offline model, not an older one.
    assert lines[-1].endswith("(pycompactor/extractive-3 needs no server)")


def test_openai_model_without_key_is_a_usage_error(dsn: str) -> None:
    result = run_cli("worker", "--once", "--model", MODEL, env=worker_env(dsn))
    assert result.returncode == 2
    assert "OPENAI_API_KEY" in result.stderr.strip().splitlines()[-1]


def test_model_from_environment_and_secrets_never_logged(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """PYCOMPACTOR_MODEL selects the model; neither the API key nor the DSN password
    appears in the log (the test cluster trusts local connections, so any password works)."""
    seed(conn, "conv-1", 30)
    model_server.enqueue(refusal_response("no"))
    env = worker_env(dsn + " password=hunter2-db-secret", model_server.base_url,
                     PYCOMPACTOR_MODEL=MODEL)
    code, events, stderr = run_worker_cli("--once", env=env)
    assert code == 0, stderr
    assert model_server.requests[0].json["model"] == MODEL
    [failed] = events_named(events, "failed")
    assert failed["reason"] == "refusal"
    assert "hunter2-db-secret" not in stderr
    assert "sk-test-key-never-logged" not in stderr


def test_text_log_format(conn: Conn, dsn: str) -> None:
    seed(conn, "conv-1", 30)
    result = run_cli("worker", "--once", "--model", OFFLINE_MODEL, env=worker_env(dsn))
    assert result.returncode == 0, result.stderr
    completed = [line for line in result.stderr.splitlines() if " completed " in line]
    assert len(completed) == 1
    assert "conversation_id=conv-1" in completed[0]
    assert "outcome=completed" in completed[0]
    assert re.search(r"latency_ms=\d+", completed[0])


def test_two_failures_then_no_request_at_all(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """Acceptance 3: two failed attempts exhaust the identity; a third pass sends nothing."""
    seed(conn, "conv-1", 30)
    before = source_digest(conn)
    env = worker_env(dsn, model_server.base_url)
    model_server.enqueue(refusal_response("first"), refusal_response("second"))
    for _ in range(2):
        code, _events, stderr = run_worker_cli("--once", "--model", MODEL, env=env)
        assert code == 0, stderr
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn, "conv-1")] == [
        (1, "failed", "refusal"), (2, "failed", "refusal")]
    assert len(model_server.requests) == 2

    # Queue-driven and targeted passes alike: the claim says attempts_exhausted.
    for args in (("--once",), ("--once", "--conversation", "conv-1")):
        code, events, stderr = run_worker_cli(*args, "--model", MODEL, env=env)
        assert code == 0, stderr
        assert not list(events_named(events, "claimed"))
    assert [e["reason"] for e in events_named(events, "claim_refused")] == [
        "attempts_exhausted"]
    assert len(model_server.requests) == 2  # no request at all
    assert summaries(conn, "conv-1") == []
    assert source_digest(conn) == before


def test_extractive_model_needs_no_server_and_is_deterministic(conn: Conn, dsn: str) -> None:
    """Acceptance 7: --model pycompactor/extractive-1 compacts offline (no OPENAI_* at all),
    deterministically, keeping every number and date that fits."""
    seed(conn, "conv-1", 30)
    seed(conn, "conv-2", 40)
    env = worker_env(dsn, OPENAI_BASE_URL="http://127.0.0.1:9/v1")  # would fail if used
    code, events, stderr = run_worker_cli("--once", "--model", OFFLINE_MODEL, env=env)
    assert code == 0, stderr
    got = summaries(conn)
    assert [(c, f) for c, f, _ in got] == [("conv-1", 0), ("conv-2", 0), ("conv-2", 10)]
    for conversation_id, from_pair, text in got:
        pairs = db.eligible_pairs(conn, conversation_id)[from_pair:from_pair + 10]
        # Deterministic: the same function of the same pairs, in this process too.
        assert text == extractive_summary(pairs)
        for p in pairs:
            for figure in re.findall(r"\d[\d.:-]*\d|\d", p.assistant_content):
                assert figure in text, (figure, text)
            assert f"[{p.assistant_message_id}]" in text
            assert "USER-SECRET" not in text
    assert {a.model for a in attempts(conn)} == {OFFLINE_MODEL}
    assert len(list(events_named(events, "completed"))) == 3


def test_extractive_worker_runs_are_identical_across_databases(
        conn: Conn, dsn: str, new_database: Any) -> None:
    """Same history in a second database (same ids) -> byte-identical summaries."""
    from pycompactor import schema

    other = new_database()
    schema.upgrade(other)
    for target_dsn in (dsn, other):
        with psycopg.connect(target_dsn, autocommit=True) as c:
            h = History(c)
            for i in range(30):
                run_id = h.run("conv-x", run_id=f"run-{i}")
                h.message("conv-x", run_id, "user", user_text("conv-x", i), message_id=f"u-{i}")
                h.message("conv-x", run_id, "assistant", assistant_text("conv-x", i),
                          message_id=f"a-{i}")
        code, _events, stderr = run_worker_cli("--once", "--model", OFFLINE_MODEL,
                                               env=worker_env(target_dsn))
        assert code == 0, stderr
    with psycopg.connect(other, autocommit=True) as c:
        assert summaries(c) == summaries(conn)
    assert len(summaries(conn)) == 1


def queue_state(conn: Conn) -> list[tuple[str, bool]]:
    """(conversation, under a live lease?) of every queue entry, by conversation."""
    return [(str(c), bool(leased)) for c, leased in conn.execute(
        "SELECT conversation_id, lease_token IS NOT NULL AND leased_until > now()"
        " FROM compaction.queue ORDER BY conversation_id").fetchall()]


def test_crashed_worker_is_recovered_by_another(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """Acceptance 4: SIGKILL while the worker holds a hanging call (conv-1 claimed, its
    queue entry acknowledged) and a leased queue entry it has examined but not claimed
    (conv-2, waiting for its only slot). Another worker, with no --sweep, completes
    attempt 2 of conv-1 (the reaper re-queues it once the lease expires) and attempt 1
    of conv-2 (its entry reappears when the entry's lease runs out); never two summaries
    or a third attempt."""
    seed(conn, "conv-1", 30)
    seed(conn, "conv-2", 30)
    env = worker_env(dsn, model_server.base_url)
    model_server.enqueue(hang())
    model_server.handler = lambda _request: stop("Recovered summary.")
    # A short lease, so the takeover comes soon; long enough (heartbeat every second)
    # that a loaded test machine does not expire it while the first worker lives.
    first = WorkerProcess("--once", "--concurrency", "1", "--model", MODEL,
                          "--lease-seconds", "3", env=env)
    try:
        # The barrier: the call hangs and the pass is parked on conv-2's lease.
        assert model_server.hanging.wait(30)
        wait_for(lambda: queue_state(conn) == [("conv-2", True)], timeout=30,
                 what="conv-1 acknowledged, conv-2 leased")
        first.proc.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    assert [(a.attempt, a.state) for a in attempts(conn)] == [(1, "running")], first.stderr
    assert queue_state(conn) == [("conv-2", True)]
    [entry_lease] = conn.execute("SELECT leased_until FROM compaction.queue").fetchone() or []

    second = WorkerProcess("--model", MODEL, "--poll-seconds", "0.2", env=env)
    stop_when(second, lambda: len(summaries(conn)) == 2, timeout=30, what="recovery")
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn, "conv-1")] == [
        (1, "failed", "lease_expired"), (2, "completed", "completed")]
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn, "conv-2")] == [
        (1, "completed", "completed")]
    assert summaries(conn) == [("conv-1", 0, "Recovered summary."),
                               ("conv-2", 0, "Recovered summary.")]
    # conv-2 was claimed only after the dead worker's entry lease ran out
    assert _started_at(conn, "conv-2", 1) >= entry_lease
    assert queue_state(conn) == []

    code, events, stderr = run_worker_cli("--once", "--conversation", "conv-1", "--model",
                                          MODEL, env=env)
    assert code == 0, stderr
    # The completed identity is skipped before any claim.
    assert not list(events_named(events, "claim_refused"))
    assert [e["reason"] for e in events_named(events, "target_skipped")] == [
        "already_completed"]
    assert len(model_server.requests) == 3
    assert len(attempts(conn)) == 3


def test_worker_killed_holding_leased_entries_loses_none(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """A worker SIGKILLed with two calls hanging (conv-0, conv-1 claimed) and two queue
    entries leased but unclaimed (conv-2 examined and waiting for a slot, conv-3 not yet
    looked at). Another worker with no --sweep completes all four after the leases: the
    claimed ones by attempt 2 (reap re-queues them), the others by attempt 1 once their
    entry leases run out, in their original queue order."""
    ids = [f"conv-{i}" for i in range(4)]
    for conversation_id in ids:
        seed(conn, conversation_id, 30)
    env = worker_env(dsn, model_server.base_url)
    model_server.enqueue(hang(), hang())
    model_server.handler = lambda _request: stop("After the crash.")
    dead = WorkerProcess("--once", "--concurrency", "2", "--model", MODEL,
                         "--lease-seconds", "2", env=env)
    try:
        wait_for(lambda: len(model_server.requests) == 2, timeout=30, what="two calls")
        wait_for(lambda: queue_state(conn) == [("conv-2", True), ("conv-3", True)],
                 timeout=30, what="conv-0 and conv-1 acknowledged, conv-2 and conv-3 leased")
        dead.proc.send_signal(signal.SIGKILL)
        dead.wait()
    finally:
        if dead.proc.poll() is None:
            dead.proc.kill()
    assert [(a.attempt, a.state) for a in attempts(conn)] == [(1, "running")] * 2
    leases = dict(conn.execute(
        "SELECT conversation_id, leased_until FROM compaction.queue").fetchall())
    assert set(leases) == {"conv-2", "conv-3"}

    survivor = WorkerProcess("--model", MODEL, "--poll-seconds", "0.2", "--concurrency", "1",
                             env=env)
    stop_when(survivor, lambda: len(summaries(conn)) == 4, timeout=60, what="four summaries")
    assert [(c, f) for c, f, _ in summaries(conn)] == [(c, 0) for c in ids]
    for conversation_id in ("conv-0", "conv-1"):
        assert [(a.attempt, a.state, a.reason) for a in attempts(conn, conversation_id)] == [
            (1, "failed", "lease_expired"), (2, "completed", "completed")]
    for conversation_id in ("conv-2", "conv-3"):
        assert [(a.attempt, a.state, a.reason) for a in attempts(conn, conversation_id)] == [
            (1, "completed", "completed")]
        assert _started_at(conn, conversation_id, 1) >= leases[conversation_id]
    # the two held entries came back in their original order
    assert _started_at(conn, "conv-2", 1) <= _started_at(conn, "conv-3", 1)
    assert queue_state(conn) == []
    assert len(model_server.requests) == 6
    assert not list(events_named(survivor.events(), "job_error"))


def _started_at(conn: Conn, conversation_id: str, attempt: int) -> Any:
    row = conn.execute("SELECT started_at FROM compaction.attempts"
                       " WHERE conversation_id = %s AND attempt = %s",
                       (conversation_id, attempt)).fetchone()
    assert row is not None
    return row[0]


@pytest.mark.parametrize(("signum", "release_during_drain"), [
    (signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, False)],
    ids=["sigterm-drain-expires", "sigterm-call-drains", "sigint-drain-expires"])
def test_sigterm_during_a_slow_call(conn: Conn, dsn: str, model_server: ModelServer,
                                    signum: signal.Signals, release_during_drain: bool) -> None:
    """Acceptance 6: SIGTERM while the model hangs: the call drains (completes) or, once
    --drain-seconds ran out, is recorded `interrupted`; exit code 0 either way."""
    seed(conn, "conv-1", 30)
    model_server.enqueue(hang(stop("Drained summary.")))
    drain = "30" if release_during_drain else "0.3"
    proc = WorkerProcess("--model", MODEL, "--drain-seconds", drain, "--poll-seconds", "0.2",
                         env=worker_env(dsn, model_server.base_url))
    try:
        assert model_server.hanging.wait(30)
        proc.wait_event("claimed")
        proc.proc.send_signal(signum)
        proc.wait_event("stopping")
        if release_during_drain:
            model_server.release()
        assert proc.wait() == 0, proc.stderr
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
    [row] = attempts(conn, "conv-1")
    if release_during_drain:
        assert (row.state, row.reason) == ("completed", "completed")
        assert summaries(conn, "conv-1") == [("conv-1", 0, "Drained summary.")]
    else:
        assert (row.state, row.reason) == ("failed", "interrupted")
        assert summaries(conn, "conv-1") == []
        [interrupted] = events_named(proc.events(), "interrupted")
        assert interrupted["reason"] == "interrupted"
    assert list(events_named(proc.events(), "stopped"))


@pytest.mark.slow
def test_four_workers_fifty_conversations(conn: Conn, dsn: str) -> None:
    """Acceptance 5: 4 processes x --concurrency 4 over 50 conversations of 40 pairs:
    exactly 100 summaries and 100 model requests, no range summarized twice."""
    h = History(conn)
    for c in range(50):
        h.pairs(f"conv-{c:02d}", 40)
    with ModelServer(handler=lambda _r: stop("A summary.")) as server:
        env = worker_env(dsn, server.base_url)
        workers = [WorkerProcess("--model", MODEL, "--concurrency", "4", "--poll-seconds",
                                 "0.2", env=env) for _ in range(4)]
        try:
            # All four up (signal handlers installed) before any is told to stop: on a
            # loaded machine the first two can finish every conversation while the others
            # are still starting, and a SIGTERM before start-up ends is fatal.
            for w in workers:
                w.wait_event("started", timeout=60)
            wait_for(lambda: len(summaries(conn)) >= 100, timeout=60, what="100 summaries")
            # Nothing may still be running, and nothing more may be claimed.
            wait_for(lambda: all(a.state != "running" for a in attempts(conn)), timeout=30,
                     what="no running attempt")
            for w in workers:
                w.proc.send_signal(signal.SIGTERM)
            codes = [w.wait() for w in workers]
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.kill()
        assert codes == [0, 0, 0, 0], [w.stderr[-2000:] for w in workers]
        requests = server.requests
        assert server.errors == []

    got = summaries(conn)
    assert len(got) == 100
    assert len({(c, f) for c, f, _ in got}) == 100
    assert sorted({f for _, f, _ in got}) == [0, 10]
    rows = attempts(conn)
    assert len(rows) == 100
    assert {(a.attempt, a.state) for a in rows} == {(1, "completed")}
    assert len(requests) == 100
    first_ids = Counter(_first_reply_id(r) for r in requests)
    assert len(first_ids) == 100  # no range was sent twice
    claimed_by = Counter(e["worker"] for w in workers for e in events_named(w.events(),
                                                                            "started"))
    assert len(claimed_by) == 4


def _first_reply_id(request: RecordedRequest) -> str:
    replies = json.loads(request.json["messages"][1]["content"])["assistant_replies"]
    return str(replies[0]["assistant_message_id"])


def test_worker_reconnects_after_losing_its_connections(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """Loop mode survives the database dropping its connections (bounded backoff)."""
    model_server.enqueue(stop("After reconnect."))
    proc = WorkerProcess("--model", MODEL, "--poll-seconds", "0.2",
                         env=worker_env(dsn, model_server.base_url))
    try:
        proc.wait_event("started")
        dbname = conn.info.dbname
        wait_for(lambda: _terminate_workers(conn, dbname) > 0, timeout=30,
                 what="a worker connection to terminate")
        proc.wait_event("db_error")
        seed(conn, "conv-1", 30)
        wait_for(lambda: bool(summaries(conn, "conv-1")), timeout=30, what="summary")
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait() == 0, proc.stderr
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


def _terminate_workers(conn: Conn, dbname: str) -> int:
    row = conn.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = %s AND application_name = 'pycompactor' AND pid <> pg_backend_pid()",
        (dbname,),
    ).fetchone()
    assert row is not None
    return int(row[0])



def test_a_serialization_failure_costs_one_retry_of_that_call(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """A worker under SERIALIZABLE whose claim waited for the conversation behind another
    session's claim (same range, another model) gets 40001 once that session commits:
    its snapshot missed the admission slot the other claim took. The worker sends that
    claim again, alone (`db_retry`), and the pass goes on: no db_error, the target
    completed, exit 0."""
    seed(conn, "conv-1", 30)
    [target] = db.plan_targets(conn, "conv-1")
    model_server.enqueue(stop("Summary after one retry."))
    serializable = psycopg.conninfo.make_conninfo(
        dsn, options="-c default_transaction_isolation=serializable")
    dbname = conn.info.dbname

    def claim_waits() -> bool:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
            " AND application_name = 'pycompactor' AND wait_event_type = 'Lock'"
            " AND query LIKE %s", (dbname, "%compaction.claim_next_targets(%")).fetchone() == (1,)

    with psycopg.connect(dsn) as holder:  # not autocommit: its claim stays uncommitted
        held = db.claim(holder, "conv-1", "default", 0, target.source_message_ids,
                        target.source_hash, "another-model", PROMPT_VERSION, "holder")
        assert held.claimed
        with WorkerProcess("--once", "--conversation", "conv-1", "--model", MODEL,
                           env=worker_env(serializable, model_server.base_url)) as proc:
            wait_for(claim_waits, timeout=30, what="the worker's claim waiting")
            holder.commit()
            assert proc.wait() == 0, proc.stderr
    events = proc.events()
    [retry] = events_named(events, "db_retry")
    assert (retry["call"], retry["sqlstate"], retry["retry"]) == (
        "claim_next_targets", "40001", 1)
    assert not list(events_named(events, "db_error"))
    [claimed] = events_named(events, "claimed")
    [done] = events_named(events, "completed")
    assert (done["job_id"], done["attempt"]) == (claimed["job_id"], 1)
    assert summaries(conn, "conv-1") == [("conv-1", 0, "Summary after one retry.")]
    assert sorted((a.model, a.attempt, a.state) for a in attempts(conn, "conv-1")) == [
        ("another-model", 1, "running"), (MODEL, 1, "completed")]
