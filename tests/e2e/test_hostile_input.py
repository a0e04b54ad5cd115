"""Hostile input: ids and scopes made to break quoting, replies made to break the
recorder, messages of 5 MB. Each ends in a clear, recorded outcome, and nothing in the
database is lost or half-written (attempts, summaries, audit events, source rows).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pycompactor import db, source_hash
from pycompactor.projection import message_cost, project_history
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from tests.e2e.cli import run_cli
from tests.history import History
from tests.modelserver import (
    ModelServer,
    RecordedRequest,
    ScriptedResponse,
    choice,
    completion_body,
    json_response,
    malformed_json,
    no_choices,
    stop,
)
from tests.workerkit import (
    MODEL,
    attempts,
    events_named,
    run_worker_cli,
    source_digest,
    summaries,
    worker_env,
)

Conn = psycopg.Connection[Any]


def _kilobyte(seed: str) -> str:
    """1,024 UTF-8 bytes (the longest conversation id and scope the engine takes) of
    quotes, %, ;, backslashes and multi-byte characters."""
    piece = f"{seed}'\"%s%(x)s;\\ü会🚀"
    text = ""
    i = 0
    while len(text.encode()) < 1024:
        text += f"{piece}{i}"
        i += 1
    return text.encode()[:1024].decode("utf-8", "ignore")


#: (conversation id, scope) pairs that would break any SQL or format-string splicing.
HOSTILE = [
    ("it's \"quoted\"; DROP TABLE compaction.jobs; -- 100% %s %(conversation_id)s {0} :name",
     "aud'ience; %s DELETE"),
    ("会话-🚀-e\u0301-\u200b-عربى-\\N-\t-tab", "スコープ 🚀 ;'%"),
    (_kilobyte("conv"), _kilobyte("scope")),
]


def test_hostile_ids_and_scopes_through_cli_and_api(conn: Conn, dsn: str) -> None:
    h = History(conn)
    for conversation_id, _scope in HOSTILE:
        h.pairs(conversation_id, 30)
    h.pairs("bystander", 30)
    before = source_digest(conn)
    env = worker_env(dsn)

    for conversation_id, scope in HOSTILE:
        pairs = db.eligible_pairs(conn, conversation_id)
        assert len(pairs) == 30
        [target] = db.plan_targets(conn, conversation_id)
        assert target.source_hash == source_hash(pairs[:10])

        result = run_cli("plan", conversation_id, "--json", env=env)
        assert result.returncode == 0, result.stderr
        [planned] = json.loads(result.stdout)
        assert (planned["from_pair"], planned["source_hash"]) == (0, target.source_hash)
        result = run_cli("plan", conversation_id, env=env)
        assert result.returncode == 0, result.stderr
        assert f"conversation {conversation_id}: 30 eligible pairs, 1 targets" in result.stdout

        result = run_cli("worker", "--once", "--conversation", conversation_id, "--scope",
                         scope, "--model", OFFLINE_MODEL, "--log-format", "json", env=env)
        assert result.returncode == 0, result.stderr
        [done] = [e for e in map(json.loads, result.stderr.splitlines())
                  if e["event"] == "completed"]
        assert done["conversation_id"] == conversation_id

        result = run_cli("project", conversation_id, "--scope", scope, "--budget-bytes",
                         "100000", "--json", env=env)
        assert result.returncode == 0, result.stderr
        projected = json.loads(result.stdout)
        direct = project_history(conn, conversation_id, budget_bytes=100000, scope=scope)
        assert projected == json.loads(json.dumps(direct.to_dict()))
        assert Counter(p["placement"] for p in projected["pairs"]) == Counter(
            {"summarized": 10, "raw": 20})
        # The default scope has no summary: the scope is a lane, not a pattern.
        default = project_history(conn, conversation_id, budget_bytes=100000)
        assert {p.placement for p in default.pairs} == {"raw"}

        for view in ("jobs", "events"):
            result = run_cli("audit", "--view", view, "--conversation", conversation_id,
                             "--json", env=env)
            assert result.returncode == 0, result.stderr
            rows = json.loads(result.stdout)
            assert rows
            assert {r["conversation_id"] for r in rows} == {conversation_id}
            assert {r["scope"] for r in rows} == {scope}

        result = run_cli("check-source", "--conversation", conversation_id, "--json", env=env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["samples"] == [
            {"conversation_id": conversation_id, "runs": 30, "pairs": 30, "excluded": {}}]

        # The Python API: enqueue/dequeue/ack round-trip the exact strings.
        conn.execute("DELETE FROM compaction.queue")
        db.enqueue(conn, conversation_id, scope)
        [queued] = db.dequeue(conn, 10, scope=scope)
        assert (queued.conversation_id, queued.scope) == (conversation_id, scope)
        assert db.ack(conn, queued).reason == "acknowledged"
        assert conn.execute("SELECT count(*) FROM compaction.queue").fetchone() == (0,)

    got = conn.execute("SELECT conversation_id, scope, from_pair FROM compaction.summaries"
                       " ORDER BY summary_id").fetchall()
    assert got == [(c, s, 0) for c, s in HOSTILE]
    assert db.plan_targets(conn, "bystander")  # untouched, still a target
    assert attempts(conn, "bystander") == []
    assert source_digest(conn) == before


# --- replies that must be recorded failures, not crashes --------------------------------


def _content(text: str) -> ScriptedResponse:
    # json.dumps escapes NUL and lone surrogates (\u0000, \ud800): valid JSON on the wire.
    return json_response(completion_body([choice(text)]))


#: conversation -> (what the model answers, the attempt's recorded reason)
REPLIES: dict[str, tuple[ScriptedResponse, str]] = {
    "c-nul": (_content("A summary with a NUL \x00 inside."), "invalid_text"),
    "c-surrogate": (_content("A lone surrogate \ud800 here."), "invalid_text"),
    "c-low-surrogate": (_content("And a low one \udfff alone."), "invalid_text"),
    "c-6001": (stop("x" * 6001), "too_long"),
    "c-malformed": (malformed_json(), "malformed_response"),
    "c-no-choices": (no_choices(), "malformed_response"),
    "c-6000": (stop("y" * 6000), "completed"),
}


@pytest.fixture
def routed_server() -> Iterator[ModelServer]:
    """Answers each conversation's request with its scripted reply (found in the body)."""

    def route(request: RecordedRequest) -> ScriptedResponse:
        replies = json.loads(request.json["messages"][1]["content"])["assistant_replies"]
        first_id = replies[0]["assistant_message_id"]
        return REPLIES[first_id.split(":")[0]][0]

    with ModelServer(handler=route) as server:
        yield server
    assert server.errors == [], server.errors


