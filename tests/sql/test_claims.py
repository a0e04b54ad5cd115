"""§6 claims: every refusal reason from exactly its situation, retries, fencing, completion."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.models import AckResult
from pycompactor.summarizers.extractive import MAX_SUMMARY_CHARS
from tests.history import History
from tests.sql.engine import GOOD, LEASE, MODEL, T0, V3, claim, scalar, target

Conn = psycopg.Connection[Any]


def test_claim_then_complete(conn: Conn) -> None:
    t = target(conn, "c1")
    result = claim(conn, "c1", t)
    assert (result.claimed, result.reason, result.attempt) == (True, "claimed", 1)
    assert result.lease_expires_at == T0 + LEASE
    assert result.job_id is not None
    done = db.complete(conn, result.job_id, 1, GOOD, "stop", 0, response_id="resp-1", now=T0)
    assert (done.ok, done.reason) == (True, "completed")
    assert done.summary_id is not None
    row = conn.execute(
        "SELECT summary, job_id, imported, source_hash, to_pair FROM compaction.summaries"
    ).fetchone()
    assert row == (GOOD, result.job_id, False, t.source_hash, 9)


# --- every refusal reason of §6, each from exactly its situation -------------------------

def test_invalid_range(conn: Conn) -> None:
    t = target(conn, "c1")
    for bad in (-10, 5, 11):
        bad_t = dataclasses.replace(t, from_pair=bad)
        assert claim(conn, "c1", bad_t).reason == "invalid_range"


@pytest.mark.parametrize("mutate", [
    lambda ids: ids[:19],                     # 19 ids
    lambda ids: [*ids, "extra"],              # 21 ids
    lambda ids: [ids[0], *ids[:19]],          # a duplicate
    lambda ids: [None, *ids[1:]],             # a null
])
def test_invalid_source_ids(conn: Conn, mutate: Any) -> None:
    t = target(conn, "c1")
    bad = dataclasses.replace(t, source_message_ids=mutate(list(t.source_message_ids)))
    result = claim(conn, "c1", bad)
    assert (result.claimed, result.reason) == (False, "invalid_source_ids")


@pytest.mark.parametrize("version", [
    "conversation-compaction@1", "conversation-compaction@2", "conversation-compaction@9",
])
def test_prompt_version_closed(conn: Conn, version: str) -> None:
    t = target(conn, "c1")
    assert claim(conn, "c1", t, prompt_version=version).reason == "prompt_version_closed"


def test_not_eligible(conn: Conn) -> None:
    t = target(conn, "c1", n_pairs=30)
    # range 10-19 exists only from 40 pairs on
    later = dataclasses.replace(t, from_pair=10)
    assert claim(conn, "c1", later).reason == "not_eligible"
    assert claim(conn, "unknown-conversation", t).reason == "not_eligible"


def test_source_mismatch(conn: Conn) -> None:
    t = target(conn, "c1")
    other_hash = dataclasses.replace(t, source_hash="0" * 64)
    upper_hash = dataclasses.replace(t, source_hash=t.source_hash.upper())
    short_hash = dataclasses.replace(t, source_hash=t.source_hash[:63])
    swapped = list(t.source_message_ids)
    swapped[0], swapped[2] = swapped[2], swapped[0]
    other_ids = dataclasses.replace(t, source_message_ids=swapped)
    for bad in (other_hash, upper_hash, short_hash, other_ids):
        assert claim(conn, "c1", bad).reason == "source_mismatch"
    assert scalar(conn, "SELECT count(*) FROM compaction.jobs") == 0


def test_already_completed(conn: Conn) -> None:
    t = target(conn, "c1")
    first = claim(conn, "c1", t)
    assert first.job_id is not None
    assert db.complete(conn, first.job_id, 1, GOOD, "stop", 0, now=T0).ok
    again = claim(conn, "c1", t, now=T0 + LEASE * 10)
    assert (again.claimed, again.reason, again.job_id) == (False, "already_completed", first.job_id)


def test_already_running(conn: Conn) -> None:
    t = target(conn, "c1")
    assert claim(conn, "c1", t).claimed
    result = claim(conn, "c1", t, worker="w2")
    assert (result.claimed, result.reason, result.attempt) == (False, "already_running", None)


def test_attempts_exhausted(conn: Conn) -> None:
    t = target(conn, "c1")
    for attempt in (1, 2):
        c = claim(conn, "c1", t)
        assert (c.claimed, c.attempt) == (True, attempt)
        assert c.job_id is not None
        assert db.fail(conn, c.job_id, attempt, "http_error", now=T0).ok
    assert claim(conn, "c1", t).reason == "attempts_exhausted"


def test_admission_full(conn: Conn) -> None:
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    t1 = target(conn, "c1")
    t2 = target(conn, "c2")
    assert claim(conn, "c1", t1).claimed
    assert claim(conn, "c2", t2).reason == "admission_full"
    # an expired lease does not count against admission
    assert claim(conn, "c2", t2, now=T0 + LEASE).claimed


def test_refusal_order(conn: Conn) -> None:
    """Several checks fail at once: the first in §6's order is the answer."""
    t = target(conn, "c1")
    everything_wrong = dataclasses.replace(t, from_pair=5, source_message_ids=["x"],
                                           source_hash="nope")
    assert claim(conn, "c1", everything_wrong,
                 prompt_version="conversation-compaction@1").reason == "invalid_range"
    ids_and_version = dataclasses.replace(t, source_message_ids=["x"], source_hash="nope")
    assert claim(conn, "c1", ids_and_version,
                 prompt_version="nope").reason == "invalid_source_ids"
    version_and_range = dataclasses.replace(t, from_pair=10, source_hash="nope")
    assert claim(conn, "c1", version_and_range,
                 prompt_version="nope").reason == "prompt_version_closed"
    assert claim(conn, "c1", version_and_range).reason == "not_eligible"
    conn.execute("UPDATE compaction.settings SET max_running = 0")
    assert claim(conn, "c1", dataclasses.replace(t, source_hash="nope")).reason \
        == "source_mismatch"
    assert claim(conn, "c1", t).reason == "admission_full"


