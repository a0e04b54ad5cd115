"""The leased work queue: dequeue leases, ack removes, release gives back, leases expire.

Real connections throughout. Interleavings are forced with explicit transactions and
row locks, and a blocked call is observed through pg_locks (a condition, not a sleep).
Lease expiry uses the real server clock with the shortest lease (1 second).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pycompactor import db, errors
from pycompactor.models import AckResult, QueuedConversation
from tests.history import History
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.engine import LEASE, T0, claim, scalar, target, wait_until_blocked
from tests.workerkit import wait_for

Conn = psycopg.Connection[Any]
SHORT = timedelta(seconds=1)


@pytest.fixture
def tx(dsn: str) -> Iterator[Conn]:
    """A second connection in explicit-transaction mode (not autocommit)."""
    with psycopg.connect(dsn) as connection:
        yield connection


def queue(conn: Conn) -> list[tuple[Any, ...]]:
    """(conversation, scope, leased?, requeued?) of every entry, in queue order."""
    return conn.execute(
        "SELECT conversation_id, scope, lease_token IS NOT NULL, requeued_at IS NOT NULL"
        " FROM compaction.queue ORDER BY scope, enqueued_at, conversation_id").fetchall()


def fresh(conn: Conn, *conversation_ids: str, scope: str = "default") -> None:
    """An empty queue, then the given entries enqueued in this order (distinct times)."""
    conn.execute("DELETE FROM compaction.queue")
    for conversation_id in conversation_ids:
        db.enqueue(conn, conversation_id, scope)  # autocommit: each its own now()


def expire(conn: Conn, entries: list[QueuedConversation]) -> None:
    """Wait on the server clock until every lease has run out."""
    latest = max(e.lease_expires_at for e in entries)
    wait_for(lambda: scalar(conn, "SELECT now() > %s", (latest,)), timeout=10,
             what="the leases to run out")


def test_dequeue_leases_oldest_first_and_ack_removes(conn: Conn) -> None:
    fresh(conn, "c1", "c2", "c3")
    first = db.dequeue(conn, 2)
    assert [e.conversation_id for e in first] == ["c1", "c2"]
    assert all(e.lease_expires_at - e.enqueued_at > LEASE - timedelta(seconds=5) for e in first)
    assert len({e.lease_token for e in first}) == 2
    # leased entries stay in the table, hidden from the next dequeue
    assert queue(conn) == [("c1", "default", True, False), ("c2", "default", True, False),
                           ("c3", "default", False, False)]
    [third] = db.dequeue(conn, 10)
    assert third.conversation_id == "c3"
    assert db.dequeue(conn, 10) == []
    for entry in (*first, third):
        assert db.ack(conn, entry) == AckResult(True, "acknowledged")
    assert queue(conn) == []
    # acknowledging twice: the entry is gone, the token names nothing
    assert db.ack(conn, third) == AckResult(False, "lease_lost")


def test_expired_leases_come_back_in_their_original_order(conn: Conn) -> None:
    fresh(conn, "c1", "c2", "c3", "c4")
    held = db.dequeue(conn, 3, lease=SHORT)  # a worker takes c1..c3 and dies
    assert [e.conversation_id for e in held] == ["c1", "c2", "c3"]
    db.enqueue(conn, "c5")
    [c4] = db.dequeue(conn, 1)
    assert c4.conversation_id == "c4"
    expire(conn, held)
    # no reaper ran: the next dequeue sees them again, before c5, oldest first
    again = db.dequeue(conn, 10)
    assert [e.conversation_id for e in again] == ["c1", "c2", "c3", "c5"]
    assert [e.enqueued_at for e in again[:3]] == [e.enqueued_at for e in held]
    assert {e.lease_token for e in again}.isdisjoint({e.lease_token for e in held})
    # the dead worker's tokens are void: neither ack nor release touches the new leases
    for old in held:
        assert db.ack(conn, old) == AckResult(False, "lease_lost")
        assert db.release(conn, old) == AckResult(False, "lease_lost")
    assert [r[2] for r in queue(conn)] == [True] * 5


def test_a_late_ack_of_an_expired_lease_still_counts_if_nobody_took_the_entry(
        conn: Conn) -> None:
    fresh(conn, "c1")
    [entry] = db.dequeue(conn, 1, lease=SHORT)
    expire(conn, [entry])
    assert db.ack(conn, entry) == AckResult(True, "acknowledged")
    assert queue(conn) == []


def test_release_gives_an_entry_back_in_its_original_place(conn: Conn) -> None:
    fresh(conn, "c1", "c2")
    [c1] = db.dequeue(conn, 1)
    db.enqueue(conn, "c3")
    assert db.release(conn, c1) == AckResult(True, "released")
    assert db.release(conn, c1) == AckResult(False, "lease_lost")
    assert [e.conversation_id for e in db.dequeue(conn, 10)] == ["c1", "c2", "c3"]


def test_an_enqueue_during_the_lease_survives_the_ack(conn: Conn) -> None:
    fresh(conn, "c1", "c2")
    [c1] = db.dequeue(conn, 1)
    db.enqueue(conn, "c1")  # new history while a worker examines c1
    db.enqueue(conn, "c1")  # again: still one entry, still requeued
    requeued_at = scalar(conn, "SELECT requeued_at FROM compaction.queue"
                               " WHERE conversation_id = 'c1'")
    assert db.ack(conn, c1) == AckResult(True, "requeued")
    # it waits again, from the moment the new history arrived (behind c2)
    assert queue(conn) == [("c2", "default", False, False), ("c1", "default", False, False)]
    assert scalar(conn, "SELECT enqueued_at FROM compaction.queue"
                        " WHERE conversation_id = 'c1'") == requeued_at
    assert db.ack(conn, c1) == AckResult(False, "lease_lost")
    assert [e.conversation_id for e in db.dequeue(conn, 10)] == ["c2", "c1"]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
@pytest.mark.parametrize("writer", ["enqueue", "source_trigger"])
def test_an_uncommitted_enqueue_during_the_lease_holds_the_ack(
        conn: Conn, tx: Conn, dsn: str, writer: str, outcome: str) -> None:
    """Two connections: the writer enqueues (or writes history, whose trigger enqueues)
    inside an open transaction while the worker's entry is leased; the worker's ack
    waits for it; committed, the newer enqueue wins; rolled back, the ack removes."""
    History(conn).pairs("c1", 3)
    fresh(conn, "c1")
    with psycopg.connect(dsn, autocommit=True) as worker:
        [entry] = db.dequeue(worker, 1)
        if writer == "enqueue":
            db.enqueue(tx, "c1")
        else:
            History(tx).pairs("c1", 1)
        answers: list[AckResult] = []
        acker = threading.Thread(target=lambda: answers.append(db.ack(worker, entry)))
        acker.start()
        wait_until_blocked(conn, worker.info.backend_pid)  # the barrier: ack waits
        assert answers == []
        if outcome == "commit":
            tx.commit()
        else:
            tx.rollback()
        acker.join(30)
    if outcome == "commit":
        assert answers == [AckResult(True, "requeued")]
        assert queue(conn) == [("c1", "default", False, False)]
    else:
        assert answers == [AckResult(True, "acknowledged")]
        assert queue(conn) == []


def test_dequeue_skips_an_entry_a_writer_is_enqueueing(conn: Conn, tx: Conn,
                                                       dsn: str) -> None:
    """A writer's open transaction holds its entry: the dequeue does not wait for it,
    nor lease history it cannot see; once committed, the entry is taken."""
    History(conn).pairs("c1", 3)
    fresh(conn, "c1", "c2")
    History(tx).pairs("c1", 1)  # the trigger locks c1's entry until tx ends
    with psycopg.connect(dsn, autocommit=True) as worker:
        assert [e.conversation_id for e in db.dequeue(worker, 10)] == ["c2"]
        tx.commit()
        assert [e.conversation_id for e in db.dequeue(worker, 10)] == ["c1"]


def test_concurrent_dequeues_get_disjoint_entries(conn: Conn, dsn: str) -> None:
    """8 connections dequeue at once (a barrier): every entry leased exactly once."""
    ids = [f"c{i:02d}" for i in range(40)]
    conn.execute("DELETE FROM compaction.queue")
    conn.execute("INSERT INTO compaction.queue (conversation_id, scope, enqueued_at)"
                 " SELECT c, 'default', now() - (40 - ordinality) * interval '1 second'"
                 " FROM unnest(%s::text[]) WITH ORDINALITY AS u(c, ordinality)", (ids,))
    start = threading.Barrier(8)
    taken: list[list[QueuedConversation]] = [[] for _ in range(8)]

    def work(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            start.wait()
            while batch := db.dequeue(c, 3):
                taken[i].extend(batch)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = [e.conversation_id for batch in taken for e in batch]
    assert sorted(got) == ids
    assert scalar(conn, "SELECT count(*) FROM compaction.queue WHERE lease_token IS NULL") == 0


def test_each_scope_keeps_its_own_entries(conn: Conn) -> None:
    """A worker for one scope never touches another scope's entries."""
    fresh(conn, "c1", "c2")
    db.enqueue(conn, "c1", "support")
    before = conn.execute("SELECT * FROM compaction.queue WHERE scope = 'default'"
                          " ORDER BY conversation_id").fetchall()
    [support] = db.dequeue(conn, 10, scope="support")
    assert (support.conversation_id, support.scope) == ("c1", "support")
    assert db.dequeue(conn, 10, scope="support") == []
    assert db.ack(conn, support).reason == "acknowledged"
    assert db.dequeue(conn, 10, scope="nobody") == []
    assert conn.execute("SELECT * FROM compaction.queue WHERE scope = 'default'"
                        " ORDER BY conversation_id").fetchall() == before
    # source writes enqueue the default scope only
    History(conn).pairs("c9", 1)
    assert db.dequeue(conn, 10, scope="support") == []
    assert [e.conversation_id for e in db.dequeue(conn, 10)] == ["c1", "c2", "c9"]


