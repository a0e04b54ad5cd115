"""One mixed history of attempts, replayed on a database, and every audit view's rows.

Shared by the upgrade tests that show a revision keeps every event and every audit answer
(0027_attempt_events, 0046_versions_known_without_lock): the history (completions,
failures, an exhausted identity, lease expiries found by reap and by a late completion, a
refused reply, a renewal, an import, an erasure, an attempt left running, a stale
summary), in two parts, and the views read in a comparable form.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from pycompactor import db, schema
from pycompactor.models import Target
from tests import history as history_module
from tests.history import History
from tests.sql.engine import GOOD, MODEL, T0, V3, claim

Conn = psycopg.Connection[Any]

VIEWS = {
    "audit_jobs": "conversation_id, job_id, attempt NULLS FIRST",
    "audit_exhausted": "conversation_id, job_id",
    "audit_stale_summaries": "conversation_id, summary_id",
    "audit_queue": "scope",
    "audit_events": "conversation_id, event_id",
}
#: Differ between two databases that replay the same history (see the module docstring;
#: the queue's entries, and an erasure's tombstone, are dated by the server's clock).
PER_DATABASE = {"recorded_at", "xact_id", "oldest_queued_at"}
ADDED_LATER = {"oldest_queued_age", "figures_invented"}


def views(conn: Conn, *, exact: bool) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        for view, order in VIEWS.items():
            cur.execute(f"SELECT * FROM compaction.{view} ORDER BY {order}")
            rows = cur.fetchall()
            # an age, measured from the reading's now(); and the columns later revisions
            # add (0048: figures_invented), which the older database lacks
            rows = [{k: v for k, v in r.items() if k not in ADDED_LATER} for r in rows]
            if not exact:
                # an erasure's tombstone is dated by the server's clock, too
                rows = [{k: v for k, v in r.items()
                         if k not in PER_DATABASE
                         and not (k == "occurred_at" and r.get("kind") == "erasure")}
                        for r in rows]
            out[view] = rows
        if not exact:
            # the log's order, event for event (ids are the same in both databases)
            cur.execute("SELECT event_id FROM compaction.audit_events"
                        " ORDER BY recorded_at, event_id")
            out["log_order"] = cur.fetchall()
    return out


def assert_same(left: dict[str, list[Any]], right: dict[str, list[Any]]) -> None:
    """Equal, view by view and row by row (a failure names the first row that differs)."""
    assert left.keys() == right.keys()
    for view in left:
        assert len(left[view]) == len(right[view]), view
        for row, (a, b) in enumerate(zip(left[view], right[view], strict=True)):
            assert a == b, (view, row)


def target(conn: Conn, conversation_id: str, from_pair: int = 0) -> Target:
    return next(t for t in db.plan_targets(conn, conversation_id) if t.from_pair == from_pair)


def replay_first(conn: Conn) -> None:
    """Every way an attempt starts and ends, an import and an erasure."""
    history_module._ids = itertools.count(1_000_000)
    history = History(conn)
    for conversation_id in "abcdefgh":
        history.pairs(conversation_id, 40)
    t = T0
    # a: completed, then its source changes (a stale summary)
    a = claim(conn, "a", target(conn, "a"), now=t)
    assert a.job_id is not None
    assert db.complete(conn, a.job_id, 1, GOOD, "stop", 0, now=t + timedelta(minutes=1),
                       stats={"input_tokens": 10, "output_tokens": 3}).ok
    conn.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                 " WHERE message_id = (SELECT m.message_id FROM compaction_source.messages AS m"
                 "                     WHERE m.conversation_id = 'a' AND m.role = 'assistant'"
                 "                     ORDER BY m.seq LIMIT 1)")
    # b: two failures, exhausted
    b = claim(conn, "b", target(conn, "b"), now=t)
    assert b.job_id is not None
    assert db.fail(conn, b.job_id, 1, "http_error", now=t + timedelta(seconds=5)).ok
    assert claim(conn, "b", target(conn, "b"), now=t + timedelta(seconds=6)).attempt == 2
    assert db.fail(conn, b.job_id, 2, "timeout", now=t + timedelta(seconds=9)).ok
    # c: the lease runs out and reap finds it; the retry completes
    c = claim(conn, "c", target(conn, "c"), now=t, lease=timedelta(minutes=1))
    assert c.job_id is not None
    assert db.reap(conn, now=t + timedelta(minutes=2)) == 1
    assert claim(conn, "c", target(conn, "c"), now=t + timedelta(minutes=3)).attempt == 2
    assert db.complete(conn, c.job_id, 2, GOOD, "stop", 0, now=t + timedelta(minutes=4)).ok
    # d: a reply complete() refuses (not stopped)
    d = claim(conn, "d", target(conn, "d"), now=t)
    assert d.job_id is not None
    assert db.complete(conn, d.job_id, 1, GOOD, "length", 0, now=t + timedelta(seconds=30)
                       ).reason == "not_stopped"
    # e: an imported summary
    te = target(conn, "e")
    db.import_summary(conn, "e", "default", te.from_pair, te.source_message_ids,
                      te.source_hash, MODEL, V3, GOOD, t - timedelta(days=1))
    # f: completed, then erased (its events stay, as metadata)
    f = claim(conn, "f", target(conn, "f"), now=t)
    assert f.job_id is not None
    assert db.complete(conn, f.job_id, 1, GOOD, "stop", 0, now=t + timedelta(seconds=40)).ok
    # g: running, its lease renewed
    g = claim(conn, "g", target(conn, "g"), now=t)
    assert g.job_id is not None
    assert db.heartbeat(conn, g.job_id, 1, now=t + timedelta(minutes=1)).ok
    # h: the lease runs out; the late completion finds it (the fence fails it first)
    h = claim(conn, "h", target(conn, "h"), now=t, lease=timedelta(minutes=1))
    assert h.job_id is not None
    assert db.complete(conn, h.job_id, 1, GOOD, "stop", 0, now=t + timedelta(minutes=2)
                       ).reason == "lease_lost"
    # erased last: the tombstone after f's events
    conn.execute("SELECT compaction.erase_conversation('f', 'user_request')")


def replay_second(conn: Conn) -> None:
    """More of the same after the upgrade: the attempt left running ends, h is retried,
    and a second range of a completes; then a is erased."""
    t = T0 + timedelta(minutes=3)  # within g's renewed lease
    g = db.audit(conn, "jobs", conversation_id="g").rows[0]
    assert db.complete(conn, g["job_id"], 1, GOOD, "stop", 0, now=t).ok
    h = claim(conn, "h", target(conn, "h"), now=t)
    assert h.attempt == 2
    a2 = claim(conn, "a", target(conn, "a", 10), now=t)
    assert a2.job_id is not None
    assert db.complete(conn, a2.job_id, 1, GOOD, "stop", 0, now=t + timedelta(seconds=1)).ok
    conn.execute("SELECT compaction.erase_conversation('a', 'user_request')")


def pinned_and_head(new_database: Callable[..., str], before: str) -> tuple[str, str]:
    """Two new databases: one migrated to `before`, one to head (the replay's two sides)."""
    old, new = new_database(), new_database()
    schema.upgrade(old, before)
    schema.upgrade(new)
    return old, new
