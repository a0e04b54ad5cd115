"""compaction.claim_next_targets: a worker's look at a conversation and its
first claims in one call, under one judgement of the conversation. The look is what
worker_targets answers; the claims are what claim_targets answers for the first p_limit
targets without a summary, from the same state.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.errors import PycompactorError
from pycompactor.models import Target
from tests.history import History
from tests.sql import test_claim_targets
from tests.sql.engine import LEASE, MODEL, T0, V3, at_once, scalar
from tests.sql.test_claim_targets import as_range, claim_targets, engine_rows

Conn = psycopg.Connection[Any]
# The conversation whose targets are in every state a claim answers differently.
history = test_claim_targets.history


def look(conn: Conn, limit: int, *, worker: str = "w2",
         prompt_version: str = V3) -> list[tuple[Any, ...]]:
    return [(n.from_pair, n.to_pair, n.source_message_ids, n.source_hash, n.completed,
             n.claimed, n.reason, n.attempt, n.lease_expires_at)
            for n in db.claim_next_targets(conn, "c", "default", limit, MODEL,
                                           prompt_version, worker, lease=LEASE, now=T0)]


def worker_targets(conn: Conn) -> list[tuple[Any, ...]]:
    return [(t.from_pair, t.to_pair, t.source_message_ids, t.source_hash, t.completed)
            for t in db.worker_targets(conn, "c", "default", MODEL, V3)]


def conversation_locked(conn: Conn) -> bool:
    return bool(scalar(conn, "SELECT count(*) FROM pg_catalog.pg_locks AS l"
                             " WHERE l.pid = pg_catalog.pg_backend_pid()"
                             " AND l.relation = 'compaction.conversation_locks'::regclass"))


@pytest.mark.parametrize(("limit", "max_running"), [(0, 8), (1, 8), (3, 8), (100, 8), (8, 3)])
def test_the_look_is_worker_targets_and_its_claims_are_claim_targets_answers(
        conn: Conn, history: dict[int, Target], limit: int, max_running: int) -> None:
    """Targets 0..70 in every state a claim answers differently (range 0 summarized under
    this identity): the look lists them as worker_targets does; the ranges it tries are
    the targets without a summary, in order, until `limit` are claimed or one is refused
    admission_full, and they are answered, and leave the same rows, as claim_targets
    answers those ranges from the same state; the rest are not tried (claimed NULL)."""
    conn.execute("UPDATE compaction.settings SET max_running = %s", (max_running,))
    with conn.transaction(force_rollback=True):
        got = look(conn, limit)
        after_look = engine_rows(conn)
    assert [g[:5] for g in got] == worker_targets(conn)
    tried = [(g[0], g[5], g[6], g[7], g[8]) for g in got if g[5] is not None]
    open_targets = [f for f in sorted(history) if f != 0]
    assert [t[0] for t in tried] == open_targets[:len(tried)]
    with conn.transaction(force_rollback=True):
        batch = claim_targets(conn, [as_range(history[t[0]]) for t in tried])
        after_batch = engine_rows(conn)
    assert tried == batch
    assert after_look == after_batch
    assert all(g[6:] == (None, None, None) for g in got if g[5] is None)
    reasons = [t[2] for t in tried]
    if max_running == 8:
        # Two refused for themselves (10 runs for w1, 20 is exhausted), then `limit` claims.
        assert reasons == (["already_running", "attempts_exhausted"] + ["claimed"] * 5
                           )[:{0: 0, 1: 3, 3: 5, 100: 7}[limit]]
    else:
        # Range 10 holds a slot; 30 and 40 take the other two (one of them the slot of
        # 70's expired attempt), 50 finds none and ends the claims: 60, 70 not tried.
        assert reasons == ["already_running", "attempts_exhausted", "claimed", "claimed",
                           "admission_full"]
        assert [g[0] for g in got if g[5] is None] == [0, 60, 70]


def test_the_look_alone_takes_no_lock(conn: Conn, history: dict[int, Target]) -> None:
    """With no model call free (p_limit 0), or nothing left to claim, the call reads and
    locks nothing of the conversation's engine rows; with a claim to try, it holds the
    conversation's lock to commit, as a claim does."""
    with conn.transaction(force_rollback=True):
        assert [g[5] for g in look(conn, 0)] == [None] * 8
        assert not conversation_locked(conn)
    with conn.transaction(force_rollback=True):
        assert [g[6] for g in look(conn, 1)][:2] == [None, "already_running"]
        assert conversation_locked(conn)
    History(conn).pairs("done", 30)
    [t] = db.plan_targets(conn, "done")
    c = db.claim(conn, "done", "default", 0, t.source_message_ids, t.source_hash, MODEL,
                 V3, "w1", lease=LEASE, now=T0)
    assert c.job_id is not None
    assert db.complete(conn, c.job_id, 1, "A summary of ten pairs.", "stop", 0, now=T0).ok
    with conn.transaction(force_rollback=True):
        [only] = db.claim_next_targets(conn, "done", "default", 4, MODEL, V3, "w2",
                                       lease=LEASE, now=T0)
        assert (only.completed, only.claimed) == (True, None)
        assert not conversation_locked(conn)


