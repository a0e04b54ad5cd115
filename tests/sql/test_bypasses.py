"""The worker-callable surface as a security boundary (contract §6, §7, §10).

Each bypass a LOGIN member of `compaction_worker` (or of the owner role, for prompt
versions) could once use is tried through the granted functions only, and must be
refused with its own `CP` SQLSTATE while nothing changes: the attempt stays running and
is finished normally afterwards, and every audit view stays readable.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pycompactor import db, errors
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.engine import GOOD, LEASE, claim, scalar, target

Conn = psycopg.Connection[Any]

AUDIT_VIEWS = ["audit_jobs", "audit_stale_summaries", "audit_exhausted", "audit_events",
               "audit_queue"]
SECRET = "user said: my SSN is 078-05-1120"


def state(conn: Conn) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    return tuple(conn.execute(query).fetchall() for query in (
        "SELECT * FROM compaction.jobs ORDER BY job_id",
        "SELECT * FROM compaction.attempts ORDER BY job_id, attempt",
        "SELECT * FROM compaction.job_summaries ORDER BY summary_id",
        "SELECT event_id, kind, reason FROM compaction.audit_events ORDER BY recorded_at, event_id",
        "SELECT * FROM compaction.admission ORDER BY slot",
        "SELECT * FROM compaction.prompt_versions ORDER BY prompt_version",
    ))


def audit_readable(auditor: Conn) -> None:
    """Every column of every row, evaluated by the server (as text: a client could not
    load an infinite timestamp into a datetime anyway)."""
    for view in AUDIT_VIEWS:
        auditor.execute(f"SELECT v::text FROM compaction.{view} AS v").fetchall()


def serialization_failure(exc: BaseException) -> bool:
    cause = exc.__cause__
    return isinstance(cause, psycopg.Error) and cause.sqlstate == "40001"


def refused(sqlstate: str, call: Any, *args: Any, **kwargs: Any) -> errors.EngineError:
    with pytest.raises(errors.EngineError) as info:
        call(*args, **kwargs)
    assert info.value.sqlstate == sqlstate, info.value
    return info.value


@dataclass
class Running:
    worker: Conn
    auditor: Conn
    job_id: int
    server_now: datetime


@pytest.fixture
def running(conn: Conn, login_role: LoginRole) -> Iterator[Running]:
    """A worker's running attempt on c1 (the server's clock), a worker and an auditor."""
    t = target(conn, "c1")
    with connect_as(login_role("compaction_worker")) as worker, \
            connect_as(login_role("compaction_auditor")) as auditor:
        c = claim(worker, "c1", t, now=None)
        assert c.claimed
        assert c.job_id is not None
        yield Running(worker, auditor, c.job_id, scalar(conn, "SELECT now()"))


def still_running_then_finishes(conn: Conn, r: Running) -> None:
    assert scalar(conn, "SELECT state FROM compaction.attempts WHERE job_id = %s",
                  (r.job_id,)) == "running"
    audit_readable(r.auditor)
    assert db.heartbeat(r.worker, r.job_id, 1, conversation_id="c1").ok
    done = db.complete(r.worker, r.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (done.ok, done.reason) == (True, "completed")
    audit_readable(r.auditor)
    finished = conn.execute("SELECT started_at, finished_at FROM compaction.attempts"
                            " WHERE job_id = %s", (r.job_id,)).fetchone()
    assert finished is not None
    assert finished[1] >= finished[0]


# --- 1. the server owns time -------------------------------------------------------------

def test_worker_cannot_backdate_complete(conn: Conn, running: Running) -> None:
    before = state(conn)
    for now in (running.server_now - timedelta(hours=1), running.server_now):
        refused("CP025", db.complete, running.worker, running.job_id, 1, GOOD, "stop", 0,
                now=now, conversation_id="c1")
        refused("CP025", db.fail, running.worker, running.job_id, 1, "timeout", now=now)
        refused("CP025", db.heartbeat, running.worker, running.job_id, 1, now=now)
    assert state(conn) == before
    still_running_then_finishes(conn, running)


def test_expired_lease_cannot_be_completed_with_an_earlier_clock(
        conn: Conn, login_role: LoginRole) -> None:
    """The issue's case: a lease that ran out, completed 'an hour ago'."""
    t = target(conn, "c1")
    # a superuser may pass p_now: an attempt whose lease ran out a second ago
    c = claim(conn, "c1", t, now=scalar(conn, "SELECT now()") - LEASE - timedelta(seconds=1))
    assert c.job_id is not None
    with connect_as(login_role("compaction_worker")) as worker:
        before = state(conn)
        refused("CP025", db.complete, worker, c.job_id, 1, GOOD, "stop", 0,
                now=scalar(conn, "SELECT now()") - timedelta(hours=1), conversation_id="c1")
        assert state(conn) == before
        # Not the claimer (contract §6): refused, and not even the expiry is its to record.
        late = db.complete(worker, c.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
        assert (late.ok, late.reason) == (False, "lease_lost")
        assert state(conn) == before
    late = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (late.ok, late.reason) == (False, "lease_lost")
    assert scalar(conn, "SELECT reason FROM compaction.attempts WHERE job_id = %s",
                  (c.job_id,)) == "lease_expired"
    assert scalar(conn, "SELECT count(*) FROM compaction.job_summaries") == 0


def test_owner_clock_must_be_finite_and_not_before_the_start(conn: Conn,
                                                             running: Running) -> None:
    before = state(conn)
    refused("CP022", db.complete, conn, running.job_id, 1, GOOD, "stop", 0,
            now=running.server_now - timedelta(hours=1))
    with pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT compaction.reap(p_now => 'infinity')")
    assert info.value.sqlstate == "CP022"
    with pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT compaction.heartbeat(%s, 1, p_now => '-infinity')",
                     (running.job_id,))
    assert info.value.sqlstate == "CP022"
    assert state(conn) == before
    still_running_then_finishes(conn, running)


