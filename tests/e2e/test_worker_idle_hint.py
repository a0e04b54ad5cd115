"""The worker says why it found nothing: targets that nothing queued.

A host that re-points the views and never calls `compaction.enqueue` leaves a queue
worker idle while targets wait. Here the reference tables' own queue entries are
acknowledged away first, which is the state such a host is in.
"""

from __future__ import annotations

from typing import Any

import psycopg

from bench.common import drain_queue
from tests.workerkit import events_named, run_worker_cli, seed, worker_env

Conn = psycopg.Connection[Any]
MODEL = "pycompactor/extractive-1"


def test_idle_worker_hints_once_at_targets_nothing_queued(conn: Conn, dsn: str) -> None:
    seed(conn, "hint-a", 12)  # no target
    seed(conn, "hint-b", 31)  # one target, range 0
    drain_queue(conn)

    code, events, stderr = run_worker_cli("--once", "--model", MODEL,
                                          "--log-format", "json", env=worker_env(dsn))
    assert code == 0, stderr
    [hint] = events_named(events, "idle_hint")
    assert hint["reason"] == "targets_not_queued"
    assert hint["conversation_id"] == "hint-b"
    assert hint["targets"] == 1
    assert "compaction.enqueue" in hint["hint"]
    assert "--sweep" in hint["hint"]
    [stopped] = events_named(events, "stopped")
    assert stopped["claimed"] == 0

    # Queued, the same target is simply claimed: no hint.
    conn.execute("SELECT compaction.enqueue('hint-b')")
    code, events, stderr = run_worker_cli("--once", "--model", MODEL,
                                          "--log-format", "json", env=worker_env(dsn))
    assert code == 0, stderr
    assert list(events_named(events, "idle_hint")) == []
    assert [e["from_pair"] for e in events_named(events, "claimed")] == [0]

    # Everything summarized and nothing queued: idle, and nothing to hint at.
    code, events, stderr = run_worker_cli("--once", "--model", MODEL,
                                          "--log-format", "json", env=worker_env(dsn))
    assert code == 0, stderr
    assert list(events_named(events, "idle_hint")) == []
    assert list(events_named(events, "claimed")) == []