def test_reap_marks_a_leased_entry_requeued(conn: Conn) -> None:
    """A worker examined c1 (already_running) just before the reaper expired the running
    attempt: the reaper's re-queue survives that worker's ack, so attempt 2 happens."""
    t = target(conn, "c1")
    assert claim(conn, "c1", t).claimed
    [entry] = db.dequeue(conn, 1)
    assert db.reap(conn, now=T0 + LEASE) == 1
    assert db.ack(conn, entry) == AckResult(True, "requeued")
    [again] = db.dequeue(conn, 1)
    assert again.conversation_id == "c1"
    assert claim(conn, "c1", t, now=T0 + LEASE).attempt == 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lease": timedelta(milliseconds=999)}, "lease between 1 second and 1 day"),
    ({"lease": timedelta(days=1, seconds=1)}, "lease between 1 second and 1 day"),
    ({"scope": ""}, "non-empty scope"),
])
def test_dequeue_refuses_bad_arguments(conn: Conn, kwargs: dict[str, Any],
                                       message: str) -> None:
    fresh(conn, "c1")
    with pytest.raises(errors.InvalidArgument, match=message):
        db.dequeue(conn, 10, **kwargs)
    for limit in (0, 1001):
        with pytest.raises(errors.InvalidArgument, match="limit between 1 and 1000"):
            db.dequeue(conn, limit)
    assert queue(conn) == [("c1", "default", False, False)]
    # the bounds themselves are accepted
    for lease in (timedelta(seconds=1), timedelta(days=1)):
        [entry] = db.dequeue(conn, 1, lease=lease)
        assert db.release(conn, entry).ok