# --- 2. admission and leases ------------------------------------------------------------

def test_worker_cannot_claim_from_the_future_past_admission(conn: Conn,
                                                            running: Running) -> None:
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    t2 = target(conn, "c2")
    before = state(conn)
    refused("CP025", claim, running.worker, "c2", t2,
            now=running.server_now + timedelta(days=1))
    assert claim(running.worker, "c2", t2, now=None).reason == "admission_full"
    assert state(conn) == before
    still_running_then_finishes(conn, running)
    assert claim(running.worker, "c2", t2, now=None).claimed


@pytest.mark.parametrize("lease", [timedelta(days=365_000), timedelta(days=1, seconds=1),
                                   timedelta(milliseconds=999), timedelta(0),
                                   timedelta(seconds=-5)])
def test_leases_lie_within_a_second_and_a_day(conn: Conn, running: Running,
                                              lease: timedelta) -> None:
    t2 = target(conn, "c2")
    before = state(conn)
    refused("CP023", db.heartbeat, running.worker, running.job_id, 1, lease=lease,
            conversation_id="c1")
    refused("CP023", claim, running.worker, "c2", t2, now=None, lease=lease)
    assert state(conn) == before
    still_running_then_finishes(conn, running)


def test_the_bounds_themselves_are_leases(conn: Conn, running: Running) -> None:
    beat = db.heartbeat(running.worker, running.job_id, 1, lease=timedelta(days=1),
                        conversation_id="c1")
    assert beat.ok
    assert beat.lease_expires_at is not None
    assert scalar(conn, "SELECT lease_expires_at FROM compaction.admission"
                        " WHERE holder_job_id = %s", (running.job_id,)) == beat.lease_expires_at
    t2 = target(conn, "c2")
    assert claim(running.worker, "c2", t2, now=None, lease=timedelta(seconds=1)).claimed


# --- 3. reap cannot be pushed to the end of time ----------------------------------------

def test_worker_cannot_reap_at_infinity(conn: Conn, running: Running) -> None:
    before = state(conn)
    for now in ("infinity", "2999-01-01"):
        with pytest.raises(psycopg.Error) as info:
            running.worker.execute("SELECT compaction.reap(p_now => %s)", (now,))
        assert info.value.sqlstate == "CP025"
    assert state(conn) == before
    assert db.reap(running.worker) == 0
    still_running_then_finishes(conn, running)


