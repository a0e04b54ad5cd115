"""compaction.pairs' keys: a Run's pair is found by a 4-byte
hash of its run id, so no index of pairs holds run ids and the run index holds no
conversation id either (the derived state costs less where ids are long:
docs/operations.md, "Space to plan"), and every lookup by run id plans on that index
whatever the statistics on pairs say."""

from __future__ import annotations

from typing import Any

import psycopg

Conn = psycopg.Connection[Any]

CONVERSATIONS = 40
PAIRS = 100


def seed_uuid_history(conn: Conn, conversations: int, pairs: int) -> None:
    """Eligible pairs whose ids are 36-character uuids, as a host's; no ANALYZE."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO compaction_source.conversations"
            " SELECT gen_random_uuid()::text FROM generate_series(1, %s)", (conversations,))
        conn.execute(
            "INSERT INTO compaction_source.runs (conversation_id, run_id, status)"
            " SELECT c.conversation_id, gen_random_uuid()::text, 'completed'"
            " FROM compaction_source.conversations AS c, generate_series(1, %s)", (pairs,))
        conn.execute(
            "INSERT INTO compaction_source.messages"
            " (conversation_id, message_id, run_id, role, status, content, seq)"
            " SELECT r.conversation_id, gen_random_uuid()::text, r.run_id, m.role,"
            "        'completed', m.role || ' text',"
            "        2 * row_number() OVER (PARTITION BY r.conversation_id ORDER BY r.run_id)"
            "          + (m.role = 'assistant')::int"
            " FROM compaction_source.runs AS r, (VALUES ('user'), ('assistant')) AS m (role)")


def pairs_index_entries_read(conn: Conn) -> dict[str, int]:
    """Index entries read so far from each index of compaction.pairs (this backend's
    counts flushed, then a fresh statistics snapshot)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return dict(conn.execute(
        "SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes"
        " WHERE relid = 'compaction.pairs'::regclass").fetchall())


def test_no_index_of_pairs_holds_run_ids(conn: Conn) -> None:
    seed_uuid_history(conn, CONVERSATIONS, PAIRS)
    indexes = dict(conn.execute(
        "SELECT c.relname, pg_catalog.pg_get_indexdef(i.indexrelid)"
        " FROM pg_catalog.pg_index AS i JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'compaction.pairs'::regclass").fetchall())
    assert indexes == {
        "pairs_pkey": "CREATE UNIQUE INDEX pairs_pkey ON compaction.pairs"
                      " USING btree (conversation_id, pair_index)",
        "pairs_run_hash_idx": "CREATE INDEX pairs_run_hash_idx ON compaction.pairs"
                              " USING btree (hashtext(run_id))",
    }
    sizes = dict(conn.execute(
        "SELECT c.relname, pg_catalog.pg_relation_size(c.oid) FROM pg_catalog.pg_class AS c"
        " WHERE c.relname IN ('pairs', 'pairs_pkey', 'pairs_run_hash_idx')").fetchall())
    (count,) = conn.execute("SELECT count(*) FROM compaction.pairs").fetchone() or (0,)
    assert count == CONVERSATIONS * PAIRS
    per_pair = {name: size / count for name, size in sizes.items()}
    # Inserted here in random run id order within each conversation, as a host's uuids
    # come: a B-tree on (conversation_id, run_id) takes 109 bytes a pair, one on
    # (conversation_id, hashtext(run_id)) 92 (entries of 60
    # bytes); this one 43 (entries of 16 bytes, in pages split as the keys came).
    assert per_pair["pairs_run_hash_idx"] < 50, per_pair


