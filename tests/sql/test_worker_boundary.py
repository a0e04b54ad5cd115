"""What a worker login can reach, and what a login without engine grants can (contract §6, §10).

An attempt belongs to the login that claimed it: another worker login that knows
`(job_id, attempt)` is refused `lease_lost` and changes nothing. A login with no engine
grant cannot stall a conversation's writers or make reap pass it over (they serialise
on a row only the owner can lock, no longer on an advisory key anyone can take). And
the arguments a worker chooses are bounded with a `CP020` that names the limit.
Every test uses separate LOGIN roles on their own connections.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from pycompactor import db, errors
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.engine import GOOD, LEASE, T0, claim, scalar, target

Conn = psycopg.Connection[Any]
LOCK_CLASS = 1129316352


def login_of(dsn: str) -> str:
    user = psycopg.conninfo.conninfo_to_dict(dsn)["user"]
    assert isinstance(user, str)
    return user


def state(conn: Conn) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    return tuple(conn.execute(query).fetchall() for query in (
        "SELECT * FROM compaction.jobs ORDER BY job_id",
        "SELECT * FROM compaction.attempts ORDER BY job_id, attempt",
        "SELECT * FROM compaction.job_summaries ORDER BY summary_id",
        "SELECT event_id, kind, reason FROM compaction.audit_events ORDER BY recorded_at, event_id",
        "SELECT * FROM compaction.admission WHERE holder_conversation_id IS NOT NULL",
    ))


@dataclass
class TwoWorkers:
    w1: Conn
    w2: Conn
    w1_login: str
    job_id: int


@pytest.fixture
def two_workers(conn: Conn, login_role: LoginRole) -> Iterator[TwoWorkers]:
    """Logins w1 and w2, both members of compaction_worker; w1 runs attempt 1 on c1."""
    t = target(conn, "c1")
    w1_dsn = login_role("compaction_worker")
    with connect_as(w1_dsn) as w1, connect_as(login_role("compaction_worker")) as w2:
        c = claim(w1, "c1", t, now=None)
        assert c.claimed
        assert c.job_id is not None
        yield TwoWorkers(w1, w2, login_of(w1_dsn), c.job_id)


def test_another_worker_login_cannot_complete_fail_or_renew(
        conn: Conn, two_workers: TwoWorkers) -> None:
    w2, job_id = two_workers.w2, two_workers.job_id
    before = state(conn)
    for conversation_id in (None, "c1"):
        forged = db.complete(w2, job_id, 1, "forged by w2", "stop", 0,
                             conversation_id=conversation_id)
        assert (forged.ok, forged.reason, forged.summary_id) == (False, "lease_lost", None)
        assert db.heartbeat(w2, job_id, 1, conversation_id=conversation_id).ok is False
        # twice, as it once took to exhaust the range w1 was working on
        for _ in range(2):
            failed = db.fail(w2, job_id, 1, "timeout", conversation_id=conversation_id)
            assert (failed.ok, failed.reason) == (False, "lease_lost")
    assert state(conn) == before

    # The claimer is unaffected, and the record names its login.
    w1 = two_workers.w1
    assert db.heartbeat(w1, job_id, 1, conversation_id="c1").ok
    done = db.complete(w1, job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (done.ok, done.reason) == (True, "completed")
    assert conn.execute("SELECT attempt, state, claimed_by FROM compaction.audit_jobs"
                        " WHERE job_id = %s", (job_id,)).fetchall() == [
        (1, "completed", two_workers.w1_login)]
    # The completion's idempotent re-send is the claimer's too.
    again = db.complete(w2, job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (again.ok, again.reason) == (False, "lease_lost")
    again = db.complete(w1, job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (again.ok, again.reason) == (True, "completed")


def test_already_running_names_a_job_only_its_claimer_can_finish(
        conn: Conn, two_workers: TwoWorkers) -> None:
    """The job id a refusal hands out is no secret: it finishes nothing."""
    t = db.plan_targets(conn, "c1")[0]
    refused = claim(two_workers.w2, "c1", t, now=None)
    assert (refused.claimed, refused.reason, refused.job_id) == (
        False, "already_running", two_workers.job_id)
    before = state(conn)
    forged = db.complete(two_workers.w2, two_workers.job_id, 1, "forged", "stop", 0)
    assert forged.reason == "lease_lost"
    assert state(conn) == before


def test_the_owner_and_superusers_may_finish_any_attempt(
        conn: Conn, login_role: LoginRole, two_workers: TwoWorkers) -> None:
    with connect_as(login_role("compaction_owner")) as owner:
        assert db.heartbeat(owner, two_workers.job_id, 1, conversation_id="c1").ok
    # conn is the superuser
    done = db.complete(conn, two_workers.job_id, 1, GOOD, "stop", 0, conversation_id="c1")
    assert (done.ok, done.reason) == (True, "completed")


def test_an_attempt_from_before_logins_were_recorded_is_the_owners(
        conn: Conn, login_role: LoginRole, two_workers: TwoWorkers) -> None:
    """An attempt with no claiming login recorded (claimed_by NULL, as for one running
    before logins were recorded) is the owner's: a worker's heartbeat is refused."""
    # The claiming login never changes: only with its guard disabled.
    with pytest.raises(errors.AppendOnly), errors.wrap_exceptions():
        conn.execute("UPDATE compaction.attempts SET claimed_by = NULL")
    conn.execute("ALTER TABLE compaction.attempts DISABLE TRIGGER attempts_guard")
    conn.execute("UPDATE compaction.attempts SET claimed_by = NULL")
    conn.execute("ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_guard")
    assert db.heartbeat(two_workers.w1, two_workers.job_id, 1).ok is False
    assert db.heartbeat(conn, two_workers.job_id, 1).ok


def outsider_holds_the_old_key(outsider: Conn, conversation_id: str) -> None:
    """An advisory key the engine could serialise a conversation on:
    anyone can compute it, and pg_advisory_xact_lock needs no grant."""
    outsider.execute(
        "SELECT pg_advisory_xact_lock(%s, CASE WHEN hashtext(%s) BETWEEN 0 AND 15"
        " THEN -1 - hashtext(%s) ELSE hashtext(%s) END)",
        (LOCK_CLASS, conversation_id, conversation_id, conversation_id))


def test_a_login_without_engine_grants_cannot_stall_a_conversation(
        conn: Conn, dsn: str, login_role: LoginRole) -> None:
    t1 = target(conn, "c1")
    t2 = target(conn, "c2")
    # An attempt on c2 whose lease has run out, for reap.
    expired = claim(conn, "c2", t2, now=T0)
    assert expired.claimed
    outsider_dsn = login_role(None)
    with psycopg.connect(outsider_dsn) as outsider, \
            connect_as(login_role("compaction_worker")) as worker:
        # Within one open transaction, everything it may try (a refused statement would
        # abort the transaction, so those come after the locks it can take).
        for conversation_id in ("c1", "c2"):
            outsider_holds_the_old_key(outsider, conversation_id)
        # The engine's lock never waits on the outsider; without this a wait would fail
        # the test after 2 s instead of hanging it.
        worker.execute("SET lock_timeout = '2s'")
        c = claim(worker, "c1", t1, now=None)
        assert c.claimed
        assert c.job_id is not None
        assert db.heartbeat(worker, c.job_id, 1, conversation_id="c1").ok
        assert db.complete(worker, c.job_id, 1, GOOD, "stop", 0, conversation_id="c1").ok
        # reap does not pass over c2 (a superuser's clock: the lease ran out at T0 + LEASE)
        conn.execute("SET lock_timeout = '2s'")
        assert db.reap(conn, now=T0 + LEASE) == 1
        assert scalar(conn, "SELECT state FROM compaction.attempts"
                            " WHERE conversation_id = 'c2'") == "failed"
        # The rows the engine locks instead are out of the outsider's reach.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            outsider.execute("SELECT 1 FROM compaction.conversation_locks"
                             " WHERE conversation_id = 'c1' FOR UPDATE")
        outsider.rollback()
        for statement in ("LOCK TABLE compaction.conversation_locks",
                          "SELECT compaction.lock_conversation('c1')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                outsider.execute(statement)
            outsider.rollback()


def test_no_role_but_the_owner_holds_a_privilege_on_the_lock_rows(conn: Conn) -> None:
    grantees = conn.execute(
        "SELECT DISTINCT pg_get_userbyid(a.grantee) FROM pg_class AS c,"
        " aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) AS a"
        " WHERE c.oid = 'compaction.conversation_locks'::regclass").fetchall()
    assert grantees == [("compaction_owner",)]


def test_dequeue_takes_at_most_a_thousand_entries(conn: Conn, login_role: LoginRole) -> None:
    for i in range(3):
        db.enqueue(conn, f"q{i}")
    with connect_as(login_role("compaction_worker")) as worker:
        with pytest.raises(errors.EngineError, match="between 1 and 1000") as info:
            db.dequeue(worker, 2147483647, lease=LEASE * 288)
        assert info.value.sqlstate == "CP020"
        assert scalar(conn, "SELECT count(*) FROM compaction.queue"
                            " WHERE lease_token IS NOT NULL") == 0
        assert len(db.dequeue(worker, 1000)) == 3


@pytest.mark.parametrize(("argument", "limit"), [
    ("conversation_id", 1024), ("scope", 1024), ("model", 256), ("worker", 256)])
def test_claim_bounds_its_identifiers(conn: Conn, login_role: LoginRole, argument: str,
                                      limit: int) -> None:
    t = target(conn, "c1")
    # bytes, not characters: two bytes each in UTF-8
    too_long = "é" * (limit // 2 + 1)
    assert len(too_long.encode()) == limit + 2
    with connect_as(login_role("compaction_worker")) as worker:
        kwargs: dict[str, Any] = {"now": None}
        conversation_id = too_long if argument == "conversation_id" else "c1"
        if argument != "conversation_id":
            kwargs[argument] = too_long
        with pytest.raises(errors.EngineError, match=f"at most {limit} bytes") as info:
            claim(worker, conversation_id, t, **kwargs)
        assert info.value.sqlstate == "CP020"
        assert scalar(conn, "SELECT count(*) FROM compaction.attempts") == 0
        # at the limit, a claim is judged as usual
        kwargs = {"now": None}
        if argument != "conversation_id":
            kwargs[argument] = "x" * limit
        expected = "not_eligible" if argument == "conversation_id" else "claimed"
        at_limit = claim(worker, "x" * limit if argument == "conversation_id" else "c1", t,
                         **kwargs)
        assert at_limit.reason == expected


def test_enqueue_bounds_the_conversation_id_and_scope(conn: Conn,
                                                      login_role: LoginRole) -> None:
    with connect_as(login_role("compaction_worker")) as worker:
        for conversation_id, scope, limit in (("x" * 10_000, "default", 1024),
                                              ("c1", "s" * 1025, 1024)):
            with pytest.raises(errors.EngineError, match=f"at most {limit} bytes") as info:
                db.enqueue(worker, conversation_id, scope)
            assert info.value.sqlstate == "CP020"
        db.enqueue(worker, "x" * 1024, "s" * 1024)
    assert scalar(conn, "SELECT count(*) FROM compaction.queue") == 1


def test_import_bounds_the_conversation_id(conn: Conn) -> None:
    t = target(conn, "c1")
    with pytest.raises(errors.EngineError, match="at most 1024 bytes") as info:
        db.import_summary(conn, "x" * 10_000, "default", 0, t.source_message_ids,
                          t.source_hash, "m", "conversation-compaction@3", GOOD, T0)
    assert info.value.sqlstate == "CP020"


def test_identifiers_at_their_limits_fit_every_index_uncompressed(
        conn: Conn, login_role: LoginRole) -> None:
    """The limits leave room for the rest of each index entry even when nothing
    compresses (random hex: pglz gains nothing)."""
    def noise(n: int) -> str:
        return "".join(uuid.uuid4().hex for _ in range(n // 32 + 1))[:n]

    conversation_id, scope, model, worker_name = noise(1024), noise(1024), noise(256), \
        noise(256)
    t = target(conn, conversation_id)
    with connect_as(login_role("compaction_worker")) as worker:
        c = claim(worker, conversation_id, t, now=None, scope=scope, model=model,
                  worker=worker_name)
        assert c.claimed
        assert c.job_id is not None
        assert db.complete(worker, c.job_id, 1, GOOD, "stop", 0,
                           conversation_id=conversation_id).ok
        db.enqueue(worker, conversation_id, scope)
        [entry] = db.dequeue(worker, 10, scope=scope)
        assert db.ack(worker, entry).ok


def test_reap_writes_a_missing_lock_row_rather_than_pass_over(conn: Conn) -> None:
    """A conversation whose jobs came without a lock row (the owner's hand) is reaped."""
    t = target(conn, "c1")
    assert claim(conn, "c1", t, now=T0).claimed
    conn.execute("DELETE FROM compaction.conversation_locks")
    assert db.reap(conn, now=T0 + LEASE) == 1
    assert conn.execute("SELECT conversation_id FROM compaction.conversation_locks"
                        ).fetchall() == [("c1",)]
