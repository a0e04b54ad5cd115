"""A lock held by a hung session costs a worker one lock_timeout, never a hang.

The "hung session" is a second connection that took a conversation's lock (the row of
compaction.lock_conversation, what every writer of that conversation takes first) and
then does nothing. The timeouts are transaction-local (set_config(..., true)), so they
also leave no session state behind (PgBouncer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.errors import LockTimeout, StatementCanceled
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from tests.e2e.cli import run_cli
from tests.workerkit import (
    attempts,
    events_named,
    run_worker_cli,
    seed,
    source_digest,
    summaries,
    worker_env,
)

Conn = psycopg.Connection[Any]


@pytest.fixture
def hung_session(dsn: str) -> Iterator[Conn]:
    """A connection that will hold locks in an open transaction until the test ends."""
    with psycopg.connect(dsn) as holder:  # autocommit off: the transaction stays open
        yield holder
        holder.rollback()


def hold_conversation_lock(holder: Conn, conversation_id: str) -> None:
    # The superuser may call the internal function: the very lock claim/complete take.
    holder.execute("SELECT compaction.lock_conversation(%s)", (conversation_id,))


def test_worker_gives_up_a_locked_conversation_and_moves_on(
        conn: Conn, dsn: str, hung_session: Conn) -> None:
    seed(conn, "conv-locked", 30)
    seed(conn, "conv-free", 30)
    before = source_digest(conn)
    hold_conversation_lock(hung_session, "conv-locked")

    started = time.monotonic()
    code, events, stderr = run_worker_cli(
        "--once", "--model", OFFLINE_MODEL, "--lock-timeout-seconds", "0.5",
        env=worker_env(dsn), timeout=60)
    elapsed = time.monotonic() - started
    assert code == 0, stderr
    [skipped] = events_named(events, "target_skipped")
    # The look and the claim are one call: the conversation is skipped whole, no range
    # named.
    assert (skipped["conversation_id"], skipped.get("from_pair"), skipped["outcome"],
            skipped["reason"]) == ("conv-locked", None, "skipped", "lock_timeout")
    assert "lock" in skipped["error"]
    # The other conversation was compacted in the same pass.
    assert [(c, f) for c, f, _ in summaries(conn)] == [("conv-free", 0)]
    assert [e["conversation_id"] for e in events_named(events, "completed")] == ["conv-free"]
    # Nothing half-written for the locked one: its claim rolled back whole; it is queued
    # again for a later pass.
    assert attempts(conn, "conv-locked") == []
    assert ("conv-locked",) in conn.execute(
        "SELECT conversation_id FROM compaction.queue").fetchall()
    assert elapsed < 30, f"the pass took {elapsed:.1f}s"
    # The text log names it just as clearly.
    line = [x for x in stderr.splitlines() if '"target_skipped"' in x]
    assert len(line) == 1

    # The hung session goes away: the next pass compacts the conversation it was blocking.
    hung_session.rollback()
    code, events, stderr = run_worker_cli("--once", "--model", OFFLINE_MODEL,
                                          env=worker_env(dsn))
    assert code == 0, stderr
    assert [(c, f) for c, f, _ in summaries(conn)] == [("conv-free", 0), ("conv-locked", 0)]
    assert not list(events_named(events, "target_skipped"))
    assert source_digest(conn) == before


def test_text_log_names_the_skipped_target(conn: Conn, dsn: str, hung_session: Conn) -> None:
    seed(conn, "conv-locked", 30)
    hold_conversation_lock(hung_session, "conv-locked")
    env = worker_env(dsn, PYCOMPACTOR_LOCK_TIMEOUT_SECONDS="0.3")  # the env fallback
    result = run_cli("worker", "--once", "--model", OFFLINE_MODEL, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    [line] = [x for x in result.stderr.splitlines() if " target_skipped " in x]
    assert "conversation_id=conv-locked" in line
    assert "reason=lock_timeout" in line
    assert "outcome=skipped" in line


def _claim(conn: Conn, conversation_id: str) -> Any:
    [target] = db.plan_targets(conn, conversation_id)
    return db.claim(conn, conversation_id, "default", target.from_pair,
                    target.source_message_ids, target.source_hash, "m", PROMPT_VERSION, "w")


def test_driver_maps_lock_and_statement_timeouts(conn: Conn, dsn: str,
                                                 hung_session: Conn) -> None:
    """lock_timeout -> LockTimeout; statement_timeout (shorter than the lock wait) ->
    StatementCanceled; both transaction-local: the session's settings stay untouched."""
    seed(conn, "conv-1", 30)
    hold_conversation_lock(hung_session, "conv-1")

    quick_lock = db.Timeouts(lock=timedelta(milliseconds=200), statement=timedelta(seconds=30))
    with db.connect(dsn, timeouts=quick_lock) as worker_conn:
        with pytest.raises(LockTimeout, match="lock"):
            _claim(worker_conn, "conv-1")
        assert worker_conn.execute("SHOW lock_timeout").fetchone() == ("0",)
        assert worker_conn.execute("SHOW statement_timeout").fetchone() == ("0",)

    quick_statement = db.Timeouts(lock=timedelta(seconds=30),
                                  statement=timedelta(milliseconds=200))
    with db.connect(dsn, timeouts=quick_statement) as worker_conn:
        with pytest.raises(StatementCanceled, match="statement timeout"):
            _claim(worker_conn, "conv-1")
        assert worker_conn.execute("SHOW statement_timeout").fetchone() == ("0",)
        # The connection is still usable: the failed call's transaction rolled back.
        hung_session.rollback()
        assert _claim(worker_conn, "conv-1").claimed
    assert len(attempts(conn, "conv-1")) == 1


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        db.Timeouts(lock=timedelta(0))
