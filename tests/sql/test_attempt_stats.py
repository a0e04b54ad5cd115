"""complete's p_stats (contract §6): validated, kept with the attempt, shown by audit_jobs."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.errors import PycompactorError
from tests.sql.engine import GOOD, T0, claim, scalar, target

Conn = psycopg.Connection[Any]

STATS_COLUMNS = "input_tokens, output_tokens, figures_total, figures_kept"


def audit_stats(conn: Conn, job_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        f"SELECT state, reason, {STATS_COLUMNS} FROM compaction.audit_jobs WHERE job_id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def claimed_job(conn: Conn, conversation_id: str = "c1", *,
                now: datetime | None = T0) -> int:
    result = claim(conn, conversation_id, target(conn, conversation_id), now=now)
    assert result.claimed
    assert result.job_id is not None
    return result.job_id


def test_stats_are_kept_with_the_completed_attempt(conn: Conn) -> None:
    job_id = claimed_job(conn)
    stats = {"input_tokens": 1834, "output_tokens": 212, "figures_total": 30,
             "figures_kept": 27}
    done = db.complete(conn, job_id, 1, GOOD, "stop", 0, now=T0, stats=stats)
    assert (done.ok, done.reason) == (True, "completed")
    assert audit_stats(conn, job_id) == ("completed", "completed", 1834, 212, 30, 27)


def test_stats_are_kept_with_an_attempt_the_database_fails(conn: Conn) -> None:
    job_id = claimed_job(conn)
    done = db.complete(conn, job_id, 1, "cut off", "length", 0, now=T0,
                       stats={"input_tokens": 900, "output_tokens": 4096})
    assert (done.ok, done.reason) == (False, "not_stopped")
    assert audit_stats(conn, job_id) == ("failed", "not_stopped", 900, 4096, None, None)


def test_no_stats_are_null_columns(conn: Conn) -> None:
    job_id = claimed_job(conn)
    assert db.complete(conn, job_id, 1, GOOD, "stop", 0, now=T0).ok
    assert audit_stats(conn, job_id) == ("completed", "completed", None, None, None, None)
    # A subset of the keys: the others stay NULL; zero is a value.
    job_2 = claimed_job(conn, "c2")
    assert db.complete(conn, job_2, 1, GOOD, "stop", 0, now=T0,
                       stats={"figures_total": 0, "figures_kept": 0}).ok
    assert audit_stats(conn, job_2) == ("completed", "completed", None, None, 0, 0)


def test_imported_summaries_have_null_stats(conn: Conn) -> None:
    t = target(conn, "c1")
    summary_id = db.import_summary(conn, "c1", "default", 0, t.source_message_ids,
                                   t.source_hash, "legacy", "conversation-compaction@2",
                                   GOOD, T0)
    row = conn.execute(f"SELECT state, {STATS_COLUMNS} FROM compaction.audit_jobs"
                       " WHERE summary_id = %s", (summary_id,)).fetchone()
    assert row == ("imported", None, None, None, None)


BAD_STATS = [
    ("array", [1, 2]),
    ("string", "figures_total=3"),
    ("number", 3),
    ("json_null", None),
    ("unknown_key", {"total_tokens": 5}),
    ("negative", {"input_tokens": -1}),
    ("fraction", {"output_tokens": 1.5}),
    ("fraction_zero", {"output_tokens": 1.0}),
    ("exponent_fraction", {"figures_total": 2.5e1}),
    ("string_number", {"figures_total": "3"}),
    ("boolean", {"figures_total": True}),
    ("null_value", {"figures_total": None}),
    ("too_big", {"input_tokens": 2**31}),
    ("kept_above_total", {"figures_total": 3, "figures_kept": 4}),
    ("kept_without_total", {"figures_kept": 1}),
]


@pytest.mark.parametrize("stats", [s for _, s in BAD_STATS], ids=[n for n, _ in BAD_STATS])
def test_bad_stats_raise_cp020_and_change_nothing(conn: Conn, stats: Any) -> None:
    job_id = claimed_job(conn)
    before = conn.execute("SELECT a.* FROM compaction.attempts a").fetchall()
    events = scalar(conn, "SELECT count(*) FROM compaction.audit_events")
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(
            "SELECT * FROM compaction.complete(%s, 1, %s, 'stop', 0, p_now => %s,"
            " p_stats => %s::jsonb)",
            (job_id, GOOD, T0, json.dumps(stats)),
        )
    assert raised.value.sqlstate == "CP020", raised.value
    assert conn.execute("SELECT a.* FROM compaction.attempts a").fetchall() == before
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events") == events
    assert scalar(conn, "SELECT count(*) FROM compaction.job_summaries") == 0
    # The attempt is still running and completes normally.
    assert db.complete(conn, job_id, 1, GOOD, "stop", 0, now=T0,
                       stats={"figures_total": 3, "figures_kept": 3}).ok


def test_bad_stats_do_not_even_expire_a_lapsed_lease(conn: Conn) -> None:
    """An error changes nothing: the fence (which fails an expired attempt) is not reached."""
    job_id = claimed_job(conn)
    late = T0.replace(year=2031)
    with pytest.raises(PycompactorError):
        db.complete(conn, job_id, 1, GOOD, "stop", 0, now=late,
                    stats={"figures_total": 1, "figures_kept": 2})
    assert scalar(conn, "SELECT state FROM compaction.attempts") == "running"


def test_the_largest_count_and_zero_are_accepted(conn: Conn) -> None:
    job_id = claimed_job(conn)
    stats = {"input_tokens": 2**31 - 1, "output_tokens": 0, "figures_total": 7,
             "figures_kept": 7}
    assert db.complete(conn, job_id, 1, GOOD, "stop", 0, now=T0, stats=stats).ok
    assert audit_stats(conn, job_id)[2:] == (2**31 - 1, 0, 7, 7)


def test_stats_never_change_on_lease_renewal(conn: Conn) -> None:
    """The append-only guard covers the new columns: only running -> terminal sets them."""
    job_id = claimed_job(conn)
    with pytest.raises(psycopg.Error) as raised:
        conn.execute("UPDATE compaction.attempts SET figures_total = 3 WHERE job_id = %s",
                     (job_id,))
    assert raised.value.sqlstate == "CP011"


def test_worker_role_can_pass_stats(conn: Conn, login_role: Any) -> None:
    with psycopg.connect(login_role("compaction_worker"), autocommit=True) as worker:
        # the worker's own attempt (contract §6), on the server's clock
        result = claim(worker, "c1", target(conn, "c1"), now=None)
        assert result.job_id is not None
        job_id = result.job_id
        done = db.complete(worker, job_id, 1, GOOD, "stop", 0,
                           stats={"input_tokens": 10, "output_tokens": 2})
    assert done.ok
    assert audit_stats(conn, job_id)[2:4] == (10, 2)
