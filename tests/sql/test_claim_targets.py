"""compaction.claim_targets: a worker's claims of one conversation in one
call, under one lock and one judgement of the conversation, each range answered exactly
as compaction.claim would answer it had the ranges been claimed one after another.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.errors import PycompactorError
from pycompactor.models import Target
from tests.history import History
from tests.sql.engine import (
    GOOD,
    LEASE,
    MODEL,
    T0,
    V3,
    at_once,
    claim,
    scalar,
    wait_until_blocked,
)

Conn = psycopg.Connection[Any]
Range = tuple[int, list[str], str]


def as_range(t: Target) -> Range:
    return (t.from_pair, t.source_message_ids, t.source_hash)


def claim_targets(conn: Conn, ranges: list[Range], *, worker: str = "w2",
                  conversation_id: str = "c", prompt_version: str = V3) -> list[tuple[Any, ...]]:
    return [(r.from_pair, r.claimed, r.reason, r.attempt, r.lease_expires_at)
            for r in db.claim_targets(conn, conversation_id, "default", ranges, MODEL,
                                      prompt_version, worker, lease=LEASE, now=T0)]


def claims_one_by_one(conn: Conn, ranges: list[Range], *,
                      worker: str = "w2") -> list[tuple[Any, ...]]:
    answers = []
    for from_pair, ids, source_hash in ranges:
        r = db.claim(conn, "c", "default", from_pair, ids, source_hash, MODEL, V3, worker,
                     lease=LEASE, now=T0)
        answers.append((from_pair, r.claimed, r.reason, r.attempt, r.lease_expires_at))
        if r.reason == "admission_full":
            break  # what claim_targets answers: the first admission_full ends the batch
    return answers


def engine_rows(conn: Conn) -> list[tuple[Any, ...]]:
    """Every attempt and admission slot, without the ids a sequence hands out."""
    attempts = conn.execute(
        "SELECT j.from_pair, a.attempt, a.state, a.reason, a.worker, a.started_at,"
        " a.lease_expires_at, a.slot IS NOT NULL"
        " FROM compaction.attempts AS a JOIN compaction.jobs AS j USING (conversation_id, job_id)"
        " ORDER BY 1, 2").fetchall()
    slots = conn.execute(
        "SELECT count(*) FILTER (WHERE lease_expires_at > %s) FROM compaction.admission",
        (T0,)).fetchall()
    return [*attempts, *slots]


@pytest.fixture
def history(conn: Conn) -> dict[int, Target]:
    """A conversation of 100 pairs (targets 0..70) whose identities are in every state a
    claim answers differently."""
    History(conn).pairs("c", 100)
    targets = {t.from_pair: t for t in db.plan_targets(conn, "c")}
    assert sorted(targets) == list(range(0, 80, 10))
    done = claim(conn, "c", targets[0])                           # already_completed
    assert done.job_id is not None
    assert db.complete(conn, done.job_id, 1, GOOD, "stop", 0, now=T0).ok
    assert claim(conn, "c", targets[10], worker="w1").claimed      # already_running
    for _ in range(2):                                               # attempts_exhausted
        c = claim(conn, "c", targets[20])
        assert c.job_id is not None
        assert c.attempt is not None
        assert db.fail(conn, c.job_id, c.attempt, "model_error", now=T0).ok
    once = claim(conn, "c", targets[30])                             # claimed, attempt 2
    assert once.job_id is not None
    assert db.fail(conn, once.job_id, 1, "model_error", now=T0).ok
    # Claimed ten minutes ago with a five-minute lease: reaped, then claimed as attempt 2.
    assert claim(conn, "c", targets[70], now=T0 - timedelta(minutes=10)).claimed
    return targets


def every_answer(targets: dict[int, Target]) -> list[Range]:
    t = targets
    other_ids = list(t[70].source_message_ids)  # 20 valid ids, of another range
    return [
        as_range(t[0]),                                           # already_completed
        (5, list(t[40].source_message_ids), t[40].source_hash),   # invalid_range
        as_range(t[10]),                                          # already_running
        (60, list(t[60].source_message_ids)[:19], t[60].source_hash),  # invalid_source_ids
        as_range(t[20]),                                          # attempts_exhausted
        (40, list(t[40].source_message_ids), t[50].source_hash),  # source_mismatch
        as_range(t[30]),                                          # claimed, attempt 2
        (80, other_ids, t[70].source_hash),                        # not_eligible
        as_range(t[50]),                                          # claimed
        as_range(t[50]),                                          # already_running (ours)
        as_range(t[70]),                                          # expired: attempt 2
        (90, other_ids, "0" * 64),                               # not_eligible
        as_range(t[60]),                                          # claimed
    ]


@pytest.mark.parametrize("max_running", [8, 3])
def test_each_range_is_answered_as_claims_one_by_one_answer_it(
        conn: Conn, history: dict[int, Target], max_running: int) -> None:
    """Every refusal reason and both kinds of success, in one batch, against the same
    ranges claimed one by one from the same state; with room for four running attempts
    (one is running already, one is reaped on the way), the batch ends at the first
    admission_full."""
    conn.execute("UPDATE compaction.settings SET max_running = %s", (max_running,))
    ranges = every_answer(history)
    with conn.transaction(force_rollback=True):
        batch = claim_targets(conn, ranges)
        after_batch = engine_rows(conn)
    with conn.transaction(force_rollback=True):
        one_by_one = claims_one_by_one(conn, ranges)
        after_one_by_one = engine_rows(conn)
    assert batch == one_by_one
    assert after_batch == after_one_by_one
    reasons = [r[2] for r in batch]
    if max_running == 8:
        assert reasons == [
            "already_completed", "invalid_range", "already_running", "invalid_source_ids",
            "attempts_exhausted", "source_mismatch", "claimed", "not_eligible", "claimed",
            "already_running", "claimed", "not_eligible", "claimed"]
        assert [r[3] for r in batch if r[1]] == [2, 1, 2, 1]
    else:
        # Range 10 holds a slot; 30 and 50 take the other two (one of them the slot of
        # 70's expired attempt), and 70's own claim finds none.
        assert reasons == [
            "already_completed", "invalid_range", "already_running", "invalid_source_ids",
            "attempts_exhausted", "source_mismatch", "claimed", "not_eligible", "claimed",
            "already_running", "admission_full"]


def test_a_closed_prompt_version_refuses_every_range_without_the_lock(
        conn: Conn, history: dict[int, Target]) -> None:
    conn.execute("UPDATE compaction.prompt_versions SET accepts_new_jobs = false"
                 " WHERE prompt_version = %s", (V3,))
    ranges = [as_range(history[50]), (5, list(history[50].source_message_ids), "x")]
    with conn.transaction():
        got = claim_targets(conn, ranges)
        locked = scalar(conn, "SELECT count(*) FROM pg_catalog.pg_locks AS l"
                              " WHERE l.pid = pg_catalog.pg_backend_pid()"
                              " AND l.relation = 'compaction.conversation_locks'::regclass")
    assert [r[2] for r in got] == ["prompt_version_closed", "invalid_range"]
    assert locked == 0


def test_a_batch_judges_the_conversation_once(conn: Conn) -> None:
    """Judged from the views (an untracked source; always so on Citus), four claims judge
    the conversation four times, a batch of the same four once."""
    conn.execute("ALTER TABLE compaction_source.messages DISABLE TRIGGER messages_track_update")
    History(conn).pairs("c", 70)
    assert scalar(conn, "SELECT compaction.derived_state_status()") == "untracked"
    ranges = [as_range(t) for t in db.plan_targets(conn, "c")]
    assert len(ranges) == 5

    def judged(call: Any) -> dict[str, int]:
        # A session of its own: the view also counts a session's calls not yet flushed.
        with psycopg.connect(conn.info.dsn, autocommit=True) as own, \
                own.transaction(force_rollback=True):
            own.execute("SET LOCAL track_functions = 'all'")
            answers = call(own, ranges[:4])
            assert [a[2] for a in answers] == ["claimed"] * 4
            return dict(own.execute(
                "SELECT funcname, calls::int FROM pg_stat_xact_user_functions"
                " WHERE schemaname = 'compaction'").fetchall())

    one_by_one = judged(claims_one_by_one)
    batch = judged(claim_targets)
    assert one_by_one["judge_runs"] == 4
    assert batch["judge_runs"] == 1
    assert "current_range" not in batch
    # Only the four ranges asked for are hashed, not the fifth target.
    assert batch["range_hashes"] == 1
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts") == 0


def test_a_batch_needs_one_row_of_ids_and_one_hash_per_range(
        conn: Conn, history: dict[int, Target]) -> None:
    t = history[50]
    with psycopg.connect(conn.info.dsn, autocommit=True) as other, \
            pytest.raises(psycopg.Error, match="one row of source ids and one hash"):
        other.execute(
            "SELECT * FROM compaction.claim_targets('c', 'default', ARRAY[50, 60],"
            " %s::text[], ARRAY[%s], %s, %s, 'w')",
            ([list(t.source_message_ids), list(t.source_message_ids)], t.source_hash,
             MODEL, V3))
    assert claim_targets(conn, []) == []
    with pytest.raises(PycompactorError, match="at most 100 ranges"):
        claim_targets(conn, [as_range(t)] * 101)
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts WHERE state = 'running'") == 2


def test_concurrent_batches_claim_each_range_once_within_admission(conn: Conn) -> None:
    """Eight connections send the same batch of a conversation's eight targets at once,
    with room for five running attempts: exactly five ranges are claimed, each once."""
    History(conn).pairs("c", 100)
    conn.execute("UPDATE compaction.settings SET max_running = 5")
    ranges = [as_range(t) for t in db.plan_targets(conn, "c")]
    assert len(ranges) == 8
    answers = at_once(conn.info.dsn, 8, lambda own, k: claim_targets(own, ranges,
                                                                    worker=f"w{k}"))
    claimed = Counter(a[0] for batch in answers for a in batch if a[1])
    assert sum(claimed.values()) == 5
    assert set(claimed.values()) == {1}
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts"
                        " WHERE state = 'running'") == 5
    refusals = Counter(a[2] for batch in answers for a in batch if not a[1])
    assert set(refusals) <= {"already_running", "admission_full"}


@pytest.mark.parametrize("call", ["claim", "claim_targets", "claim_next_targets"])
def test_a_claim_judges_the_range_before_it_waits_for_the_conversation(
        conn: Conn, dsn: str, call: str) -> None:
    """The conversation's lock orders its engine writers, none of which
    changes its history, so a claim judges the range first and then waits for the lock
    (judged from the views, the judgement is most of a claim's time, and the
    conversation's other writers would wait for it). A text edited while the claim waits is
    not seen by it: it binds the range it judged, and the worker's read of the replies
    then finds the hash moved (tests/sql/test_worker_reads.py)."""
    History(conn).pairs("c", 30)
    [t] = db.plan_targets(conn, "c")
    answers: list[tuple[bool | None, str | None]] = []
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as claimer:
        holder.execute("SELECT compaction.lock_conversation('c')")

        def send() -> None:
            if call == "claim":
                r = claim(claimer, "c", t)
                answers.append((r.claimed, r.reason))
            elif call == "claim_targets":
                [b] = db.claim_targets(claimer, "c", "default", [as_range(t)], MODEL, V3,
                                       "w1", lease=LEASE, now=T0)
                answers.append((b.claimed, b.reason))
            else:
                answers.extend((n.claimed, n.reason) for n in db.claim_next_targets(
                    claimer, "c", "default", 1, MODEL, V3, "w1", lease=LEASE, now=T0))

        thread = threading.Thread(target=send)
        thread.start()
        wait_until_blocked(conn, claimer.info.backend_pid)
        conn.execute("UPDATE compaction_source.messages SET content = content || '!'"
                     " WHERE message_id = %s", (t.source_message_ids[1],))
        holder.commit()
        thread.join(30)
    assert answers == [(True, "claimed")]
    assert db.plan_targets(conn, "c")[0].source_hash != t.source_hash


@pytest.mark.parametrize("call", ["claim", "claim_targets", "claim_next_targets"])
def test_a_claim_waiting_behind_an_erasure_judges_again(
        conn: Conn, dsn: str, call: str) -> None:
    """The one writer under the conversation's lock that follows a change of history is an
    erasure: a claim that judged the range before an erasure (and the history's deletion)
    took the lock judges it again once it holds the lock, and lands nothing."""
    History(conn).pairs("c", 30)
    [t] = db.plan_targets(conn, "c")
    answers: list[tuple[bool | None, str | None]] = []
    with psycopg.connect(dsn) as eraser, psycopg.connect(dsn, autocommit=True) as claimer:
        eraser.execute("SELECT compaction.erase_conversation('c', 'erasure_request')")
        eraser.execute("DELETE FROM compaction_source.messages WHERE conversation_id = 'c'")
        eraser.execute("DELETE FROM compaction_source.runs WHERE conversation_id = 'c'")

        def send() -> None:
            if call == "claim":
                r = claim(claimer, "c", t)
                answers.append((r.claimed, r.reason))
            elif call == "claim_targets":
                [b] = db.claim_targets(claimer, "c", "default", [as_range(t)], MODEL, V3,
                                       "w1", lease=LEASE, now=T0)
                answers.append((b.claimed, b.reason))
            else:
                answers.extend((n.claimed, n.reason) for n in db.claim_next_targets(
                    claimer, "c", "default", 1, MODEL, V3, "w1", lease=LEASE, now=T0))

        thread = threading.Thread(target=send)
        thread.start()
        wait_until_blocked(conn, claimer.info.backend_pid)
        eraser.commit()
        thread.join(30)
    # claim_next_targets judges which ranges are targets: after the erasure, none.
    assert answers == ([] if call == "claim_next_targets" else [(False, "not_eligible")])
    assert scalar(conn, "SELECT count(*) FROM compaction.jobs") == 0