def test_claim_rejects_missing_arguments(conn: Conn) -> None:
    t = target(conn, "c1")
    from pycompactor.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        claim(conn, "c1", t, scope="")


# --- bounded retries --------------------------------------------------------------------

def test_retry_keeps_job_id(conn: Conn) -> None:
    t = target(conn, "c1")
    first = claim(conn, "c1", t)
    assert first.job_id is not None
    assert db.fail(conn, first.job_id, 1, "timeout", now=T0).ok
    second = claim(conn, "c1", t, worker="w2")
    assert (second.claimed, second.job_id, second.attempt) == (True, first.job_id, 2)


def test_two_failures_of_any_kind_exhaust_then_new_source_is_fresh(conn: Conn) -> None:
    history = History(conn)
    seeded = history.pairs("c1", 30)
    t = db.plan_targets(conn, "c1")[0]
    # failure 1: a failed complete (content filter)
    c1 = claim(conn, "c1", t)
    assert c1.job_id is not None
    assert db.complete(conn, c1.job_id, 1, GOOD, "content_filter", 0, now=T0).reason \
        == "not_stopped"
    # failure 2: lease expiry, noticed by the next claim (which reaps its identity)
    c2 = claim(conn, "c1", t, now=T0 + LEASE)
    assert (c2.claimed, c2.attempt) == (True, 2)
    later = T0 + LEASE * 3
    for moment in (later, later + LEASE * 100):
        assert claim(conn, "c1", t, now=moment).reason == "attempts_exhausted"
    assert scalar(conn, "SELECT reason FROM compaction.attempts WHERE attempt = 2") \
        == "lease_expired"
    # edit one source message: the old hash no longer matches, the new one is fresh
    conn.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                 " WHERE message_id = %s", (seeded[3].assistant_message_id,))
    assert claim(conn, "c1", t, now=later).reason == "source_mismatch"
    fresh = db.plan_targets(conn, "c1")[0]
    assert fresh.source_hash != t.source_hash
    n1 = claim(conn, "c1", fresh, now=later)
    assert (n1.claimed, n1.attempt) == (True, 1)
    assert n1.job_id != c1.job_id
    assert n1.job_id is not None
    assert db.fail(conn, n1.job_id, 1, "http_error", now=later).ok
    n2 = claim(conn, "c1", fresh, now=later)
    assert (n2.claimed, n2.attempt, n2.job_id) == (True, 2, n1.job_id)
    assert db.fail(conn, n1.job_id, 2, "http_error", now=later).ok
    assert claim(conn, "c1", fresh, now=later).reason == "attempts_exhausted"
    # the attempt cap holds against direct writes too
    with pytest.raises(psycopg.errors.CheckViolation, match="attempts_at_most_two"):
        conn.execute(
            "INSERT INTO compaction.attempts (conversation_id, job_id, attempt, state, worker,"
            " started_at, lease_expires_at) VALUES ('c1', %s, 3, 'running', 'w', now(), now())",
            (n1.job_id,))


