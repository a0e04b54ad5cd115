"""Serialization failures reach the caller as the package's error, with their SQLSTATE.

Under SERIALIZABLE the server may refuse a transaction at its commit, after every
statement in it succeeded; for a driver call that commit happens at the Sync that ends
its pipeline, and the server answers that Sync with the error and then ReadyForQuery.
How psycopg's pipeline reads those two answers depends on timing: whether they are in
before it polls after sending the Sync, which heavy load makes happen now and then (the
thread descheduled in between) and which once raised a bare `IndexError: pop from an
empty deque` from psycopg. The storm below makes that interleaving the rule.
"""

from __future__ import annotations

import select
import threading
from collections import Counter
from collections.abc import Iterator
from types import FrameType
from typing import Any

import psycopg
import pytest
from psycopg import pq
from psycopg._pipeline_base import BasePipeline

from pycompactor import db
from pycompactor.errors import PycompactorError, TransactionConflict, wrap_exceptions
from pycompactor.models import Target
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.engine import claim, scalar, target

Conn = psycopg.Connection[Any]


_EXIT_GEN = BasePipeline._exit_gen.__code__


@pytest.fixture
def answer_before_poll() -> Iterator[None]:
    """In threads started from now on, a pipeline that has just sent its closing Sync
    waits until the server's answer is readable before psycopg polls for it: the
    interleaving that heavy load produces now and then (the thread is descheduled
    between the two), made the rule. A profile hook sees the moment: psycopg's
    `_exit_gen` yields (a profile "return") with its command queue emptied, the Sync
    sent. It waits on the socket (select), never sleeps, once per pipeline."""
    waited: set[int] = set()

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event != "return" or frame.f_code is not _EXIT_GEN:
            return
        pipeline = frame.f_locals.get("self")
        if (not isinstance(pipeline, BasePipeline) or pipeline.command_queue
                or id(pipeline) in waited):
            return
        waited.add(id(pipeline))
        select.select([pipeline.pgconn.socket], [], [], 5.0)

    threading.setprofile(hook)
    try:
        yield
    finally:
        threading.setprofile(None)


def at_commit(exc: BaseException) -> bool:
    """Whether the server refused the transaction at its commit, not at a statement."""
    cause = exc.__cause__
    detail = cause.diag.message_detail if isinstance(cause, psycopg.Error) else None
    return "commit attempt" in (detail or "")


def test_serializable_claims_in_parallel_raise_only_package_errors(
        conn: Conn, login_role: LoginRole, answer_before_poll: None) -> None:
    """16 connections under default_transaction_isolation = serializable claim and fail
    every target of their own conversation (11 each, two attempts), all at once through
    a barrier, retrying each refused call on the same connection. Every error is a
    TransactionConflict carrying SQLSTATE 40001, at a statement or at the commit, and
    leaves its connection idle, out of pipeline mode and taking the next call; nothing
    else escapes (never a bare IndexError or a psycopg error); every attempt is recorded
    exactly once."""
    n = 16
    conn.execute("UPDATE compaction.settings SET max_running = 1000")
    targets: dict[str, list[Target]] = {}
    for i in range(n):
        target(conn, f"s{i}", 130)
        targets[f"s{i}"] = db.plan_targets(conn, f"s{i}")
    assert all(len(t) == 11 for t in targets.values())
    dsn = psycopg.conninfo.make_conninfo(
        login_role("compaction_worker"),
        options="-c default_transaction_isolation=serializable")
    barrier = threading.Barrier(n)
    lock = threading.Lock()
    refused: Counter[tuple[str, str]] = Counter()
    escaped: list[BaseException] = []
    unusable: list[str] = []
    outcomes: Counter[str] = Counter()

    def refusal(c: Conn, exc: BaseException) -> None:
        with lock:
            if not isinstance(exc, TransactionConflict) or exc.sqlstate != "40001":
                escaped.append(exc)
                return
            refused[("commit" if at_commit(exc) else "statement", exc.sqlstate)] += 1
            if (c.info.transaction_status != pq.TransactionStatus.IDLE
                    or c.info.pipeline_status != pq.PipelineStatus.OFF):
                unusable.append(f"{c.info.transaction_status!r} {c.info.pipeline_status!r}")

    def run(conversation_id: str) -> None:
        with connect_as(dsn) as c:
            for t in targets[conversation_id]:
                for _ in (1, 2):
                    try:
                        barrier.wait()
                    except threading.BrokenBarrierError:
                        return  # another thread saw an escaped error
                    while True:
                        try:
                            result = claim(c, conversation_id, t, now=None)
                            break
                        except Exception as exc:
                            refusal(c, exc)
                            if escaped:
                                barrier.abort()
                                return
                    with lock:
                        outcomes[result.reason] += 1
                    assert result.job_id is not None
                    assert result.attempt is not None
                    while True:
                        try:
                            failed = db.fail(c, result.job_id, result.attempt, "test_reason",
                                             conversation_id=conversation_id)
                            break
                        except Exception as exc:
                            refusal(c, exc)
                            if escaped:
                                barrier.abort()
                                return
                    assert failed.ok

    threads = [threading.Thread(target=run, args=(c,)) for c in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert escaped == [], [f"{type(e).__name__}: {e}" for e in escaped]
    assert unusable == []
    assert outcomes == {"claimed": n * 11 * 2}
    # The storm did what it is for: refusals at statements and at commits.
    assert refused[("statement", "40001")] > 0, refused
    assert refused[("commit", "40001")] > 0, refused
    assert scalar(conn, "SELECT count(*) FROM compaction.attempts"
                        " WHERE state = 'failed' AND reason = 'test_reason'") == n * 11 * 2
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events"
                        " WHERE kind = 'claim'") == n * 11 * 2


def test_a_commit_refused_at_the_sync_is_a_transaction_conflict(dsn: str) -> None:
    """The package's error for a refused commit names the conflict and its SQLSTATE."""
    with db.connect(dsn) as c:
        c.execute("CREATE TABLE public.conflict_probe (k int)")
    with db.connect(dsn) as a, db.connect(dsn) as b:
        for session in (a, b):
            session.autocommit = False
            session.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        # Write skew: each reads what the other writes; the second commit is refused.
        a.execute("SELECT count(*) FROM public.conflict_probe WHERE k = 2")
        b.execute("SELECT count(*) FROM public.conflict_probe WHERE k = 1")
        a.execute("INSERT INTO public.conflict_probe VALUES (1)")
        b.execute("INSERT INTO public.conflict_probe VALUES (2)")
        a.commit()
        with pytest.raises(PycompactorError) as info, wrap_exceptions():
            b.commit()
        assert isinstance(info.value, TransactionConflict)
        assert info.value.sqlstate == "40001"
        assert "SQLSTATE 40001" in str(info.value)