def test_audit_queue_per_scope(conn: Conn, login_role: LoginRole) -> None:
    fresh(conn, "c1", "c2", "c3")
    db.enqueue(conn, "c1", "support")
    held = db.dequeue(conn, 1, lease=SHORT)
    db.dequeue(conn, 1)
    conn.execute("UPDATE compaction.queue SET enqueued_at = now() - interval '1 hour'"
                 " WHERE conversation_id = 'c3' AND scope = 'default'")
    expire(conn, held)
    with connect_as(login_role("compaction_auditor")) as auditor:
        report = db.audit(auditor, "queue")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            auditor.execute("SELECT * FROM compaction.queue")
    assert report.columns == ["scope", "queued", "leased", "expired_leases",
                              "oldest_queued_at", "oldest_queued_age"]
    rows = {r["scope"]: r for r in report.rows}
    assert [r["scope"] for r in report.rows] == ["default", "support"]
    # default: c1 (lease expired) and c3 waiting, c2 leased
    assert (rows["default"]["queued"], rows["default"]["leased"],
            rows["default"]["expired_leases"]) == (2, 1, 1)
    assert timedelta(minutes=59) < rows["default"]["oldest_queued_age"] < timedelta(hours=2)
    assert (rows["support"]["queued"], rows["support"]["leased"],
            rows["support"]["expired_leases"]) == (1, 0, 0)
    assert rows["support"]["oldest_queued_age"] < timedelta(minutes=5)
    with pytest.raises(ValueError, match="per scope"):
        db.audit(conn, "queue", conversation_id="c1")


def test_worker_role_leases_and_acknowledges_but_cannot_read_the_queue(
        conn: Conn, login_role: LoginRole) -> None:
    fresh(conn, "c1", "c2")
    with connect_as(login_role("compaction_worker")) as worker:
        c1, c2 = db.dequeue(worker, 2)
        assert db.ack(worker, c1).reason == "acknowledged"
        assert db.release(worker, c2).reason == "released"
        for statement in ("SELECT * FROM compaction.queue",
                          "SELECT * FROM compaction.audit_queue",
                          "UPDATE compaction.queue SET leased_until = NULL"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                worker.execute(statement)
    with connect_as(login_role("compaction_reader")) as reader:
        for call in ("SELECT * FROM compaction.dequeue()",
                     "SELECT * FROM compaction.ack('c2', 'default', gen_random_uuid())"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                reader.execute(call)
