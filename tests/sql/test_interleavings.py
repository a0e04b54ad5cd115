"""Deterministic two-connection interleavings (fencing vs the reaper) and lock footprint.

Orders are forced with explicit transactions and row locks; a blocked call is observed
through pg_locks (a condition, not a sleep).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.models import ClaimResult, CompleteResult
from tests.history import History
from tests.sql.engine import (
    GOOD,
    LEASE,
    T0,
    claim,
    function_calls,
    scalar,
    target,
    wait_until_blocked,
)

Conn = psycopg.Connection[Any]


@pytest.fixture
def tx(dsn: str) -> Iterator[Conn]:
    """A second connection in explicit-transaction mode (not autocommit)."""
    with psycopg.connect(dsn) as connection:
        yield connection


class Background:
    """Runs one call on another thread and hands back its result."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = call()
            except BaseException as exc:  # handed to the test thread
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.result


def claimed(conn: Conn) -> ClaimResult:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.claimed
    assert c.job_id is not None
    return c


def assert_expired_once(conn: Conn) -> None:
    assert conn.execute("SELECT state, reason FROM compaction.attempts").fetchall() \
        == [("failed", "lease_expired")]
    assert scalar(conn, "SELECT count(*) FROM compaction.summaries") == 0
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events"
                        " WHERE kind = 'lease_expiry'") == 1


def test_reaper_first_then_stale_complete(conn: Conn, dsn: str) -> None:
    c = claimed(conn)
    assert c.job_id is not None
    job_id = c.job_id
    with psycopg.connect(dsn) as reaper:
        # the reaper expires the attempt and holds its transaction open
        assert db.reap(reaper, now=T0 + LEASE) == 1
        with psycopg.connect(dsn, autocommit=True) as worker:
            pid = worker.info.backend_pid
            # the worker's clock still says the lease is valid: only the fence stops it
            bg = Background(lambda: db.complete(worker, job_id, 1, GOOD, "stop", 0, now=T0))
            wait_until_blocked(conn, pid)
            reaper.commit()
            result: CompleteResult = bg.join()
    assert (result.ok, result.reason, result.summary_id) == (False, "lease_lost", None)
    assert_expired_once(conn)


def test_stale_complete_first_then_reaper(conn: Conn, dsn: str) -> None:
    c = claimed(conn)
    assert c.job_id is not None
    with psycopg.connect(dsn) as worker:
        result = db.complete(worker, c.job_id, 1, GOOD, "stop", 0, now=T0 + LEASE)
        assert (result.ok, result.reason) == (False, "lease_lost")
        # the stale complete holds the attempt's row: the reaper skips it, never blocks
        with psycopg.connect(dsn, autocommit=True) as reaper:
            assert db.reap(reaper, now=T0 + LEASE) == 0
            worker.commit()
            assert db.reap(reaper, now=T0 + LEASE * 10) == 0
    assert_expired_once(conn)


def test_valid_complete_in_flight_beats_reaper(conn: Conn, dsn: str) -> None:
    c = claimed(conn)
    assert c.job_id is not None
    with psycopg.connect(dsn) as worker:
        assert db.complete(worker, c.job_id, 1, GOOD, "stop", 0, now=T0).ok
        with psycopg.connect(dsn, autocommit=True) as reaper:
            assert db.reap(reaper, now=T0 + LEASE) == 0
            worker.commit()
            assert db.reap(reaper, now=T0 + LEASE) == 0
    assert conn.execute("SELECT state, reason FROM compaction.attempts").fetchall() \
        == [("completed", "completed")]


def test_heartbeat_and_reaper_serialise(conn: Conn, dsn: str) -> None:
    c = claimed(conn)
    assert c.job_id is not None
    job_id = c.job_id
    with psycopg.connect(dsn) as reaper:
        assert db.reap(reaper, now=T0 + LEASE) == 1
        with psycopg.connect(dsn, autocommit=True) as worker:
            bg = Background(lambda: db.heartbeat(worker, job_id, 1, now=T0 + LEASE / 2))
            wait_until_blocked(conn, worker.info.backend_pid)
            reaper.commit()
            beat = bg.join()
    assert beat.ok is False
    assert_expired_once(conn)


# --- lock footprint and statement bound --------------------------------------------------

def holds_conversation(observer: Conn, conversation_id: str) -> bool:
    """Whether another transaction holds the conversation's lock (a row
    lock, which pg_locks does not list while nobody waits for it; the first claim's
    row is not even visible yet): the engine's own lock call, given up at once."""
    try:
        with observer.transaction(force_rollback=True):
            observer.execute("SET LOCAL lock_timeout = '10ms'")
            observer.execute("SELECT compaction.lock_conversation(%s)", (conversation_id,))
    except psycopg.errors.LockNotAvailable:
        return True
    return False