def test_scope_and_model_are_part_of_identity(conn: Conn) -> None:
    t = target(conn, "c1")
    assert claim(conn, "c1", t).claimed
    assert claim(conn, "c1", t, scope="audience-b").claimed
    assert claim(conn, "c1", t, model="other-model").claimed
    assert scalar(conn, "SELECT count(DISTINCT job_id) FROM compaction.jobs") == 3


# --- completion contract ----------------------------------------------------------------

@pytest.mark.parametrize(("summary", "finish_reason", "tool_calls", "reason"), [
    (GOOD, "length", 0, "not_stopped"),
    (GOOD, "content_filter", 0, "not_stopped"),
    (GOOD, "tool_calls", 0, "not_stopped"),
    (GOOD, None, 0, "not_stopped"),
    (GOOD, "stop", 1, "tool_calls"),
    ("", "stop", 0, "empty"),
    (None, "stop", 0, "empty"),
    (" \t\n\r\f\v ", "stop", 0, "empty"),
    ("x" * 6001, "stop", 0, "too_long"),
    ("😀" * 6001, "stop", 0, "too_long"),
    ("", "length", 2, "not_stopped"),   # order: not_stopped before tool_calls before empty
    ("", "stop", 2, "tool_calls"),
])
def test_completion_failures(conn: Conn, summary: str | None, finish_reason: str | None,
                             tool_calls: int, reason: str) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    result = db.complete(conn, c.job_id, 1, summary, finish_reason, tool_calls, now=T0)
    assert (result.ok, result.reason, result.summary_id) == (False, reason, None)
    assert scalar(conn, "SELECT count(*) FROM compaction.summaries") == 0
    assert conn.execute("SELECT state, reason FROM compaction.attempts").fetchall() \
        == [("failed", reason)]


@pytest.mark.parametrize("summary", ["😀" * 6000, "x" * 6000, "\u00a0", "\u200b"])
def test_completion_limits_accepted(conn: Conn, summary: str) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    result = db.complete(conn, c.job_id, 1, summary, "stop", 0, now=T0)
    assert (result.ok, result.reason) == (True, "completed")
    assert scalar(conn, "SELECT summary FROM compaction.summaries") == summary


def test_complete_is_idempotent_for_the_same_text(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    first = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0)
    # re-sent (lost reply), even after the lease would have expired
    again = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0 + LEASE * 2)
    assert again == first
    other = db.complete(conn, c.job_id, 1, GOOD + " (different)", "stop", 0, now=T0)
    assert (other.ok, other.reason, other.summary_id) == (False, "lease_lost", None)
    assert scalar(conn, "SELECT count(*) FROM compaction.summaries") == 1
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events"
                        " WHERE kind = 'completion'") == 1


def test_complete_after_import_is_already_completed(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    db.import_summary(conn, "c1", "default", 0, t.source_message_ids, t.source_hash, MODEL, V3,
                      "imported text", T0)
    result = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0)
    assert (result.ok, result.reason) == (False, "already_completed")
    assert conn.execute("SELECT state, reason FROM compaction.attempts").fetchall() \
        == [("failed", "already_completed")]
    assert conn.execute("SELECT summary, imported FROM compaction.summaries").fetchall() \
        == [("imported text", True)]


# --- fencing ----------------------------------------------------------------------------

def test_reaped_attempt_is_fenced_off(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    assert db.reap(conn, now=T0 + LEASE - LEASE / 10) == 0
    assert db.reap(conn, now=T0 + LEASE) == 1
    before = conn.execute("SELECT * FROM compaction.attempts").fetchall()
    events = scalar(conn, "SELECT count(*) FROM compaction.audit_events")
    # even with a clock that says the lease is still valid, the attempt is over
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0) \
        == db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0)
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0).reason == "lease_lost"
    assert db.fail(conn, c.job_id, 1, "timeout", now=T0).reason == "lease_lost"
    beat = db.heartbeat(conn, c.job_id, 1, now=T0)
    assert (beat.ok, beat.lease_expires_at) == (False, None)
    assert conn.execute("SELECT * FROM compaction.attempts").fetchall() == before
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events") == events
    assert scalar(conn, "SELECT count(*) FROM compaction.summaries") == 0
    assert before[0][3:5] == ("failed", "lease_expired")


def test_reap_puts_the_conversation_back_on_the_queue(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t, scope="lane-b")
    assert c.claimed
    # the source writes queued c1 in scope default only
    assert db.reap(conn, now=T0 + LEASE / 2) == 0
    assert db.dequeue(conn, 100, scope="lane-b") == []
    assert db.reap(conn, now=T0 + LEASE) == 1
    assert [(q.conversation_id, q.scope) for q in db.dequeue(conn, 100, scope="lane-b")] \
        == [("c1", "lane-b")]
    # the dead worker's range gets its second attempt
    assert claim(conn, "c1", t, scope="lane-b").attempt == 2