def test_hostile_model_replies_are_recorded_failures(conn: Conn, dsn: str,
                                                     routed_server: ModelServer) -> None:
    h = History(conn)
    for conversation_id in REPLIES:
        h.pairs(conversation_id, 30)
    before = source_digest(conn)
    code, events, stderr = run_worker_cli(
        "--once", "--concurrency", "4", "--model", MODEL,
        env=worker_env(dsn, routed_server.base_url))
    assert code == 0, stderr
    assert not list(events_named(events, "job_error")), stderr
    assert len(routed_server.requests) == len(REPLIES)  # one call each, no retry

    rows = {c: attempts(conn, c) for c in REPLIES}
    for conversation_id, (_reply, reason) in REPLIES.items():
        [row] = rows[conversation_id]
        expected_state = "completed" if reason == "completed" else "failed"
        assert (row.attempt, row.state, row.reason) == (1, expected_state, reason), \
            conversation_id
    logged = {e["conversation_id"]: e["reason"] for e in events
              if e["event"] in {"completed", "failed"}}
    assert logged == {c: reason for c, (_r, reason) in REPLIES.items()}
    assert [(c, f) for c, f, _ in summaries(conn)] == [("c-6000", 0)]
    assert summaries(conn)[0][2] == "y" * 6000
    kinds = Counter(conn.execute(
        "SELECT conversation_id, kind FROM compaction.audit_events").fetchall())
    for conversation_id, (_reply, reason) in REPLIES.items():
        end = "completion" if reason == "completed" else "failure"
        assert kinds[(conversation_id, "claim")] == 1
        assert kinds[(conversation_id, end)] == 1
    assert sum(kinds.values()) == 2 * len(REPLIES)
    # The too-long reply was judged by the database, which kept its length, not its text.
    assert conn.execute(
        "SELECT a.summary_chars FROM compaction.attempts a WHERE a.conversation_id = 'c-6001'"
    ).fetchone() == (6001,)
    assert source_digest(conn) == before


