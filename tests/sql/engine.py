"""Helpers for the database-core tests: targets ready to claim, and claim shortcuts."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

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