def test_audit_views_read_rows_from_before_the_time_checks(conn: Conn,
                                                          running: Running) -> None:
    """Attempts are append-only history: rows stored before the time checks with an infinite
    finish time stay (the checks are NOT VALID), and no audit view may fail on them."""
    conn.execute("ALTER TABLE compaction.attempts DROP CONSTRAINT attempts_rules")
    conn.execute("ALTER TABLE compaction.event_log DROP CONSTRAINT audit_events_times_finite")
    conn.execute("UPDATE compaction.attempts SET state = 'failed', reason = 'lease_expired',"
                 " finished_at = 'infinity' WHERE job_id = %s", (running.job_id,))
    conn.execute("""
        ALTER TABLE compaction.attempts ADD CONSTRAINT attempts_rules CHECK (
            compaction.attempt_rules_hold(attempt, state, reason, started_at, lease_expires_at,
                                          finished_at, input_tokens, output_tokens,
                                          figures_total, figures_kept,
                                          figures_invented)) NOT VALID""")
    conn.execute("ALTER TABLE compaction.event_log ADD CONSTRAINT audit_events_times_finite"
                 " CHECK (pg_catalog.isfinite(occurred_at)) NOT VALID")
    audit_readable(running.auditor)
    row = running.auditor.execute("SELECT finished_at::text, duration FROM compaction.audit_jobs"
                                  " WHERE job_id = %s", (running.job_id,)).fetchone()
    assert row == ("infinity", None)


# --- 4. reasons are codes ---------------------------------------------------------------

@pytest.mark.parametrize("reason", [SECRET, "HTTP error", "", " ", "timeout ", "x" * 65,
                                    "9lives", "http-500", "résumé"])
def test_fail_reason_must_be_a_code(conn: Conn, running: Running, reason: str) -> None:
    before = state(conn)
    error = refused("CP024", db.fail, running.worker, running.job_id, 1, reason,
                    conversation_id="c1")
    assert "078-05" not in str(error)
    assert state(conn) == before
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events AS e"
                        " WHERE e::text LIKE '%%078-05%%'") == 0
    still_running_then_finishes(conn, running)


def test_a_code_is_recorded(conn: Conn, running: Running) -> None:
    assert db.fail(running.worker, running.job_id, 1, "http_429", conversation_id="c1").ok
    assert running.auditor.execute("SELECT reason FROM compaction.audit_jobs"
                                   " WHERE job_id = %s", (running.job_id,)).fetchone() \
        == ("http_429",)


def test_the_conversation_named_must_be_the_jobs(conn: Conn, running: Running) -> None:
    target(conn, "c2")
    before = state(conn)
    for call in (lambda c: db.complete(running.worker, running.job_id, 1, GOOD, "stop", 0,
                                       conversation_id=c),
                 lambda c: db.fail(running.worker, running.job_id, 1, "timeout",
                                   conversation_id=c)):
        result = call("c2")
        assert (result.ok, result.reason) == (False, "lease_lost")
    beat = db.heartbeat(running.worker, running.job_id, 1, conversation_id="c2")
    assert not beat.ok
    assert state(conn) == before
    still_running_then_finishes(conn, running)


# --- 5. admission exact at every isolation level ----------------------------------------

