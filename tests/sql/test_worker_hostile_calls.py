"""The worker surface against a hostile caller: each hole found by trying the documented
roles as an attacker would, with the hostile inputs that found it, refused.

Every call goes through a LOGIN member of `compaction_worker`, by raw SQL where the
driver would refuse the input itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest

from pycompactor import db, errors, project_history
from pycompactor.models import Target
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.engine import GOOD, MODEL, claim, scalar, target

Conn = psycopg.Connection[Any]

V3 = "conversation-compaction@3"
#: 10000 years less 3,599,999 days: one day when intervals compare (30-day months),
#: about 144 years on the clock.
CENTURIES = "10000 years -3599999 days"
#: Compares as a second, and its months step leaves the calendar.
OFF_CALENDAR = "1000000 years -359999999 days 86399 seconds"
HOSTILE_LEASES = [CENTURIES, OFF_CALENDAR, "1 month -29 days", "1 day 00:00:01",
                  "-1 day +24:00:00", "25 hours", "2 days -23:59:59"]
FAIR_LEASES = ["1 second", "300 seconds", "1 day", "24 hours", "2 days -24:00:00",
               "23:59:59", "1 day -23:00:00"]


@dataclass
class Worker:
    conn: Conn
    job_id: int
    lease_expires_at: datetime


@pytest.fixture
def worker(conn: Conn, login_role: LoginRole) -> Iterator[Worker]:
    """A worker login holding a running attempt on c1 (the server's clock)."""
    t = target(conn, "c1")
    with connect_as(login_role("compaction_worker")) as w:
        c = claim(w, "c1", t, now=None)
        assert c.claimed
        assert c.job_id is not None
        assert c.lease_expires_at is not None
        yield Worker(w, c.job_id, c.lease_expires_at)


def sqlstate_of(conn: Conn, query: str, params: Any = None) -> str | None:
    try:
        conn.execute(query, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def leases(conn: Conn) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(
        "SELECT job_id, attempt, state, lease_expires_at FROM compaction.attempts"
        " ORDER BY job_id, attempt").fetchall()] + [tuple(r) for r in conn.execute(
        "SELECT slot, lease_expires_at FROM compaction.admission"
        " WHERE holder_job_id IS NOT NULL ORDER BY slot").fetchall()]


# --- 1. a lease is bounded by when it ends ---------------------------------------------


def claim_sql(w: Conn, t: Target, lease: str) -> str | None:
    return sqlstate_of(
        w, "SELECT * FROM compaction.claim('c2', 'default', %s, %s, %s, %s, %s, 'w1',"
           " p_lease => %s::interval)",
        (t.from_pair, t.source_message_ids, t.source_hash, MODEL, V3, lease))


@pytest.mark.parametrize("lease", HOSTILE_LEASES)
def test_no_function_grants_a_lease_that_ends_past_a_day(conn: Conn, worker: Worker,
                                                         lease: str) -> None:
    """A lease that ends in 2170 would never be reaped: each function that takes a
    lease refuses it with CP023 (dequeue: CP020), whatever its interval compares as."""
    t2 = target(conn, "c2")
    db.enqueue(conn, "c2")
    before = leases(conn)
    w = worker.conn
    assert claim_sql(w, t2, lease) == "CP023"
    assert sqlstate_of(
        w, "SELECT * FROM compaction.claim_targets('c2', 'default', %s, %s, %s, %s, %s,"
           " 'w1', p_lease => %s::interval)",
        ([t2.from_pair], [t2.source_message_ids], [t2.source_hash], MODEL, V3, lease),
    ) == "CP023"
    assert sqlstate_of(
        w, "SELECT * FROM compaction.claim_next_targets('c2', 'default', 1, %s, %s, 'w1',"
           " p_lease => %s::interval)", (MODEL, V3, lease)) == "CP023"
    assert sqlstate_of(
        w, "SELECT * FROM compaction.heartbeat(%s, 1, p_lease => %s::interval,"
           " p_conversation_id => 'c1')", (worker.job_id, lease)) == "CP023"
    assert sqlstate_of(
        w, "SELECT * FROM compaction.dequeue('default', 10, %s::interval)", (lease,),
    ) == "CP020"
    assert leases(conn) == before
    assert scalar(conn, "SELECT count(*) FROM compaction.queue WHERE leased_until IS NOT NULL") \
        == 0


@pytest.mark.parametrize("lease", FAIR_LEASES)
def test_a_lease_that_ends_within_a_day_is_granted_as_given(conn: Conn, worker: Worker,
                                                            lease: str) -> None:
    t2 = target(conn, "c2")
    w = worker.conn
    assert claim_sql(w, t2, lease) is None
    assert scalar(conn, "SELECT lease_expires_at = started_at + %s::interval"
                        " FROM compaction.attempts WHERE conversation_id = 'c2'", (lease,))
    with w.transaction():
        asked = scalar(w, "SELECT now() + %s::interval", (lease,))
        [(ok, until)] = w.execute(
            "SELECT * FROM compaction.heartbeat(%s, 1, p_lease => %s::interval,"
            " p_conversation_id => 'c1')", (worker.job_id, lease)).fetchall()
    assert ok
    assert until == asked


def test_a_lease_of_centuries_ends_in_a_day_at_most(conn: Conn,
                                                                  worker: Worker) -> None:
    """Whatever a worker login asks for, no running attempt nor slot outlives a day, so
    reap takes back every admission slot within one."""
    t2 = target(conn, "c2")
    claim_sql(worker.conn, t2, CENTURIES)
    limit = scalar(conn, "SELECT now() + interval '1 day'")
    assert scalar(conn, "SELECT max(lease_expires_at) FROM compaction.attempts") <= limit
    assert scalar(conn, "SELECT max(lease_expires_at) FROM compaction.admission") <= limit
    assert db.reap(conn, now=limit) == 1


# --- 6. the fields a worker chooses are bounded and shaped ------------------------------


def attempt_row(conn: Conn, job_id: int) -> tuple[Any, ...]:
    row = conn.execute("SELECT state, reason, finish_reason, response_id, tool_call_count"
                       " FROM compaction.attempts WHERE job_id = %s", (job_id,)).fetchone()
    assert row is not None
    return tuple(row)


def complete_sql(w: Conn, job_id: int, finish_reason: str | None, tool_call_count: int,
                 response_id: str | None, stats: str | None = None) -> str | None:
    return sqlstate_of(
        w, "SELECT * FROM compaction.complete(%s, 1, %s, %s, %s, %s, p_stats => %s::jsonb,"
           " p_conversation_id => 'c1')",
        (job_id, GOOD, finish_reason, tool_call_count, response_id, stats))


@pytest.mark.parametrize(("finish_reason", "tool_call_count", "response_id"), [
    ("stop", 0, "r" * 10_000_000),                      # a 10 MB response id
    ("stop", 0, "chatcmpl-1 <script>alert(1)</script>"),
    ("stop", 0, ""),
    ("stop", 0, "r" * 201),
    ("the user said: my SSN is 078-05-1120", 0, None),  # free text as a finish reason
    ("Stop", 0, None),
    ("s" * 65, 0, None),
    ("stop", -1, None),                                 # a negative count
])
def test_complete_refuses_unshaped_fields_and_changes_nothing(
        conn: Conn, worker: Worker, finish_reason: str, tool_call_count: int,
        response_id: str | None) -> None:
    before = leases(conn)
    assert complete_sql(worker.conn, worker.job_id, finish_reason, tool_call_count,
                        response_id) == "CP020"
    assert leases(conn) == before
    assert attempt_row(conn, worker.job_id) == ("running", None, None, None, None)
    done = db.complete(worker.conn, worker.job_id, 1, GOOD, "stop", 0,
                       response_id="chatcmpl-" + "9" * 191, conversation_id="c1")
    assert (done.ok, done.reason) == (True, "completed")
    assert attempt_row(conn, worker.job_id)[3] == "chatcmpl-" + "9" * 191


@pytest.mark.parametrize("finish_reason", ["length", "content_filter",
                                           "incomplete:max_output_tokens", None])
def test_a_finish_reason_code_is_judged_as_before(conn: Conn, worker: Worker,
                                                  finish_reason: str | None) -> None:
    assert complete_sql(worker.conn, worker.job_id, finish_reason, 0, "resp_1") is None
    assert attempt_row(conn, worker.job_id) == ("failed", "not_stopped", finish_reason,
                                                "resp_1", 0)


@pytest.mark.parametrize("stats", [
    '{"input_tokens": -1}',
    '{"output_tokens": ' + "9" * 100_000 + "}",
    '{"figures_total": 1e3000}',
    '{"figures_kept": "' + "x" * 1_000_000 + '"}',
])
def test_p_stats_values_are_bounded(conn: Conn, worker: Worker, stats: str) -> None:
    before = leases(conn)
    assert complete_sql(worker.conn, worker.job_id, "stop", 0, None, stats) == "CP020"
    assert leases(conn) == before


@pytest.mark.parametrize(("stats", "tool_call_count"), [
    ({"input_tokens": 10 ** 1_000_000}, 0),   # a 1 MB number: no JSON encoder takes it
    ({"input_tokens": -1}, 0),
    ({"figures_invented": True}, 0),
    ({"input_tokens": 1.5}, 0),
    ({"tokens": 1}, 0),
    (None, -1),
    (None, 2 ** 31),
])
def test_the_driver_refuses_unbounded_counts_as_the_database_does(
        conn: Conn, worker: Worker, stats: dict[str, Any] | None,
        tool_call_count: int) -> None:
    before = leases(conn)
    with pytest.raises(errors.InvalidArgument) as info:
        db.complete(worker.conn, worker.job_id, 1, GOOD, "stop", tool_call_count,
                    stats=stats, conversation_id="c1")
    assert info.value.sqlstate == "CP020"
    assert len(str(info.value)) < 200
    assert leases(conn) == before


# --- 2. a refused call holds no lock; a forgotten transaction is bounded -----------------


def conversation_locks_held(conn: Conn, pid: int) -> int:
    """Row locks a backend holds on compaction.conversation_locks (its transaction's
    tuple locks show as locks on the relation, or as the xid others would wait on)."""
    return int(scalar(conn, "SELECT count(*) FROM pg_locks WHERE pid = %s AND granted"
                            " AND relation = 'compaction.conversation_locks'::regclass"
                            " AND mode IN ('RowExclusiveLock', 'RowShareLock')", (pid,)))


@pytest.fixture
def other(login_role: LoginRole) -> Iterator[Conn]:
    """A second worker login: an attacker with the documented role."""
    with connect_as(login_role("compaction_worker")) as w2:
        yield w2


@pytest.mark.parametrize("call", [
    "SELECT * FROM compaction.heartbeat(%(job)s, 1, p_conversation_id => 'c1')",
    "SELECT * FROM compaction.fail(%(job)s, 1, 'timeout', p_conversation_id => 'c1')",
    "SELECT * FROM compaction.complete(%(job)s, 1, 'x', 'stop', 0,"
    " p_conversation_id => 'c1')",
    "SELECT * FROM compaction.heartbeat(%(job)s, 1)",
])
def test_a_call_refused_for_another_login_stalls_nothing(
        conn: Conn, worker: Worker, other: Conn, call: str) -> None:
    """A second worker login w2 calls heartbeat/fail on w1's job inside its own transaction and
    keeps it open: it is refused (lease_lost) and holds no lock, so w1 renews and
    completes at once and reap reaches the conversation."""
    other.execute("BEGIN")
    row = other.execute(call, {"job": worker.job_id}).fetchone()
    assert row is not None
    assert row[0] is False
    pid = other.info.backend_pid
    assert conversation_locks_held(conn, pid) == 0
    # w1 carries on at once (a lock wait would raise LockTimeout after 5 s).
    worker.conn.execute("SET lock_timeout = '1s'")
    assert db.heartbeat(worker.conn, worker.job_id, 1, conversation_id="c1").ok
    done = db.complete(worker.conn, worker.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (done.ok, done.reason) == (True, "completed")
    other.execute("ROLLBACK")


def test_refused_claims_hold_no_lock(conn: Conn, worker: Worker, other: Conn) -> None:
    """w2 claims w1's identity (already_running), by claim, claim_targets and
    claim_next_targets, inside one open transaction: none takes the conversation's lock,
    so w1's completion and a reap of an expired attempt of c1 go through."""
    t1 = db.plan_targets(conn, "c1")[0]
    other.execute("BEGIN")
    assert claim(other, "c1", t1, now=None, worker="w2").reason == "already_running"
    rows = other.execute(
        "SELECT reason FROM compaction.claim_targets('c1', 'default', %s, %s, %s, %s, %s,"
        " 'w2')", ([0], [t1.source_message_ids], [t1.source_hash], MODEL, V3)).fetchall()
    assert rows == [("already_running",)]
    rows = other.execute(
        "SELECT from_pair, claimed, reason FROM compaction.claim_next_targets("
        "'c1', 'default', 4, %s, %s, 'w2')", (MODEL, V3)).fetchall()
    assert rows == [(0, False, "already_running")]
    assert conversation_locks_held(conn, other.info.backend_pid) == 0
    worker.conn.execute("SET lock_timeout = '1s'")
    done = db.complete(worker.conn, worker.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (done.ok, done.reason) == (True, "completed")
    # Now the identity is settled for good: still no lock for the refusal.
    assert claim(other, "c1", t1, now=None, worker="w2").reason == "already_completed"
    assert conversation_locks_held(conn, other.info.backend_pid) == 0
    other.execute("ROLLBACK")


def test_a_forgotten_transaction_gets_a_bound(conn: Conn, worker: Worker,
                                              other: Conn) -> None:
    """An engine call that takes a conversation's lock inside the caller's transaction
    bounds that transaction where the caller set no bound: idle in it for at most 60 s
    (every server), and on PostgreSQL 17 and later at most 60 s in all. A caller's own
    bound is kept."""
    has_transaction_timeout = scalar(
        conn, "SELECT current_setting('transaction_timeout', true) IS NOT NULL")
    t2 = target(conn, "c2")
    other.execute("BEGIN")
    assert claim(other, "c2", t2, now=None, worker="w2").claimed
    assert scalar(other, "SHOW idle_in_transaction_session_timeout") == "1min"
    if has_transaction_timeout:
        assert scalar(other, "SHOW transaction_timeout") == "1min"
    other.execute("ROLLBACK")
    assert scalar(other, "SHOW idle_in_transaction_session_timeout") == "0"
    # A bound of the caller's own stays.
    other.execute("BEGIN")
    other.execute("SET LOCAL idle_in_transaction_session_timeout = '5s'")
    assert db.reap(other) == 0
    assert claim(other, "c2", t2, now=None, worker="w2").claimed
    assert scalar(other, "SHOW idle_in_transaction_session_timeout") == "5s"
    other.execute("ROLLBACK")


def test_reap_in_a_kept_transaction_is_bounded(conn: Conn, worker: Worker,
                                               other: Conn) -> None:
    """`BEGIN; SELECT reap(); …` held five conversations: the reaping transaction gets
    the same bound as any other that takes a conversation's lock."""
    later = scalar(conn, "SELECT lease_expires_at + interval '1 second'"
                         " FROM compaction.attempts WHERE job_id = %s", (worker.job_id,))
    conn.execute("UPDATE compaction.attempts SET lease_expires_at = now() - interval '1s'"
                 " WHERE job_id = %s", (worker.job_id,))
    conn.execute("UPDATE compaction.admission SET lease_expires_at = now() - interval '1s'"
                 " WHERE holder_job_id = %s", (worker.job_id,))
    assert later is not None
    other.execute("BEGIN")
    assert db.reap(other) == 1
    assert scalar(other, "SHOW idle_in_transaction_session_timeout") == "1min"
    other.execute("ROLLBACK")


# --- 5. client encodings: arrays never split, surrogates named ---------------------------

SPLITTER = 'ソ",INJ,ソ'  # in SJIS, ソ ends in 0x5c: a backslash the array parser obeys


def ids_with_splitter() -> list[str]:
    return [SPLITTER, "z", *[f"id-{i}" for i in range(18)]]


@pytest.mark.parametrize("encoding", ["SJIS", "BIG5", "GBK", "GB18030", "JOHAB"])
def test_the_drivers_connections_are_utf8_whatever_the_environment_says(
        conn: Conn, dsn: str, encoding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PGCLIENTENCODING=SJIS an array of 20 ids reached the server as 22 (both
    call forms): db.connect's connections speak UTF8, so it arrives as sent."""
    target(conn, "c1")
    monkeypatch.setenv("PGCLIENTENCODING", encoding)
    with db.connect(dsn) as c:
        assert c.info.encoding == "utf-8"
        t = db.plan_targets(c, "c1")[0]
        answer = db.claim(c, "c1", "default", 0, ids_with_splitter(), t.source_hash, MODEL,
                          V3, "w1")
        # 20 distinct ids, not those of the range: judged, never invalid_source_ids.
        assert answer.reason == "source_mismatch"
        echoed = c.execute("SELECT %s::text[]", (ids_with_splitter(),)).fetchone()
        assert echoed == (ids_with_splitter(),)


@pytest.mark.parametrize("encoding", ["SJIS", "BIG5", "GBK", "GB18030", "JOHAB", "LATIN1"])
def test_a_callers_connection_in_another_encoding_is_refused_by_name(
        conn: Conn, dsn: str, encoding: str) -> None:
    """A connection the caller opened under another client encoding is refused before
    anything is sent, by both call forms and the projection, with an error that names
    the encoding (not, as JOHAB's could be, 'cannot reach the database')."""
    t = target(conn, "c1")
    with psycopg.connect(dsn, autocommit=True, client_encoding=encoding) as other:
        calls: list[Callable[[], object]] = [
            lambda: db.claim(other, "c1", "default", 0, t.source_message_ids,
                             t.source_hash, MODEL, V3, "w1"),           # inline
            lambda: db.complete(other, 1, 1, GOOD, "stop", 0),            # pipeline
            lambda: db.plan_targets(other, "c1"),
            lambda: project_history(other, "c1", budget_bytes=10_000),
        ]
        for call in calls:
            with pytest.raises(errors.ClientEncodingNotUtf8) as info:
                call()
            assert encoding in str(info.value)
            assert "cannot reach" not in str(info.value)
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts") == 0


@pytest.mark.parametrize("where", ["worker", "conversation", "summary"])
def test_a_lone_surrogate_is_a_package_error_naming_it(conn: Conn, worker: Worker,
                                                       where: str) -> None:
    t = target(conn, "c2")
    lone = "w\ud800"
    calls: dict[str, Callable[[], object]] = {
        "worker": lambda: db.claim(worker.conn, "c2", "default", 0, t.source_message_ids,
                                   t.source_hash, MODEL, V3, lone),
        "conversation": lambda: db.plan_targets(worker.conn, lone),
        "summary": lambda: db.complete(worker.conn, worker.job_id, 1, lone, "stop", 0,
                                       conversation_id="c1"),
    }
    with pytest.raises(errors.UnencodableText) as info:
        calls[where]()
    assert "surrogate" in str(info.value)
    assert isinstance(info.value, errors.PycompactorError)
    assert attempt_row(conn, worker.job_id)[0] == "running"


# --- 4. tracking triggers act only on the tables the source views read ------------------


def test_a_tracking_trigger_on_a_scratch_table_changes_nothing(conn: Conn) -> None:
    """A table owner attaches track_source_changes() to a scratch table and truncates
    it: derived_state_status() must not go to not_rebuilt for the whole database. The
    trigger acts only on a table the source views read."""
    target(conn, "c1")
    assert scalar(conn, "SELECT compaction.derived_state_status()") == "in_use"
    generation = "SELECT generation FROM compaction.conversation_state" \
                 " WHERE conversation_id = 'c1'"
    before = scalar(conn, generation)
    conn.execute("CREATE TABLE public.scratch (conversation_id text, run_id text)")
    for event in ("TRUNCATE", "INSERT", "DELETE"):
        new_or_old = {"INSERT": " REFERENCING NEW TABLE AS new_rows",
                      "DELETE": " REFERENCING OLD TABLE AS old_rows"}.get(event, "")
        conn.execute(f"CREATE TRIGGER scratch_{event.lower()} AFTER {event} ON public.scratch"
                     f"{new_or_old} FOR EACH STATEMENT EXECUTE FUNCTION"
                     " compaction.track_source_changes('conversation_id', 'run_id')")
        conn.execute(f"ALTER TABLE public.scratch ENABLE ALWAYS TRIGGER scratch_{event.lower()}")
    conn.execute("INSERT INTO public.scratch SELECT 'c1', r.run_id"
                 " FROM compaction_source.runs AS r WHERE r.conversation_id = 'c1'")
    conn.execute("DELETE FROM public.scratch")
    conn.execute("TRUNCATE public.scratch")
    assert scalar(conn, "SELECT compaction.derived_state_status()") == "in_use"
    assert scalar(conn, generation) == before
    # The source's own tables still count: a TRUNCATE of one takes the state out of use.
    conn.execute("TRUNCATE compaction_source.messages")
    assert scalar(conn, "SELECT compaction.derived_state_status()") == "not_rebuilt"


# --- 9. what a worker can read through the projection functions is said ----------------


def test_security_md_says_a_worker_reads_any_summary_and_it_does(
        conn: Conn, worker: Worker, other: Conn) -> None:
    """docs/security.md says that a worker login reads every completed summary
    through projection_texts, not only those of ranges it claimed; the behaviour is the
    one the page describes."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert "every completed summary of every conversation and scope" in page
    assert "projection_texts" in page
    done = db.complete(worker.conn, worker.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert done.summary_id is not None
    rows = other.execute("SELECT summary_id, content FROM compaction.projection_texts("
                         "'c1', '{}', %s)", ([done.summary_id],)).fetchall()
    assert rows == [(done.summary_id, GOOD)]
