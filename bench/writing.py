"""Benchmark 5: what the derived state costs the writer.

The tracking triggers keep pair numbering, range ids and hashes in the same transaction
as the source writes (contract §2). Measured against identical tables without the engine's
triggers, in the same database and run:

* appending a Run at the end of a long conversation, as an agent writes it: one
  transaction of four statements (the run, its user message, its assistant message, the
  run's status set to completed), one client round trip each, committed durably; and in
  the order of docs/integrating.md's application, which writes a Run settled: the run as
  completed, then its two messages in one statement. The
  long conversations sit among many short ones (2,000 of 5 pairs), as in a real
  database: the engine's generic plans are priced for the average conversation, and a
  plan that made each append read every run and pair of the long one would show here;
* a bulk load: 10,000 pairs of one conversation in two statements (runs, then messages);
* for reference, a Run inserted before all others of that conversation (everything
  after it is numbered and hashed again), and the conversation re-derived whole
  (`compaction.rederive_conversation`, the repair path; the rebuild derives each
  conversation so).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg

from bench.common import REPETITIONS, Conn, Sizes, median, percentile, ratio, text_pool

# The reference tables, and identical copies (columns, keys, indexes) without triggers.
ENGINE = ("compaction_source.conversations", "compaction_source.runs",
          "compaction_source.messages")
PLAIN = ("bench_plain.conversations", "bench_plain.runs", "bench_plain.messages")


def _make_plain(conn: Conn) -> None:
    conn.execute("CREATE SCHEMA bench_plain")
    conn.execute("CREATE TABLE bench_plain.conversations"
                 " (LIKE compaction_source.conversations INCLUDING ALL)")
    conn.execute("CREATE TABLE bench_plain.runs (LIKE compaction_source.runs INCLUDING ALL,"
                 " FOREIGN KEY (conversation_id) REFERENCES bench_plain.conversations)")
    # messages has no foreign key to runs (sql/10_source.sql)
    conn.execute("CREATE TABLE bench_plain.messages (LIKE compaction_source.messages"
                 " INCLUDING ALL)")


def seed(conn: Conn, tables: tuple[str, str, str], conversation: str, pairs: int,
          first_pair: int, users: list[str], assistants: list[str]) -> None:
    """`pairs` pairs of one conversation in two statements (runs, then messages)."""
    conversations, runs, messages = tables
    if first_pair == 0:
        conn.execute(f"INSERT INTO {conversations} VALUES (%s)", (conversation,))
    params = {"c": conversation, "p0": first_pair, "p1": first_pair + pairs - 1,
              "users": users, "assistants": assistants}
    conn.execute(
        f"INSERT INTO {runs} (run_id, conversation_id, status, created_at)"
        " SELECT %(c)s || '-r' || lpad(p::text, 6, '0'), %(c)s, 'completed', now()"
        " FROM generate_series(%(p0)s::int, %(p1)s::int) p", params)
    conn.execute(
        f"INSERT INTO {messages}"
        " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
        " SELECT %(c)s || '-' || left(role, 1) || lpad(p::text, 6, '0'), %(c)s,"
        "        %(c)s || '-r' || lpad(p::text, 6, '0'), role, 'completed',"
        "        CASE role WHEN 'user' THEN (%(users)s::text[])[1 + p %% 50]"
        "             ELSE (%(assistants)s::text[])[1 + p %% 50] END || ' #' || p,"
        "        100 + 2 * p + (role = 'assistant')::int, now()"
        " FROM generate_series(%(p0)s::int, %(p1)s::int) p,"
        "      unnest(ARRAY['user', 'assistant']) role", params)


def seed_crowd(conn: Conn, tables: tuple[str, str, str], conversations: int,
               pairs: int) -> None:
    """`conversations` conversations of `pairs` pairs each, in three statements."""
    table_conversations, runs, messages = tables
    params = {"n": conversations, "p": pairs}
    conn.execute(f"INSERT INTO {table_conversations}"
                 " SELECT 'crowd' || c FROM generate_series(1, %(n)s) c", params)
    conn.execute(
        f"INSERT INTO {runs} (run_id, conversation_id, status, created_at)"
        " SELECT 'crowd' || c || '-r' || p, 'crowd' || c, 'completed', now()"
        " FROM generate_series(1, %(n)s) c, generate_series(1, %(p)s) p", params)
    conn.execute(
        f"INSERT INTO {messages}"
        " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
        " SELECT 'crowd' || c || '-' || left(role, 1) || p, 'crowd' || c,"
        "        'crowd' || c || '-r' || p, role, 'completed', role || ' text ' || p,"
        "        2 * p + (role = 'assistant')::int, now()"
        " FROM generate_series(1, %(n)s) c, generate_series(1, %(p)s) p,"
        "      unnest(ARRAY['user', 'assistant']) role", params)


def append_run(conn: Conn, tables: tuple[str, str, str], conversation: str, seq: int,
                user: str, assistant: str, *, settled_first: bool = False) -> float:
    """One Run as an agent writes it (settled_first: as the worked example's application
    does); milliseconds until the commit returned."""
    _, runs, messages = tables
    run_id = f"{conversation}-x{uuid.uuid4().hex[:12]}"
    started = time.perf_counter()
    if settled_first:
        with conn.transaction():
            conn.execute(f"INSERT INTO {runs} (run_id, conversation_id, status, created_at)"
                         " VALUES (%s, %s, 'completed', now())", (run_id, conversation))
            conn.execute(f"INSERT INTO {messages} (message_id, conversation_id, run_id, role,"
                         " status, content, seq, created_at)"
                         " VALUES (%s, %s, %s, 'user', 'completed', %s, %s, now()),"
                         "        (%s, %s, %s, 'assistant', 'completed', %s, %s, now())",
                         (run_id + "-u", conversation, run_id, user, seq,
                          run_id + "-a", conversation, run_id, assistant, seq + 1))
        return (time.perf_counter() - started) * 1000
    with conn.transaction():
        conn.execute(f"INSERT INTO {runs} (run_id, conversation_id, status, created_at)"
                     " VALUES (%s, %s, 'running', now())", (run_id, conversation))
        conn.execute(f"INSERT INTO {messages} (message_id, conversation_id, run_id, role,"
                     " status, content, seq, created_at)"
                     " VALUES (%s, %s, %s, 'user', 'completed', %s, %s, now())",
                     (run_id + "-u", conversation, run_id, user, seq))
        conn.execute(f"INSERT INTO {messages} (message_id, conversation_id, run_id, role,"
                     " status, content, seq, created_at)"
                     " VALUES (%s, %s, %s, 'assistant', 'completed', %s, %s, now())",
                     (run_id + "-a", conversation, run_id, assistant, seq + 1))
        conn.execute(f"UPDATE {runs} SET status = 'completed' WHERE run_id = %s", (run_id,))
    return (time.perf_counter() - started) * 1000


def run(dsn: str, sizes: Sizes) -> dict[str, Any]:
    pairs = sizes.write_pairs
    users = text_pool(7, 50, 200)
    assistants = text_pool(8, 50, sizes.reply_bytes)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _make_plain(conn)
        for tables in (ENGINE, PLAIN):
            with conn.transaction():
                seed_crowd(conn, tables, sizes.write_crowd, 5)
        bulk: dict[str, list[float]] = {"engine": [], "plain": []}
        early: list[float] = []
        appends: dict[str, list[float]] = {"engine": [], "plain": []}
        settled: dict[str, list[float]] = {"engine": [], "plain": []}
        for rep in range(REPETITIONS):
            for label, tables in (("engine", ENGINE), ("plain", PLAIN)):
                conversation = f"bulk{rep}"
                started = time.perf_counter()
                with conn.transaction():
                    seed(conn, tables, conversation, pairs, 0, users, assistants)
                bulk[label].append(time.perf_counter() - started)
            conn.execute("VACUUM (ANALYZE) compaction_source.runs, compaction_source.messages,"
                         " bench_plain.runs, bench_plain.messages")
            # Appends at the end of the long conversation, alternating, so both sides
            # meet the same machine noise.
            for op in range(sizes.write_appends):
                seq = 1_000_000 + 4 * (rep * sizes.write_appends + op)
                for label, tables in (("engine", ENGINE), ("plain", PLAIN)):
                    appends[label].append(append_run(
                        conn, tables, f"bulk{rep}", seq, users[op % 50],
                        assistants[op % 50]))
                    settled[label].append(append_run(
                        conn, tables, f"bulk{rep}", seq + 2, users[op % 50],
                        assistants[op % 50], settled_first=True))
            # A Run before every other one: all pairs after it move.
            with conn.transaction():
                started = time.perf_counter()
                conn.execute("INSERT INTO compaction_source.runs (run_id, conversation_id,"
                             " status) VALUES (%s, %s, 'completed')",
                             (f"bulk{rep}-first", f"bulk{rep}"))
                conn.execute("INSERT INTO compaction_source.messages (message_id,"
                             " conversation_id, run_id, role, status, content, seq)"
                             " VALUES (%s, %s, %s, 'user', 'completed', 'q', 0),"
                             "        (%s, %s, %s, 'assistant', 'completed', 'a', 1)",
                             (f"bulk{rep}-first-u", f"bulk{rep}", f"bulk{rep}-first",
                              f"bulk{rep}-first-a", f"bulk{rep}", f"bulk{rep}-first"))
            early.append(time.perf_counter() - started)
        # The repair path (and each conversation of a rebuild): a long conversation
        # re-derived whole, after the session's plans turned generic on short ones.
        for k in range(6):
            conn.execute("SELECT compaction.rederive_conversation(%s)", (f"crowd{k + 1}",))
        whole: list[float] = []
        for rep in range(REPETITIONS):
            started = time.perf_counter()
            conn.execute("SELECT compaction.rederive_conversation(%s)", (f"bulk{rep}",))
            whole.append(time.perf_counter() - started)
        problems = conn.execute(
            "SELECT count(*) FROM generate_series(0, %s) r,"
            " compaction.verify_conversation('bulk' || r)", (REPETITIONS - 1,)).fetchone()
    engine_p50 = median(appends["engine"])
    plain_p50 = median(appends["plain"])
    return {
        "pairs": pairs,
        "crowd": sizes.write_crowd,
        "appends_per_rep": sizes.write_appends,
        "append": {
            "engine_p50_ms": engine_p50,
            "engine_p95_ms": percentile(appends["engine"], 95),
            "plain_p50_ms": plain_p50,
            "plain_p95_ms": percentile(appends["plain"], 95),
            "ratio_p50": ratio(engine_p50, plain_p50),
        },
        "append_settled_first": {
            "engine_p50_ms": median(settled["engine"]),
            "engine_p95_ms": percentile(settled["engine"], 95),
            "plain_p50_ms": median(settled["plain"]),
            "plain_p95_ms": percentile(settled["plain"], 95),
            "ratio_p50": ratio(median(settled["engine"]), median(settled["plain"])),
        },
        "bulk": {
            "engine_s_reps": bulk["engine"],
            "plain_s_reps": bulk["plain"],
            "engine_s": median(bulk["engine"]),
            "plain_s": median(bulk["plain"]),
            "ratio": ratio(median(bulk["engine"]), median(bulk["plain"])),
        },
        "insert_before_all_s": median(early),
        "rederive_whole_s": median(whole),
        "verify_problems": int(problems[0]) if problems else None,
    }