def test_appends_find_their_pair_by_the_run_index_without_statistics(conn: Conn) -> None:
    """Tracked appends to a 2,000-pair conversation read a few index entries each, never
    the conversation's pairs through the primary key: compaction.pairs has never been
    analyzed here, and planned on default estimates the primary key's prefix looked as
    good as a hash index on run_id alone (that form cost a tracked append 3x)."""
    # Autovacuum would analyze the table at a moment of its choosing: not in this test.
    conn.execute("ALTER TABLE compaction.pairs SET (autovacuum_enabled = false)")
    seed_uuid_history(conn, 1, 2_000)
    (conversation,) = conn.execute(
        "SELECT conversation_id FROM compaction_source.conversations").fetchone() or ("",)
    assert conn.execute(
        "SELECT last_analyze, last_autoanalyze FROM pg_stat_user_tables"
        " WHERE relid = 'compaction.pairs'::regclass").fetchone() == (None, None)

    before = pairs_index_entries_read(conn)
    appends = 12
    for k in range(appends):  # more than five: the functions' generic plans are in use
        run_id = f"appended-{k}"
        with conn.transaction():
            conn.execute("INSERT INTO compaction_source.runs (conversation_id, run_id, status)"
                         " VALUES (%s, %s, 'running')", (conversation, run_id))
            conn.execute(
                "INSERT INTO compaction_source.messages"
                " (conversation_id, message_id, run_id, role, status, content, seq)"
                " VALUES (%(c)s, %(r)s || '-u', %(r)s, 'user', 'completed', 'q', %(s)s),"
                "        (%(c)s, %(r)s || '-a', %(r)s, 'assistant', 'completed', 'a', %(s)s + 1)",
                {"c": conversation, "r": run_id, "s": 10_000 + 2 * k})
            conn.execute("UPDATE compaction_source.runs SET status = 'completed'"
                         " WHERE conversation_id = %s AND run_id = %s", (conversation, run_id))
            conn.execute("SELECT pg_stat_force_next_flush()")
    after = pairs_index_entries_read(conn)
    read = {name: after[name] - before.get(name, 0) for name in after}
    assert conn.execute("SELECT count(*) FROM compaction.pairs").fetchone() == (2_000 + appends,)
    # An append reads its pair's entries and, once in ten, a completed range's ten;
    # scanning the conversation through the primary key read 2,000 an append.
    assert read["pairs_pkey"] <= 5 * appends, read


def test_edits_find_their_pair_by_the_run_index_without_statistics(conn: Conn) -> None:
    """An edit of a pair's text in a never-analyzed 2,000-pair conversation (its sizes
    change in place, its range is hashed again) reads the primary key only for its range,
    never the conversation's entries: with the conversation written as an index condition
    beside the run's hash, the planner read both indexes and combined them (a BitmapAnd),
    about 2,000 primary-key entries an edit."""
    conn.execute("ALTER TABLE compaction.pairs SET (autovacuum_enabled = false)")
    seed_uuid_history(conn, 1, 2_000)
    (conversation,) = conn.execute(
        "SELECT conversation_id FROM compaction_source.conversations").fetchone() or ("",)
    runs = [r for (r,) in conn.execute(
        "SELECT run_id FROM compaction.pairs WHERE conversation_id = %s ORDER BY pair_index",
        (conversation,)).fetchall()]

    before = pairs_index_entries_read(conn)
    edits = 12
    for k in range(edits):  # more than five: plan_cache_mode auto may turn generic
        conn.execute("UPDATE compaction_source.messages SET content = content || ' edited'"
                     " WHERE run_id = %s AND role = 'user'", (runs[500 + 37 * k],))
    after = pairs_index_entries_read(conn)
    read = {name: after[name] - before.get(name, 0) for name in after}
    assert conn.execute("SELECT count(*) FROM compaction.verify_conversation(%s)",
                        (conversation,)).fetchone() == (0,)
    # An edit reads its range's ten pairs (and a few more) through the primary key: 274 for
    # the twelve, against 24,336 with the conversation as an index condition.
    assert read["pairs_pkey"] <= 30 * edits, read
    assert read["pairs_run_hash_idx"] >= edits, read
