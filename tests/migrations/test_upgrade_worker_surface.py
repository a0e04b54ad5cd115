"""Upgrading a populated 0006 database to 0007_worker_surface (issue 12).

At 0006 a database holds three running attempts (one with an expired lease) under
`max_running = 2` (the limit was lowered after they were admitted), a completed and a
failed attempt with a free-text reason (allowed then), and an erasure tombstone with a
free-text reason. After the upgrade the running attempts hold admission slots with their
leases, admission counts the live ones left above the limit, the old rows are kept as
they were (the new checks are NOT VALID: history is append-only), every audit
view reads, and downgrading restores one admission row per running attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from pycompactor import schema
from tests.history import History
from tests.recompute import pairs_of, ranges_of, read_reference

Conn = psycopg.Connection[Any]
V3 = "conversation-compaction@3"


def claim(conn: Conn, conversation_id: str, lease: str = "5 minutes",
          now_offset: str = "0 seconds") -> tuple[bool, str, int | None]:
    ids, digest = ranges_of(pairs_of(read_reference(conn, [conversation_id]),
                                     conversation_id))[0]
    row = conn.execute(
        "SELECT claimed, reason, job_id FROM compaction.claim(%s, 'default', 0, %s, %s,"
        " 'test-model', %s, 'w', p_lease => %s::interval,"
        " p_now => now() - %s::interval)",
        (conversation_id, ids, digest, V3, lease, now_offset)).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def held(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT slot, holder_conversation_id, holder_attempt"
                        " FROM compaction.admission WHERE holder_conversation_id IS NOT NULL"
                        " ORDER BY slot").fetchall()


def test_upgrade_from_0006_keeps_running_attempts_and_history(
        new_database: Callable[..., str]) -> None:
    dsn = new_database()
    schema.upgrade(dsn, "0006_queue_leases")
    with psycopg.connect(dsn, autocommit=True) as conn:
        history = History(conn)
        for c in ("a", "b", "c", "d", "e", "f", "g"):
            history.pairs(c, 30)
        # a done, b failed with free text (0006 allowed it), c expired, d and e live
        done = claim(conn, "a")
        assert conn.execute("SELECT ok FROM compaction.complete(%s, 1, 'A summary.', 'stop', 0)",
                            (done[2],)).fetchone() == (True,)
        failed = claim(conn, "b")
        assert conn.execute("SELECT ok FROM compaction.fail(%s, 1, 'Model said: no way')",
                            (failed[2],)).fetchone() == (True,)
        assert claim(conn, "c", now_offset="10 minutes")[0]
        for c in ("d", "e", "f"):
            assert claim(conn, c)[0]
        conn.execute("UPDATE compaction.settings SET max_running = 2")
        conn.execute("SELECT compaction.erase_conversation('a', 'GDPR request #12')")
        running = conn.execute("SELECT conversation_id, lease_expires_at FROM compaction.attempts"
                               " WHERE state = 'running' ORDER BY 1").fetchall()
        events = conn.execute("SELECT * FROM compaction.audit_events ORDER BY event_id").fetchall()

    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # every running attempt holds a slot with its own lease, the expired one included
        slots = conn.execute("SELECT holder_conversation_id, lease_expires_at"
                             " FROM compaction.admission WHERE holder_conversation_id IS NOT NULL"
                             " ORDER BY 1").fetchall()
        assert slots == running
        assert conn.execute("SELECT * FROM compaction.audit_events"
                            " ORDER BY event_id").fetchall() == events
        for view in ("audit_jobs", "audit_stale_summaries", "audit_exhausted", "audit_events",
                     "audit_queue"):
            conn.execute(f"SELECT v::text FROM compaction.{view} AS v").fetchall()
        # three live attempts, limit two: g waits until two of them end
        assert claim(conn, "g")[1] == "admission_full"
        for c in ("d", "e"):
            job = conn.execute("SELECT job_id FROM compaction.jobs WHERE conversation_id = %s",
                               (c,)).fetchone()
            assert job is not None
            assert conn.execute("SELECT ok FROM compaction.fail(%s, 1, 'timeout', NULL, %s)",
                                (job[0], c)).fetchone() == (True,)
        # c's lease ran out (it does not count: g takes its slot over), f is live above
        # the limit: one of two
        assert claim(conn, "g")[:2] == (True, "claimed")
        assert held(conn) == [(1, "g", 1), (4, "f", 1)]
        assert conn.execute("SELECT count(*) FROM compaction.admission"
                            " WHERE lease_expires_at > now()").fetchone() == (2,)
        assert claim(conn, "b")[1] == "admission_full"

    schema.downgrade(dsn, "0006_queue_leases")
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT conversation_id FROM compaction.admission"
                            " ORDER BY 1").fetchall()
        assert rows == [("f",), ("g",)]
        # 0006's claim counts them again: c expired, f and g live, limit two
        assert claim(conn, "b")[1] == "admission_full"
