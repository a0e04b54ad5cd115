"""What a claim -> complete cycle calls and checks.

The usual cycle (no p_now, the default lease, no p_stats, the first summary of its range)
runs claim and complete and nothing they can do without: complete writes the new
summary's verdict and frees its slot itself, and claim reads the range itself. The
verdicts it writes are the ones judge_summaries gives, in the common case and when the
range already has a summary. The CHECKs of compaction.jobs are one call that names the
broken rule, as five separate constraints would by their names.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db
from tests.history import History
from tests.sql.engine import GOOD, MODEL, T0, V3, claim, function_calls, scalar, target

Conn = psycopg.Connection[Any]

#: The helpers the usual cycle no longer calls: each is a function call with a SET
#: clause (or a set-returning definer) where the cycle needs none.
SKIPPED = {"compaction.caller_now", "compaction.lease_end", "compaction.lease_fits",
           "compaction.attempt_stats",
           "compaction.current_range", "compaction.rederive_summary_verdicts",
           "compaction.release_slot"}


def test_the_usual_cycle_calls_no_helper_it_can_do_without(dsn: str) -> None:
    calls = function_calls(dsn, "c1", 30, now=None)
    assert calls["compaction.claim"] == 1
    assert calls["compaction.complete"] == 1
    # The statistics see the calls they are asked about: fence is still called.
    assert calls["compaction.fence"] == 1
    assert not SKIPPED & set(calls), calls


def test_the_other_worker_calls_check_p_now_and_the_lease_only_when_given(dsn: str) -> None:
    """claim_next_targets, claim_targets, heartbeat, fail and reap without p_now and with
    the default lease: no call of caller_now or lease_end (lease_fits is inlined)."""
    with psycopg.connect(dsn) as tx:
        History(tx).pairs("c1", 40)
        tx.commit()
        tx.execute("SET LOCAL track_functions = 'all'")
        first, second = db.claim_next_targets(tx, "c1", "default", 1, MODEL, V3, "w1")[:2]
        assert first.claimed
        assert first.job_id is not None
        [batch] = db.claim_targets(tx, "c1", "default", [
            (second.from_pair, second.source_message_ids, second.source_hash)], MODEL, V3, "w1")
        assert batch.claimed
        assert batch.job_id is not None
        assert db.heartbeat(tx, first.job_id, 1, conversation_id="c1").ok
        assert db.fail(tx, batch.job_id, 1, "http_error", conversation_id="c1").ok
        assert db.reap(tx) == 0
        calls: dict[str, int] = dict(tx.execute(
            "SELECT schemaname || '.' || funcname, calls::int FROM pg_stat_xact_user_functions"
        ).fetchall())
        tx.commit()
    assert calls["compaction.fence"] == 2
    assert calls["compaction.reap"] == 1
    assert not {"compaction.caller_now", "compaction.lease_end",
                "compaction.lease_fits"} & set(calls), calls


def test_the_usual_cycle_leaves_the_verdict_and_the_slot_as_before(dsn: str) -> None:
    function_calls(dsn, "c1", 30, now=None)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT v.scope, v.from_pair, v.reason FROM compaction.summary_verdicts AS v"
            " WHERE v.conversation_id = 'c1'").fetchall() == [("default", 0, None)]
        assert conn.execute("SELECT * FROM compaction.verify_conversation('c1')").fetchall() == []
        assert scalar(conn, "SELECT count(*) FROM compaction.admission"
                            " WHERE holder_conversation_id IS NOT NULL") == 0


def verdicts(conn: Conn, conversation_id: str) -> dict[int, str | None]:
    return dict(conn.execute(
        "SELECT summary_id, reason FROM compaction.summary_verdicts"
        " WHERE conversation_id = %s", (conversation_id,)).fetchall())


def test_a_summary_completed_after_its_range_changed_is_stale(conn: Conn) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    conn.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                 " WHERE message_id = %s", (t.source_message_ids[1],))
    done = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0)
    assert done.ok
    assert done.summary_id is not None
    assert verdicts(conn, "c1") == {done.summary_id: "stale_source"}
    assert conn.execute("SELECT * FROM compaction.verify_conversation('c1')").fetchall() == []


def test_a_second_summary_of_a_range_is_judged_with_the_first(conn: Conn) -> None:
    """The range has a verdict already: complete leaves the judgement to
    rederive_summary_verdicts, which prefers the newer summary."""
    t = target(conn, "c1")
    first = claim(conn, "c1", t, model="model-a")
    assert first.job_id is not None
    one = db.complete(conn, first.job_id, 1, GOOD, "stop", 0, now=T0)
    second = claim(conn, "c1", t, model="model-b")
    assert second.job_id is not None
    two = db.complete(conn, second.job_id, 1, GOOD, "stop", 0, now=T0)
    assert one.summary_id is not None
    assert two.summary_id is not None
    assert verdicts(conn, "c1") == {one.summary_id: "superseded", two.summary_id: None}
    assert conn.execute("SELECT * FROM compaction.verify_conversation('c1')").fetchall() == []


JOB = """
INSERT INTO compaction.jobs (conversation_id, scope, from_pair, to_pair, source_message_ids,
                             source_hash, model, prompt_version, created_at)
