"""Upgrading a populated 0025 database to 0026_hot_admission (issue 32).

At 0025, with max_running 2, attempts run on `a` and `b`, then max_running is lowered to
1. After the upgrade each running attempt knows the slot it holds (attempts.slot), the
high water covers both, so admission still counts the attempt above the new limit; a
renewal and a completion reach the slot by number; and the claim that finds the slots
above free brings the high water down. Downgrading with an attempt running and upgrading
again loses none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from pycompactor import db, schema
from tests.history import History
from tests.sql.engine import GOOD, claim

Conn = psycopg.Connection[Any]

HELD = ("SELECT slot, holder_conversation_id FROM compaction.admission"
        " WHERE holder_conversation_id IS NOT NULL ORDER BY slot")


def one(conn: Conn, query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def test_upgrade_from_0025_keeps_every_slot_and_its_count(
        new_database: Callable[..., str]) -> None:
    dsn = new_database()
    schema.upgrade(dsn, "0025_lean_pairs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        history = History(conn)
        for conversation_id in ("a", "b", "c", "d"):
            history.pairs(conversation_id, 30)
        conn.execute("UPDATE compaction.settings SET max_running = 2")
        running = {c: claim(conn, c, db.plan_targets(conn, c)[0], now=None) for c in "ab"}
        assert all(r.claimed for r in running.values())
        conn.execute("UPDATE compaction.settings SET max_running = 1")

        schema.upgrade(dsn)
        assert conn.execute("SELECT conversation_id, slot FROM compaction.attempts"
                            " ORDER BY 1").fetchall() == [("a", 1), ("b", 2)]
        assert conn.execute(HELD).fetchall() == [(1, "a"), (2, "b")]
        assert one(conn, "SELECT admission_high_water FROM compaction.settings") == 2
        assert one(conn, "SELECT reloptions FROM pg_class"
                         " WHERE oid = 'compaction.admission'::regclass") == ["fillfactor=50"]

        target_c = db.plan_targets(conn, "c")[0]
        assert claim(conn, "c", target_c, now=None).reason == "admission_full"
        a, b = running["a"], running["b"]
        assert a.job_id is not None
        assert b.job_id is not None
        renewed = db.heartbeat(conn, b.job_id, 1, conversation_id="b")
        assert renewed.ok
        assert one(conn, "SELECT lease_expires_at FROM compaction.admission WHERE slot = 2") \
            == renewed.lease_expires_at
        assert db.complete(conn, a.job_id, 1, GOOD, "stop", 0, conversation_id="a").ok
        assert conn.execute(HELD).fetchall() == [(2, "b")]
        # b still runs above the limit of one: nothing is admitted
        assert claim(conn, "c", target_c, now=None).reason == "admission_full"
        assert db.fail(conn, b.job_id, 1, "timeout", conversation_id="b").ok
        assert conn.execute(HELD).fetchall() == []
        claimed_c = claim(conn, "c", target_c, now=None)
        assert claimed_c.claimed
        assert claimed_c.job_id is not None
        assert one(conn, "SELECT admission_high_water FROM compaction.settings") == 1

    schema.downgrade(dsn, "0025_lean_pairs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(HELD).fetchall() == [(1, "c")]
        assert claim(conn, "d", db.plan_targets(conn, "d")[0],
                     now=None).reason == "admission_full"
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert one(conn, "SELECT slot FROM compaction.attempts"
                         " WHERE conversation_id = 'c'") == 1
        assert db.complete(conn, claimed_c.job_id, 1, GOOD, "stop", 0,
                           conversation_id="c").ok
        assert conn.execute(HELD).fetchall() == []
        assert claim(conn, "d", db.plan_targets(conn, "d")[0], now=None).claimed
