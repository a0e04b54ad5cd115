"""Downgrading past 0010_tracking_messages keeps a host's writes working: tables tracked
by message id (the Agents SDK recipe) are re-attached without it, since the restored
trigger function takes two arguments only."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg

from bench.sdk_source import SDK_TABLES_DDL
from pycompactor import schema
from pycompactor.recipes import install_agents_sqlalchemy


def trigger_args(conn: psycopg.Connection[Any]) -> set[int]:
    return {int(n) for (n,) in conn.execute(
        "SELECT t.tgnargs FROM pg_trigger AS t"
        " WHERE t.tgrelid = 'public.agent_messages'::regclass"
        " AND t.tgfoid = 'compaction.track_source_changes()'::regprocedure").fetchall()}


def test_downgrade_reattaches_tables_tracked_by_message_id(
        new_database: Callable[..., str]) -> None:
    dsn = new_database()
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SDK_TABLES_DDL)
        install_agents_sqlalchemy(conn)
        assert trigger_args(conn) == {3}
    schema.downgrade(dsn, "0009_projection_rank")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert trigger_args(conn) == {2}
        conn.execute("INSERT INTO public.agent_sessions (session_id) VALUES ('d')")
        conn.execute("INSERT INTO public.agent_messages (session_id, message_data)"
                     " VALUES ('d', %s)", (json.dumps({"role": "user", "content": "Q"}),))
        assert conn.execute("SELECT * FROM compaction.verify_conversation('d')"
                            ).fetchall() == []
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert trigger_args(conn) == {2}  # the upgrade leaves the host's triggers alone