VALUES ('c1', %(scope)s, %(from_pair)s, %(to_pair)s, %(ids)s, %(hash)s, %(model)s,
        'conversation-compaction@3', now())
"""
GOOD_JOB: dict[str, Any] = {
    "scope": "default", "from_pair": 10, "to_pair": 19,
    "ids": [f"m{i}" for i in range(20)], "hash": "a" * 64, "model": "m",
}
BROKEN_JOBS = [
    ("jobs_model_not_empty", {"model": ""}),
    ("jobs_range_valid", {"from_pair": -10, "to_pair": -1}),
    ("jobs_range_valid", {"from_pair": 5, "to_pair": 14}),
    ("jobs_range_valid", {"to_pair": 20}),
    ("jobs_scope_not_empty", {"scope": ""}),
    ("jobs_source_hash_valid", {"hash": "A" * 64}),
    ("jobs_source_hash_valid", {"hash": "a" * 63}),
    ("jobs_source_ids_valid", {"ids": [f"m{i}" for i in range(19)]}),
    ("jobs_source_ids_valid", {"ids": ["m0"] + [f"m{i}" for i in range(19)]}),
    ("jobs_source_ids_valid", {"ids": [None] + [f"m{i}" for i in range(19)]}),
    # Two rules broken: the first by name, as PostgreSQL checked the five constraints.
    ("jobs_model_not_empty", {"model": "", "scope": ""}),
    ("jobs_range_valid", {"to_pair": 20, "hash": "x"}),
]


@pytest.mark.parametrize(("rule", "change"), BROKEN_JOBS,
                         ids=[f"{rule}-{i}" for i, (rule, _) in enumerate(BROKEN_JOBS)])
def test_a_broken_rule_of_a_job_is_the_check_violation_of_its_name(
        conn: Conn, rule: str, change: dict[str, Any]) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute(JOB, {**GOOD_JOB, **change})
    assert info.value.diag.constraint_name == rule
    assert info.value.diag.table_name == "jobs"
    assert rule in str(info.value)


def test_a_job_that_keeps_every_rule_is_written_and_jobs_carry_one_check(conn: Conn) -> None:
    conn.execute(JOB, GOOD_JOB)
    assert scalar(conn, "SELECT count(*) FROM compaction.jobs") == 1
    assert conn.execute(
        "SELECT conname FROM pg_catalog.pg_constraint"
        " WHERE conrelid = 'compaction.jobs'::regclass AND contype = 'c'").fetchall() == [
        ("jobs_rules",)]


@pytest.mark.parametrize("holder", [
    "holder_conversation_id = 'c1'",
    "holder_conversation_id = 'c1', holder_job_id = 1, holder_attempt = 1",
    "lease_expires_at = now()",
])
def test_an_admission_slot_holds_all_of_a_holder_or_none(conn: Conn, holder: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute(f"UPDATE compaction.admission SET {holder} WHERE slot = 1")
    assert info.value.diag.constraint_name == "admission_holder_complete"
    conn.execute("UPDATE compaction.admission SET holder_conversation_id = 'c1',"
                 " holder_job_id = 1, holder_attempt = 1, lease_expires_at = now()"
                 " WHERE slot = 1")