# --- 5 MB messages ------------------------------------------------------------------------

FIVE_MB = 5 * 1024 * 1024

# Runs in a fresh interpreter: peak Python allocations of each step, in bytes.
_MEASURE = textwrap.dedent("""
    import json, sys, tracemalloc
    import psycopg
    from pycompactor import db, source_hash
    from pycompactor.projection import project_history

    dsn, conversation_id = sys.argv[1], sys.argv[2]
    conn = psycopg.connect(dsn, autocommit=True)
    peaks = {}

    def measure(name, step):
        tracemalloc.start()
        result = step()
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return result

    measure("plan", lambda: db.plan_targets(conn, conversation_id))
    measure("project_64k", lambda: project_history(conn, conversation_id, budget_bytes=65536))
    measure("project_12m", lambda: project_history(conn, conversation_id,
                                                   budget_bytes=12 * 1024 * 1024))
    pairs = db.eligible_pairs(conn, conversation_id)
    measure("hash", lambda: source_hash(pairs[:10]))
    print(json.dumps(peaks))
""")


def test_five_megabyte_messages(conn: Conn, dsn: str) -> None:
    """Two 5 MB messages in the first range: Python and SQL hashes agree, the plan
    carries no text, the worker summarizes it within 6,000 characters, and projection
    reads text only in proportion to its budget."""
    h = History(conn)
    big_reply = ("Figures: NAV 12.5 on 2026-01-02. " + "é" * (FIVE_MB // 2))[:FIVE_MB // 2]
    big_question = "Q" * FIVE_MB
    for i in range(30):
        h.pair("big", user=big_question if i == 4 else f"question {i}",
               assistant=big_reply if i == 2 else f"answer {i}")
    before = source_digest(conn)
    pairs = db.eligible_pairs(conn, "big")
    assert pairs[2].assistant_content == big_reply
    assert len(pairs[4].user_content.encode()) == FIVE_MB
    assert len(big_reply.encode()) > 4 * 1024 * 1024
    [target] = db.plan_targets(conn, "big")
    assert target.source_hash == source_hash(pairs[:10]) == db.source_hash(conn, "big", 0)

    result = run_cli("plan", "big", "--json", env=worker_env(dsn))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["source_hash"] == target.source_hash

    code, _events, stderr = run_worker_cli("--once", "--model", OFFLINE_MODEL,
                                           env=worker_env(dsn))
    assert code == 0, stderr
    [(_c, _f, text)] = summaries(conn, "big")
    assert 0 < len(text) <= 6000
    assert "12.5" in text

    # A small budget never reads the big texts; a big one includes them verbatim.
    small = project_history(conn, "big", budget_bytes=65536)
    assert small.used_bytes <= 65536
    assert all(len(m["content"]) < 10_000 for m in small.messages)
    large = project_history(conn, "big", budget_bytes=12 * 1024 * 1024)
    assert large.used_bytes == sum(message_cost(m["content"]) for m in large.messages)
    assert large.used_bytes <= 12 * 1024 * 1024
    assert big_question in [m["content"] for m in large.messages]  # verbatim, in its block

    measured = subprocess.run([sys.executable, "-c", _MEASURE, dsn, "big"],
                              capture_output=True, text=True, check=False, timeout=120)
    assert measured.returncode == 0, measured.stderr
    peaks = json.loads(measured.stdout)
    mb = 1024 * 1024
    assert peaks["plan"] < 1 * mb, peaks             # ids and a hash, no text
    assert peaks["project_64k"] < 1 * mb, peaks      # text in proportion to the budget
    assert peaks["project_12m"] < 2 * 12 * mb, peaks  # about what it returns (~10 MB)
    assert peaks["hash"] < 3 * 2 * FIVE_MB, peaks    # the range's bytes, joined once
    assert source_digest(conn) == before
