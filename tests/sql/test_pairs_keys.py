"""compaction.pairs' keys (revision 0033): a Run's pair is found through a hash index on
its run id, and no index of pairs holds run ids, so the derived state costs a third less
where ids are long (docs/operations.md, "Space to plan")."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from psycopg import sql

Conn = psycopg.Connection[Any]

CONVERSATIONS = 40
PAIRS = 100


def seed_uuid_history(conn: Conn) -> None:
    """CONVERSATIONS × PAIRS eligible pairs whose ids are 36-character uuids, as a host's."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO compaction_source.conversations"
            " SELECT gen_random_uuid()::text FROM generate_series(1, %s)", (CONVERSATIONS,))
        conn.execute(
            "INSERT INTO compaction_source.runs (conversation_id, run_id, status)"
            " SELECT c.conversation_id, gen_random_uuid()::text, 'completed'"
            " FROM compaction_source.conversations AS c, generate_series(1, %s)", (PAIRS,))
        conn.execute(
            "INSERT INTO compaction_source.messages"
            " (conversation_id, message_id, run_id, role, status, content, seq)"
            " SELECT r.conversation_id, gen_random_uuid()::text, r.run_id, m.role,"
            "        'completed', m.role || ' text',"
            "        2 * row_number() OVER (PARTITION BY r.conversation_id ORDER BY r.run_id)"
            "          + (m.role = 'assistant')::int"
            " FROM compaction_source.runs AS r, (VALUES ('user'), ('assistant')) AS m (role)")
    conn.execute("ANALYZE compaction.pairs")


def test_no_index_of_pairs_holds_run_ids_but_a_hash_index(conn: Conn) -> None:
    seed_uuid_history(conn)
    indexes = dict(conn.execute(
        "SELECT c.relname, pg_catalog.pg_get_indexdef(i.indexrelid)"
        " FROM pg_catalog.pg_index AS i JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'compaction.pairs'::regclass").fetchall())
    assert indexes == {
        "pairs_pkey": "CREATE UNIQUE INDEX pairs_pkey ON compaction.pairs"
                      " USING btree (conversation_id, pair_index)",
        "pairs_run_idx": "CREATE INDEX pairs_run_idx ON compaction.pairs USING hash (run_id)",
    }
    (count, index_bytes) = conn.execute(
        "SELECT count(*), pg_catalog.pg_indexes_size('compaction.pairs')"
        " FROM compaction.pairs").fetchone() or (0, 0)
    assert count == CONVERSATIONS * PAIRS
    # With a B-tree on (conversation_id, run_id) beside the pair numbers' key, pairs'
    # indexes took 182 bytes a pair here (109 that B-tree); now 119 (74 the key, 45 the
    # hash index, whose buckets a table this small leaves partly empty).
    assert index_bytes / count < 125, index_bytes / count


def test_the_tracking_finds_a_runs_pair_through_the_hash_index(conn: Conn) -> None:
    """The lookups of rederive and rederive_runs: a conversation's pairs of named runs."""
    seed_uuid_history(conn)
    (conversation, runs) = conn.execute(
        "SELECT conversation_id, (array_agg(run_id ORDER BY pair_index))[40:41]"
        " FROM compaction.pairs GROUP BY conversation_id LIMIT 1").fetchone() or ("", [])
    conn.execute("PREPARE stale(text, text[]) AS SELECT p.* FROM compaction.pairs AS p"
                 " WHERE p.conversation_id = $1 AND p.run_id = ANY ($2)")
    conn.execute("SET plan_cache_mode = force_generic_plan")
    row = conn.execute(sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE stale({}, {})").format(
        sql.Literal(conversation), sql.Literal(runs))).fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    text = json.dumps(plan)
    assert '"Index Name": "pairs_run_idx"' in text, text
    assert plan[0]["Plan"]["Actual Rows"] == 2
