"""Upgrading a populated 0021 database to 0022_citus_runbook on one node (issue 29).

The audit views become facades over their bodies: every view answers with the same rows
before the upgrade, after it and after a downgrade, and `read_audit_*` return exactly
those rows. (tests/citus/ upgrades a distributed 0021 database.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from pycompactor import schema
from tests.sql.test_audit import scenario

Conn = psycopg.Connection[Any]
VIEWS = ("audit_jobs", "audit_exhausted", "audit_queue", "audit_stale_summaries",
         "audit_events")


def answers(conn: Conn) -> dict[str, list[Any]]:
    # audit_jobs without the column 0048_figures_invented added at its end (NULL here).
    with conn.transaction():  # one now() for the queue's ages
        return {v: sorted(conn.execute(
                    "SELECT to_jsonb(v) - 'figures_invented' FROM compaction.audit_jobs AS v"
                    if v == "audit_jobs" else f"SELECT * FROM compaction.{v}").fetchall(),
                    key=repr)
                for v in VIEWS}


def test_audit_views_answer_the_same_rows_across_0022(new_database: Callable[..., str]) -> None:
    dsn = new_database()
    schema.upgrade(dsn, "0021_cheaper_cycle")
    with psycopg.connect(dsn, autocommit=True) as conn:
        scenario(conn)
        before = answers(conn)
        assert all(before[v] for v in ("audit_jobs", "audit_exhausted", "audit_queue"))
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        after = answers(conn)
        assert {v: rows for v, rows in after.items() if v != "audit_queue"} == {
            v: rows for v, rows in before.items() if v != "audit_queue"}
        # the queue's last column is an age, which moves with the clock
        assert [r[:5] for r in after["audit_queue"]] == [r[:5] for r in before["audit_queue"]]
        with conn.transaction():
            for view in ("jobs", "exhausted", "queue"):
                assert sorted(conn.execute(f"SELECT * FROM compaction.read_audit_{view}()")
                              .fetchall(), key=repr) == sorted(conn.execute(
                                  f"SELECT * FROM compaction.audit_{view}").fetchall(), key=repr)
    schema.downgrade(dsn, "0021_cheaper_cycle")
    with psycopg.connect(dsn, autocommit=True) as conn:
        back = answers(conn)
        assert {v: rows for v, rows in back.items() if v != "audit_queue"} == {
            v: rows for v, rows in before.items() if v != "audit_queue"}
