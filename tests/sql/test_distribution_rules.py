"""DESIGN.md §11's distribution rules that plain PostgreSQL can check (Citus itself is not
in this suite): every engine table holding a `conversation_id` is per-conversation, and
`conversation_id` leads each of its primary keys, unique indexes and foreign keys to other
per-conversation tables, so the tables can be distributed by it and co-located; tables
without one are the global (reference) tables."""

from __future__ import annotations

from typing import Any

import psycopg

Conn = psycopg.Connection[Any]

PER_CONVERSATION = """
    SELECT c.oid::regclass::text
    FROM pg_class AS c JOIN pg_attribute AS a ON a.attrelid = c.oid
    WHERE c.relnamespace = 'compaction'::regnamespace AND c.relkind IN ('r', 'p')
      AND a.attname = 'conversation_id' AND NOT a.attisdropped
    ORDER BY 1
"""


def test_engine_tables_split_into_per_conversation_and_global(conn: Conn) -> None:
    per_conversation = {r[0] for r in conn.execute(PER_CONVERSATION).fetchall()}
    assert {"compaction.jobs", "compaction.attempts", "compaction.job_summaries",
            "compaction.queue", "compaction.audit_events"} <= per_conversation
    everything = {r[0] for r in conn.execute(
        "SELECT oid::regclass::text FROM pg_class WHERE relnamespace ="
        " 'compaction'::regnamespace AND relkind IN ('r', 'p')").fetchall()}
    assert {"compaction.settings", "compaction.prompt_versions"} <= (
        everything - per_conversation)


def test_conversation_id_leads_every_unique_index(conn: Conn) -> None:
    offenders = conn.execute(f"""
        SELECT i.indexrelid::regclass::text
        FROM pg_index AS i
        WHERE i.indisunique AND i.indrelid::regclass::text IN ({PER_CONVERSATION})
          AND (SELECT a.attname FROM pg_attribute AS a
               WHERE a.attrelid = i.indrelid AND a.attnum = i.indkey[0])
              IS DISTINCT FROM 'conversation_id'
    """).fetchall()
    assert offenders == []


def test_conversation_id_leads_every_foreign_key_between_them(conn: Conn) -> None:
    rows = conn.execute(f"""
        SELECT f.conname,
               (SELECT a.attname FROM pg_attribute AS a
                WHERE a.attrelid = f.conrelid AND a.attnum = f.conkey[1]),
               f.confrelid::regclass::text IN ({PER_CONVERSATION})
        FROM pg_constraint AS f
        WHERE f.contype = 'f' AND f.conrelid::regclass::text IN ({PER_CONVERSATION})
        ORDER BY 1
    """).fetchall()
    assert rows, "no foreign keys found: the query is wrong"
    # A key into a global table (prompt_versions) is fine: reference tables are on
    # every node. Every other key starts with conversation_id.
    assert [name for name, first, to_per_conversation in rows
            if to_per_conversation and first != "conversation_id"] == []