def test_expired_unreaped_attempt_is_failed_by_the_fenced_call(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    result = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0 + LEASE)
    assert (result.ok, result.reason) == (False, "lease_lost")
    assert conn.execute("SELECT state, reason FROM compaction.attempts").fetchall() \
        == [("failed", "lease_expired")]
    assert db.reap(conn, now=T0 + LEASE * 10) == 0


def test_heartbeat_extends_the_lease(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    beat = db.heartbeat(conn, c.job_id, 1, now=T0 + LEASE / 2)
    assert (beat.ok, beat.lease_expires_at) == (True, T0 + LEASE / 2 + LEASE)
    assert db.reap(conn, now=T0 + LEASE) == 0
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0 + LEASE).ok
    assert db.heartbeat(conn, c.job_id, 1, now=T0 + LEASE).ok is False


def test_unknown_token_is_lease_lost(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    assert db.complete(conn, c.job_id, 2, GOOD, "stop", 0, now=T0).reason == "lease_lost"
    assert db.complete(conn, c.job_id + 1000, 1, GOOD, "stop", 0, now=T0).reason \
        == "lease_lost"
    assert db.fail(conn, c.job_id + 1000, 1, "x", now=T0).reason == "lease_lost"


# --- queue ------------------------------------------------------------------------------

def test_source_writes_enqueue_and_dequeue_takes_them(conn: Conn) -> None:
    History(conn).pairs("c1", 3)
    History(conn).pairs("c2", 1)
    db.enqueue(conn, "c1", "audience-b")
    db.enqueue(conn, "c1", "audience-b")  # idempotent
    taken = db.dequeue(conn, 10)
    assert [(q.conversation_id, q.scope) for q in taken] == [("c1", "default"), ("c2", "default")]
    for entry in taken:
        assert db.ack(conn, entry) == AckResult(True, "acknowledged")
    assert db.dequeue(conn, 10) == []
    assert [(q.conversation_id, q.scope) for q in db.dequeue(conn, 10, scope="audience-b")] \
        == [("c1", "audience-b")]
    conn.execute("UPDATE compaction_source.runs SET status = 'partial'"
                 " WHERE conversation_id = 'c2'")
    [c2] = db.dequeue(conn, 10)
    assert (c2.conversation_id, c2.scope) == ("c2", "default")
    assert db.ack(conn, c2).reason == "acknowledged"
    conn.execute("DELETE FROM compaction_source.messages WHERE conversation_id = 'c2'")
    assert [q.conversation_id for q in db.dequeue(conn, 1)] == ["c2"]


@pytest.mark.parametrize(
    ("text", "finish_reason", "tools", "verdict"),
    [
        ("ok", "stop", 0, None),
        ("ok", "length", 1, "not_stopped"),  # finish_reason is checked first
        ("", "stop", 1, "tool_calls"),  # then tool calls
        (None, "stop", 0, "empty"),
        ("\u3000", "stop", 0, None),  # ideographic space is content (§3)
        ("\u200b", "stop", 0, None),  # so is a zero-width space
        (" \t\n\r\f\v", "stop", 0, "empty"),
        (" " * 6001, "stop", 0, "empty"),  # empty before too_long
        ("界" * 6000, "stop", 0, None),  # characters, not bytes
        ("界" * 6001, "stop", 0, "too_long"),
        ("ok", "end_turn", 0, "not_stopped"),
        ("ok", None, 0, "not_stopped"),
    ],
)
def test_reply_problem_is_completes_verdict(conn: Conn, text: str | None,
                                            finish_reason: str | None, tools: int,
                                            verdict: str | None) -> None:
    """The one home of complete()'s reply rules; the worker asks it before the figures
    gate, and complete records exactly this."""
    assert db.reply_problem(conn, text, finish_reason, tools) == verdict
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    done = db.complete(conn, c.job_id, 1, text, finish_reason, tools, now=T0)
    assert (done.ok, done.reason) == (verdict is None, verdict or "completed")


def test_the_extractive_budget_is_the_limit_the_database_enforces(conn: Conn) -> None:
    """pycompactor/extractive-1 writes within MAX_SUMMARY_CHARS; the database is what
    enforces the limit (contract §6, §8). One number: this fails if they drift apart."""
    limit = MAX_SUMMARY_CHARS
    assert db.reply_problem(conn, "界" * limit, "stop", 0) is None
    assert db.reply_problem(conn, "界" * (limit + 1), "stop", 0) == "too_long"