@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_stale_snapshot_claim_is_an_error_never_an_admission(
        conn: Conn, login_role: LoginRole, isolation: str) -> None:
    """The issue's interleaving: A's snapshot predates B's committed claim."""
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    t1, t2 = target(conn, "c1"), target(conn, "c2")
    dsn = login_role("compaction_worker")
    with connect_as(dsn) as a, connect_as(dsn) as b:
        a.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        a.execute("SELECT count(*) FROM compaction.prompt_versions")  # takes the snapshot
        assert claim(b, "c2", t2, now=None).claimed
        with pytest.raises(errors.PycompactorError) as info:
            claim(a, "c1", t1, now=None)
        assert serialization_failure(info.value)
        a.execute("ROLLBACK")
        # a fresh snapshot sees the full slot
        assert claim(a, "c1", t1, now=None).reason == "admission_full"
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts WHERE state = 'running'") == 1


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_admission_race_at_isolation_level(conn: Conn, login_role: LoginRole,
                                           isolation: str) -> None:
    """Twelve connections at once, each under default_transaction_isolation, retrying
    serialization failures as an application must: exactly max_running are admitted."""
    n, limit = 12, 3
    conn.execute("UPDATE compaction.settings SET max_running = %s", (limit,))
    targets = {f"r{i}": target(conn, f"r{i}") for i in range(n)}
    level = isolation.replace(" ", "\\ ")
    dsn = psycopg.conninfo.make_conninfo(login_role("compaction_worker"),
                                         options=f"-c default_transaction_isolation={level}")
    barrier = threading.Barrier(n)
    outcomes: Counter[str] = Counter()
    retries: Counter[str] = Counter()
    lock = threading.Lock()

    def run(conversation_id: str) -> None:
        with db.connect(dsn) as worker:
            barrier.wait()
            while True:
                try:
                    result = claim(worker, conversation_id, targets[conversation_id], now=None)
                except errors.PycompactorError as exc:
                    if not serialization_failure(exc):
                        raise
                    with lock:
                        retries[conversation_id] += 1
                    continue
                with lock:
                    outcomes[result.reason] += 1
                return

    threads = [threading.Thread(target=run, args=(c,)) for c in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == {"claimed": limit, "admission_full": n - limit}
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts WHERE state = 'running'") \
        == limit
    assert scalar(conn, "SELECT count(*) FROM compaction.admission"
                        " WHERE holder_conversation_id IS NOT NULL") == limit


# --- 6. prompt versions are frozen, for the owner too ------------------------------------

@pytest.mark.parametrize("statement", [
    "UPDATE compaction.prompt_versions SET projectable = true"
    " WHERE prompt_version = 'conversation-compaction@1'",
    "UPDATE compaction.prompt_versions SET input_kind = 'assistant_only'"
    " WHERE prompt_version = 'conversation-compaction@1'",
    "UPDATE compaction.prompt_versions SET accepts_new_jobs = true"
    " WHERE prompt_version = 'conversation-compaction@2'",
    "UPDATE compaction.prompt_versions SET prompt_version = 'conversation-compaction@9'"
    " WHERE prompt_version = 'conversation-compaction@2'",
    "DELETE FROM compaction.prompt_versions WHERE prompt_version = 'conversation-compaction@1'",
])
def test_prompt_versions_are_frozen_for_the_owner(conn: Conn, login_role: LoginRole,
                                                  statement: str) -> None:
    before = state(conn)
    with connect_as(login_role("compaction_owner")) as owner:
        with pytest.raises(psycopg.Error) as info:
            owner.execute(statement)
        assert info.value.sqlstate == "CP013"
    with pytest.raises(psycopg.Error) as info:
        conn.execute(statement)  # a superuser too
    assert info.value.sqlstate == "CP013"
    assert state(conn) == before


def test_closing_a_version_is_the_one_change(conn: Conn, login_role: LoginRole) -> None:
    with connect_as(login_role("compaction_owner")) as owner:
        owner.execute("UPDATE compaction.prompt_versions SET accepts_new_jobs = false"
                      " WHERE prompt_version = 'conversation-compaction@3'")
        with pytest.raises(psycopg.Error) as info:
            owner.execute("UPDATE compaction.prompt_versions SET accepts_new_jobs = true"
                          " WHERE prompt_version = 'conversation-compaction@3'")
        assert info.value.sqlstate == "CP013"
    t = target(conn, "c1")
    assert claim(conn, "c1", t).reason == "prompt_version_closed"


# --- admission slots follow max_running ---------------------------------------------------

def test_lowering_max_running_keeps_the_running_and_counts_them(conn: Conn) -> None:
    conn.execute("UPDATE compaction.settings SET max_running = 3")
    claimed = [claim(conn, f"c{i}", target(conn, f"c{i}"), now=None) for i in range(3)]
    assert all(c.claimed for c in claimed)
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    # three running, limit one: nothing is admitted until two of them end
    held = "SELECT count(*) FROM compaction.admission WHERE holder_conversation_id IS NOT NULL"
    assert scalar(conn, held) == 3
    t = target(conn, "c9")
    assert claim(conn, "c9", t, now=None).reason == "admission_full"
    for c, conversation_id in zip(claimed[:2], ["c0", "c1"], strict=True):
        assert c.job_id is not None
        assert db.fail(conn, c.job_id, 1, "timeout", conversation_id=conversation_id).ok
        assert claim(conn, "c9", t, now=None).reason == "admission_full"
    assert claimed[2].job_id is not None
    assert db.fail(conn, claimed[2].job_id, 1, "timeout", conversation_id="c2").ok
    assert claim(conn, "c9", t, now=None).claimed
    assert scalar(conn, held) == 1
    # Raising it admits at once: the slots 1..10000 always exist.
    conn.execute("UPDATE compaction.settings SET max_running = 4")
    more = [claim(conn, f"d{i}", target(conn, f"d{i}"), now=None) for i in range(4)]
    assert [m.reason for m in more] == ["claimed"] * 3 + ["admission_full"]
    assert scalar(conn, held) == 4
    assert scalar(conn, "SELECT count(*) FROM compaction.admission") == 10000
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE compaction.settings SET max_running = 1000000")


HIGH_WATER = "SELECT admission_high_water FROM compaction.settings"


def test_the_high_water_falls_only_once_the_slots_above_are_free(conn: Conn) -> None:
    """The slots above a lowered max_running are looked at until a claim
    finds them free, and nobody but that claim lowers the mark by hand."""
    assert scalar(conn, HIGH_WATER) == 8
    conn.execute("UPDATE compaction.settings SET max_running = 3")
    assert scalar(conn, HIGH_WATER) == 8
    # the first claim finds slots 4..8 free and brings it down
    claimed = [claim(conn, f"c{i}", target(conn, f"c{i}"), now=None) for i in range(3)]
    assert scalar(conn, HIGH_WATER) == 3
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    # by hand it stays: a typo would admit past the running attempts above the limit
    conn.execute("UPDATE compaction.settings SET admission_high_water = 0")
    assert scalar(conn, HIGH_WATER) == 3
    t = target(conn, "c9")
    assert claim(conn, "c9", t, now=None).reason == "admission_full"
    assert scalar(conn, HIGH_WATER) == 3
    for c, conversation_id in zip(claimed, ["c0", "c1", "c2"], strict=True):
        assert c.job_id is not None
        assert db.fail(conn, c.job_id, 1, "timeout", conversation_id=conversation_id).ok
    # the first claim to find the slots above free lowers it, then takes a slot below
    assert claim(conn, "c9", t, now=None).claimed
    assert scalar(conn, HIGH_WATER) == 1
    assert scalar(conn, "SELECT slot FROM compaction.attempts"
                        " WHERE conversation_id = 'c9'") == 1
    conn.execute("UPDATE compaction.settings SET max_running = 5")
    assert scalar(conn, HIGH_WATER) == 5


def test_a_slot_being_taken_above_keeps_the_high_water(conn: Conn, dsn: str) -> None:
    """A claim that read the higher max_running and is taking a slot above the new one
    holds that slot's lock until it commits: the claim that would lower the mark sees the
    lock and leaves the mark where it is, so the claims after it keep counting that slot."""
    conn.execute("UPDATE compaction.settings SET max_running = 1")
    assert scalar(conn, HIGH_WATER) == 8
    taker = connect_as(dsn)
    try:
        taker.execute("BEGIN")
        taker.execute("SELECT * FROM compaction.admission WHERE slot = 3 FOR UPDATE")
        assert claim(conn, "c1", target(conn, "c1"), now=None).claimed
        assert scalar(conn, HIGH_WATER) == 8
    finally:
        taker.execute("ROLLBACK")
        taker.close()
    # released without taking it: the next claim lowers the mark (and is refused: c1 runs)
    assert claim(conn, "c2", target(conn, "c2"), now=None).reason == "admission_full"
    assert scalar(conn, HIGH_WATER) == 1


def test_taking_renewing_and_freeing_a_slot_write_no_index_entry(conn: Conn) -> None:
    """The admission slots' only index is on slot, which no update changes,
    so a claim's, a heartbeat's and a completion's slot updates are all HOT."""
    relid = scalar(conn, "SELECT 'compaction.admission'::regclass::oid")
    t = target(conn, "c1")
    conn.execute("BEGIN")
    c = claim(conn, "c1", t, now=None)
    assert c.claimed
    assert c.job_id is not None
    assert db.heartbeat(conn, c.job_id, 1, conversation_id="c1").ok
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, conversation_id="c1").ok
    counts = conn.execute(
        "SELECT pg_catalog.pg_stat_get_xact_tuples_updated(%s),"
        " pg_catalog.pg_stat_get_xact_tuples_hot_updated(%s)", (relid, relid)).fetchone()
    conn.execute("COMMIT")
    assert counts == (3, 3)