def test_a_closed_prompt_version_refuses_the_claims_it_tries(
        conn: Conn, history: dict[int, Target]) -> None:
    conn.execute("UPDATE compaction.prompt_versions SET accepts_new_jobs = false"
                 " WHERE prompt_version = %s", (V3,))
    """The first range tried is refused prompt_version_closed, as claim would refuse it,
    and ends the claims (every later one would be refused the same)."""
    got = look(conn, 2)
    assert [(g[0], g[5], g[6]) for g in got if g[5] is not None] == [
        (10, False, "prompt_version_closed")]


def test_a_limit_outside_0_to_100_or_a_missing_identity_is_refused(
        conn: Conn, history: dict[int, Target]) -> None:
    for limit in (-1, 101):
        with pytest.raises(PycompactorError, match="0 to 100 ranges a call"):
            look(conn, limit)
    with psycopg.connect(conn.info.dsn, autocommit=True) as other, \
            pytest.raises(psycopg.Error, match="0 to 100 ranges a call, got NULL"):
        other.execute("SELECT * FROM compaction.claim_next_targets('c', 'default', NULL,"
                      " %s, %s, 'w')", (MODEL, V3))
    with pytest.raises(PycompactorError, match="non-empty scope, model and worker"):
        db.claim_next_targets(conn, "c", "", 1, MODEL, V3, "w")
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts WHERE state = 'running'") == 2


def test_the_look_and_its_claims_judge_the_conversation_once(conn: Conn) -> None:
    """Judged from the views (an untracked source; always so on Citus): worker_targets and
    then claim_targets judge the conversation twice, the one call once."""
    conn.execute("ALTER TABLE compaction_source.messages DISABLE TRIGGER messages_track_update")
    History(conn).pairs("c", 70)
    assert scalar(conn, "SELECT compaction.derived_state_status()") == "untracked"

    def judged(call: Any) -> dict[str, int]:
        with psycopg.connect(conn.info.dsn, autocommit=True) as own, \
                own.transaction(force_rollback=True):
            own.execute("SET LOCAL track_functions = 'all'")
            call(own)
            assert scalar(own, "SELECT count(*) FROM compaction.attempts") == 4
            return dict(own.execute(
                "SELECT funcname, calls::int FROM pg_stat_xact_user_functions"
                " WHERE schemaname = 'compaction'").fetchall())

    def two_calls(own: Conn) -> None:
        targets = db.worker_targets(own, "c", "default", MODEL, V3)
        ranges = [(t.from_pair, t.source_message_ids, t.source_hash) for t in targets[:4]]
        assert [r.reason for r in db.claim_targets(own, "c", "default", ranges, MODEL, V3,
                                                   "w", lease=LEASE, now=T0)] == [
            "claimed"] * 4

    def one_call(own: Conn) -> None:
        got = db.claim_next_targets(own, "c", "default", 4, MODEL, V3, "w", lease=LEASE,
                                    now=T0)
        assert [n.reason for n in got] == ["claimed"] * 4 + [None]

    assert judged(two_calls)["judge_runs"] == 2
    assert judged(one_call)["judge_runs"] == 1
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts") == 0


def test_concurrent_looks_claim_each_range_once_within_admission(conn: Conn) -> None:
    """Eight workers look at the same conversation of eight targets at once, each with
    three model calls free and room for five running attempts in all: exactly five
    ranges are claimed, each once, and every answer is a claim's."""
    History(conn).pairs("c", 100)
    conn.execute("UPDATE compaction.settings SET max_running = 5")
    answers = at_once(conn.info.dsn, 8, lambda own, k: look(own, 3, worker=f"w{k}"))
    assert all([g[0] for g in got] == list(range(0, 80, 10)) for got in answers)
    claimed = Counter(g[0] for got in answers for g in got if g[5])
    assert sum(claimed.values()) == 5
    assert set(claimed.values()) == {1}
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts"
                        " WHERE state = 'running'") == 5
    refusals = Counter(g[6] for got in answers for g in got if g[5] is False)
    assert set(refusals) <= {"already_running", "admission_full"}
