"""The rules of an attempt row: one CHECK, each rule reported by its name.

PostgreSQL rebuilds a table's CHECK expressions in every statement that writes it, and a
claim -> complete cycle writes attempts twice: so the seven rules are one CHECK, one call
that names the broken rule in the check_violation, as seven CHECKs' names would. Direct
writes by the owner are what these rules stand against; the engine's functions never
break them.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db
from tests.sql.engine import T0, claim, function_calls, scalar, target

Conn = psycopg.Connection[Any]

INSERT = """
INSERT INTO compaction.attempts
    (conversation_id, job_id, attempt, state, reason, worker, started_at, lease_expires_at,
     finished_at, input_tokens, figures_total, figures_kept)
VALUES ('c1', %(job)s, %(attempt)s, %(state)s, %(reason)s, 'w', %(started)s,
        %(started)s::timestamptz + interval '5 minutes', %(finished)s, %(input_tokens)s,
        %(figures_total)s, %(figures_kept)s)
"""
GOOD_ROW: dict[str, Any] = {
    "attempt": 2, "state": "failed", "reason": "http_error", "started": T0, "finished": T0,
    "input_tokens": None, "figures_total": None, "figures_kept": None,
}


@pytest.fixture
def job_id(conn: Conn) -> int:
    """A job whose first attempt failed: a second attempt row may be written directly."""
    result = claim(conn, "c1", target(conn, "c1"))
    assert result.job_id is not None
    assert db.fail(conn, result.job_id, 1, "http_error", now=T0).ok
    return result.job_id


BROKEN = [
    ("attempts_at_most_two", {"attempt": 3}),
    ("attempts_at_most_two", {"attempt": 0}),
    ("attempts_state_valid", {"state": "paused"}),
    ("attempts_finished_iff_terminal", {"state": "running", "reason": None}),
    ("attempts_finished_iff_terminal", {"finished": None}),
    ("attempts_reason_matches_state", {"reason": None}),
    ("attempts_reason_matches_state", {"state": "completed"}),
    ("attempts_reason_matches_state", {"state": "running", "finished": None}),
    ("attempts_stats_valid", {"input_tokens": -1}),
    ("attempts_stats_valid", {"figures_total": 3, "figures_kept": 4}),
    ("attempts_stats_valid", {"figures_kept": 1}),
    ("attempts_times_valid", {"started": "infinity", "finished": "infinity"}),
    ("attempts_times_valid", {"finished": "2029-12-31T23:59:59Z"}),
    ("attempts_reason_is_code", {"reason": "HTTP error"}),
]


@pytest.mark.parametrize(("rule", "change"), BROKEN,
                         ids=[f"{rule}-{i}" for i, (rule, _) in enumerate(BROKEN)])
def test_a_broken_rule_is_the_check_violation_of_its_name(conn: Conn, job_id: int, rule: str,
                                                          change: dict[str, Any]) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute(INSERT, {**GOOD_ROW, "job": job_id, **change})
    assert info.value.diag.constraint_name == rule
    assert info.value.diag.table_name == "attempts"
    assert info.value.diag.schema_name == "compaction"
    assert rule in str(info.value)


def test_a_row_that_keeps_every_rule_is_written(conn: Conn, job_id: int) -> None:
    # NULL passes a rule, as with any CHECK: stats not reported stay NULL.
    conn.execute(INSERT, {**GOOD_ROW, "job": job_id})
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts WHERE job_id = %s",
                  (job_id,)) == 2


def test_a_rule_holds_on_update_too(conn: Conn, job_id: int) -> None:
    conn.execute(INSERT, {**GOOD_ROW, "job": job_id, "state": "running", "reason": None,
                          "finished": None})
    # The append-only guard lets running -> failed through; the rules judge the new row.
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute("UPDATE compaction.attempts SET state = 'failed', reason = 'Bad Reason',"
                     " finished_at = %s WHERE job_id = %s AND attempt = 2", (T0, job_id))
    assert info.value.diag.constraint_name == "attempts_reason_is_code"


def test_attempts_carry_one_check(conn: Conn) -> None:
    checks = conn.execute(
        "SELECT conname FROM pg_catalog.pg_constraint"
        " WHERE conrelid = 'compaction.attempts'::regclass AND contype = 'c'").fetchall()
    assert checks == [("attempts_rules",)]


def test_a_cycle_calls_no_sql_function_it_could_inline(dsn: str) -> None:
    """A LANGUAGE sql function the planner inlines never shows in the function statistics;
    one that shows was parsed and planned again in that transaction (an SQL function
    such as oversized_identifier in the attempts' CHECKs would be, in every claim)."""
    calls = function_calls(dsn, "c1", 30)
    assert calls["compaction.claim"] == 1
    with psycopg.connect(dsn) as conn:
        sql_functions = {name for (name,) in conn.execute(
            "SELECT n.nspname || '.' || p.proname FROM pg_catalog.pg_proc AS p"
            " JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace"
            " JOIN pg_catalog.pg_language AS l ON l.oid = p.prolang"
            " WHERE n.nspname = 'compaction' AND l.lanname = 'sql'"
            "   AND p.proconfig IS NULL AND NOT p.prosecdef").fetchall()}
    assert not sql_functions & set(calls), calls