def locks_of(conn: Conn, pid: int) -> list[tuple[str, str | None, int | None, int | None, str]]:
    return conn.execute(
        "SELECT locktype, relation::regclass::text, classid::oid::bigint, objid::oid::bigint,"
        " mode FROM pg_locks WHERE pid = %s AND granted ORDER BY 1, 2", (pid,)).fetchall()


def assert_narrow(locks: list[tuple[str, str | None, int | None, int | None, str]]) -> None:
    for locktype, relation, _classid, _objid, mode in locks:
        # No advisory lock: any login could take the same key.
        assert locktype != "advisory", (locktype, _classid, _objid)
        if locktype == "relation":
            # row-level work only (RowShareLock: foreign-key checks lock referenced rows
            # FOR KEY SHARE); never a table-wide Share/Exclusive lock
            assert mode in ("AccessShareLock", "RowShareLock", "RowExclusiveLock"), \
                (relation, mode)
        else:
            assert locktype in ("virtualxid", "transactionid"), locktype


def test_claim_complete_lock_footprint(conn: Conn, tx: Conn, dsn: str) -> None:
    t = target(conn, "c1")
    other = target(conn, "c2")
    # another conversation's engine rows are locked by a third session the whole time
    c2 = claim(conn, "c2", other)
    assert c2.job_id is not None
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT * FROM compaction.jobs WHERE conversation_id = 'c2' FOR UPDATE")
        blocker.execute("SELECT * FROM compaction.attempts WHERE conversation_id = 'c2'"
                        " FOR UPDATE")
        blocker.execute("SELECT * FROM compaction.admission"
                        " WHERE holder_conversation_id = 'c2' FOR UPDATE")
        tx.execute("SET LOCAL lock_timeout = '10s'")
        pid = tx.info.backend_pid
        c = claim(tx, "c1", t)
        assert c.claimed
        assert c.job_id is not None
        # admission is a row lock on one free slot: no global advisory key; the
        # conversation is held by its lock row, c2 (locked by nobody) is not
        assert_narrow(locks_of(conn, pid))
        assert holds_conversation(conn, "c1")
        assert not holds_conversation(conn, "c2")
        tx.commit()

        tx.execute("SET LOCAL lock_timeout = '10s'")
        done = db.complete(tx, c.job_id, 1, GOOD, "stop", 0, now=T0)
        assert done.ok
        # completion frees its slot by row: again only the conversation's row
        assert_narrow(locks_of(conn, pid))
        assert holds_conversation(conn, "c1")
        tx.commit()
        blocker.rollback()


def test_claim_complete_is_a_bounded_number_of_statements(conn: Conn, tx: Conn,
                                                          dsn: str) -> None:
    """Two client statements. Server-side, the same function calls whatever other
    conversations hold and however long this one is."""
    statements: list[str] = []

    class Counting(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            statements.append(str(query))
            return super().execute(query, params, **kwargs)

    before = function_calls(dsn, "before", 30)
    for i in range(5):
        nt = target(conn, f"noise-{i}")
        assert claim(conn, f"noise-{i}", nt).claimed
    after = function_calls(dsn, "after", 30)
    assert before == after
    assert before["compaction.claim"] == 1
    assert before["compaction.complete"] == 1
    # A 400-pair conversation costs the same calls: claim hashes only its own range, and
    # the per-message content test is inlined into one statement.
    assert function_calls(dsn, "big", 400) == before

    History(conn).pairs("counted", 30)
    t = db.plan_targets(conn, "counted")[0]
    tx.cursor_factory = Counting
    c = claim(tx, "counted", t)
    assert c.job_id is not None
    assert db.complete(tx, c.job_id, 1, GOOD, "stop", 0, now=T0).ok
    tx.commit()
    # Each call is preceded by its transaction-local lock and statement timeouts: the
    # claim's in its own query (inline: its values are ids and codes), the completion's
    # in the statement before it (bound: its summary never enters a statement's text).
    assert statements == [statements[0], db.TIMEOUTS_SQL, statements[2]]
    assert statements[0].startswith("SELECT pg_catalog.set_config('lock_timeout', '")
    assert "; SELECT claimed, reason, job_id" in statements[0]
    assert "compaction.claim(" in statements[0]
    assert "compaction.complete(" in statements[2]
    assert GOOD not in statements[2]
