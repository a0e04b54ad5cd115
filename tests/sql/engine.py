"""Helpers for the database-core tests: targets ready to claim, and claim shortcuts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg

from pycompactor import db
from pycompactor.models import ClaimResult, Target
from tests.history import History

V3 = "conversation-compaction@3"
MODEL = "test-model"
#: A fixed clock: every test passes p_now explicitly, so lease expiry needs no sleep.
T0 = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = timedelta(minutes=5)
GOOD = "A faithful summary of ten assistant replies."

Result = TypeVar("Result")


def target(conn: psycopg.Connection[Any], conversation_id: str, n_pairs: int = 30,
           from_pair: int = 0) -> Target:
    """Seed n_pairs pairs and return the target starting at from_pair."""
    History(conn).pairs(conversation_id, n_pairs)
    return next(t for t in db.plan_targets(conn, conversation_id) if t.from_pair == from_pair)


def claim(conn: psycopg.Connection[Any], conversation_id: str, t: Target, *,
          worker: str = "w1", now: datetime | None = T0, lease: timedelta = LEASE,
          scope: str = "default", model: str = MODEL,
          prompt_version: str = V3) -> ClaimResult:
    return db.claim(conn, conversation_id, scope, t.from_pair, t.source_message_ids,
                    t.source_hash, model, prompt_version, worker, lease=lease, now=now)


def scalar(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def wait_until_blocked(observer: psycopg.Connection[Any], pid: int) -> None:
    """Return once backend `pid` waits for a lock (polls pg_locks; fails after 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if observer.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s"
                            " AND NOT granted)", (pid,)).fetchone() == (True,):
            return
    raise AssertionError(f"backend {pid} never blocked")


def at_once(dsn: str, n: int,
            call: Callable[[psycopg.Connection[Any], int], Result]) -> list[Result]:
    """`call(connection, k)` on n connections of their own (autocommit), released together
    by a barrier once all are connected; the answers in k order. The first error is
    raised once every call has ended."""
    barrier = threading.Barrier(n)
    answers: dict[int, Result] = {}
    errors: list[BaseException] = []

    def send(k: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as own:
                barrier.wait()
                answers[k] = call(own, k)
        except BaseException as exc:  # raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [answers[k] for k in range(n)]


def function_calls(dsn: str, conversation_id: str, n_pairs: int, *,
                   now: datetime | None = T0) -> dict[str, int]:
    """Server-side function calls of one claim + complete (a fresh session: the xact stats
    view also shows this session's not yet flushed counts); `now=None` makes them as the
    worker does, without p_now."""
    with psycopg.connect(dsn) as tx:
        History(tx).pairs(conversation_id, n_pairs)
        tx.commit()
        t = db.plan_targets(tx, conversation_id)[0]
        tx.commit()
        tx.execute("SET LOCAL track_functions = 'all'")
        c = claim(tx, conversation_id, t, now=now)
        assert c.job_id is not None
        assert db.complete(tx, c.job_id, 1, GOOD, "stop", 0, now=now).ok
        calls: dict[str, int] = dict(tx.execute(
            "SELECT schemaname || '.' || funcname, calls::int FROM pg_stat_xact_user_functions"
        ).fetchall())
        tx.commit()
        return calls
