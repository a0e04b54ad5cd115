"""eligible_pairs / plan_targets are single statements that use indexes and read only the
conversation asked for, even among many others."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import db
from tests.conftest import create_database, drop_database, make_dsn
from tests.history import History
from tests.sql.engine import GOOD, claim, target

Conn = psycopg.Connection[Any]

BIG = "big"
BIG_PAIRS = 10_000
OTHER_CONVERSATIONS = 100
OTHER_PAIRS = 1_000


@pytest.fixture(scope="module")
def crowded_dsn(postgresql_proc: PostgreSQLExecutor, admin_dsn: str,
                template_db: str) -> Iterator[str]:
    """One database for the module: seeding 110,000 pairs is most of its time, and the
    tests only read (EXPLAIN ANALYZE of read functions, counts)."""
    name = f"t_crowded_{uuid.uuid4().hex[:12]}"
    create_database(admin_dsn, name, template=template_db)
    dsn = make_dsn(postgresql_proc, name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            for k in range(OTHER_CONVERSATIONS):
                seed_plain(conn, f"other{k}", OTHER_PAIRS)
            seed_plain(conn, BIG, BIG_PAIRS)
        conn.execute("ANALYZE compaction_source.runs")
        conn.execute("ANALYZE compaction_source.messages")
    yield dsn
    drop_database(admin_dsn, name)


@pytest.fixture
def crowded(crowded_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(crowded_dsn, autocommit=True) as conn:
        yield conn


def seed_plain(conn: Conn, conversation_id: str, n_pairs: int) -> None:
    conn.execute("INSERT INTO compaction_source.conversations VALUES (%s)", (conversation_id,))
    conn.execute(
        "INSERT INTO compaction_source.runs (run_id, conversation_id, status)"
        " SELECT %s || '/r' || i, %s, 'completed' FROM generate_series(1, %s) AS i",
        (conversation_id, conversation_id, n_pairs),
    )
    conn.execute(
        "INSERT INTO compaction_source.messages"
        " (message_id, conversation_id, run_id, role, status, content, seq)"
        " SELECT %s || '/' || r.role || i, %s, %s || '/r' || i, r.role, 'completed',"
        "        repeat(r.role || ' text ' || i || ' ', 8), 2 * i + (r.role = 'assistant')::int"
        " FROM generate_series(1, %s) AS i, (VALUES ('user'), ('assistant')) AS r (role)",
        (conversation_id, conversation_id, conversation_id, n_pairs),
    )


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def function_statement(conn: Conn, function: str, statement: str) -> str:
    """One statement of a PL/pgSQL function's body, its INTO clause taken out.

    judge_runs has these: "runs" (a whole conversation's runs, to tell a
    small conversation from a large one), the question whether a run's
    messages were filed under another conversation, as "foreign" (the runs as a value)
    or "foreign_many" (by subquery, a conversation of more than 256 runs), "named" (the
    runs a re-derivation names) and "verdicts" (RETURN QUERY)."""
    row = conn.execute(
        "SELECT prosrc FROM pg_proc WHERE oid = %s::regprocedure", (function,)
    ).fetchone()
    assert row is not None
    code = re.sub(r"--[^\n]*", "", row[0])
    if statement == "verdicts":
        return code.split("RETURN QUERY", 1)[1].split(";", 1)[0]
    markers = {"runs": "INTO v_runs", "foreign": "ANY (v_runs)",
               "foreign_many": "ANY (ARRAY(SELECT", "named": "INTO v_named_ids"}
    chunks = [c for c in code.split(";") if markers[statement] in c]
    assert len(chunks) == 1, (statement, chunks)
    chunk = chunks[0]
    text = chunk[chunk.rindex("SELECT pg_catalog.array_agg"):]
    return re.sub(r"\bINTO [a-z_, ]+?\n", "\n", text)


def explain_body(conn: Conn, function: str, argument: str,
                 run_ids: str = "NULL::text[]", *, statement: str = "verdicts",
                 values: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """EXPLAIN ANALYZE one statement of the function (function_statement), with the
    argument as a bind parameter and the function's variables as the values given
    (NULL when not given)."""
    body = function_statement(conn, function, statement)
    variables = {"v_foreign": "NULL::text[]", "v_runs": "NULL::text[]",
                 "v_named_ids": "NULL::text[]", "v_named_status": "NULL::text[]"}
    variables.update(values or {})
    body = body.replace("p_conversation_id", "$1").replace("p_run_ids", run_ids)
    for name, value in variables.items():
        body = re.sub(rf"\b{name}\b", value, body)
    conn.execute(b"PREPARE body(text) AS " + body.encode())
    try:
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE body({})").format(
                sql.Literal(argument))
        ).fetchone()
    finally:
        conn.execute("DEALLOCATE body")
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return list(nodes(plan[0]["Plan"]))


def test_judging_runs_uses_indexes_and_reads_one_conversation(crowded: Conn) -> None:
    plan = explain_body(crowded, "compaction.judge_runs(text, text[], boolean)", BIG)
    scans = {(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in plan
             if "Relation Name" in n or "Index Name" in n}
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    assert {s[2] for s in scans} >= {"runs_pkey", "messages_run_idx"}, scans
    # rows produced by the scans: this conversation's runs and messages, nothing else
    scanned = sum(n["Actual Rows"] * n["Actual Loops"] for n in plan if "Relation Name" in n)
    assert scanned == BIG_PAIRS * 3
    # How many runs: the conversation's, by index.
    plan = explain_body(crowded, "compaction.judge_runs(text, text[], boolean)", BIG,
                        statement="runs")
    assert not [n for n in plan if n["Node Type"] == "Seq Scan"], plan
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in plan
               if "Relation Name" in n) == BIG_PAIRS
    # The question across conversations (more than 256 runs: by subquery): this
    # conversation's runs, then their messages by run id, none of which is filed
    # elsewhere here.
    plan = explain_body(crowded, "compaction.judge_runs(text, text[], boolean)", BIG,
                        statement="foreign_many")
    scans = {(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in plan
             if "Relation Name" in n or "Index Name" in n}
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    assert {s[2] for s in scans} >= {"runs_pkey", "messages_run_idx"}, scans
    scanned = sum(n["Actual Rows"] * n["Actual Loops"] for n in plan if "Relation Name" in n)
    assert scanned == BIG_PAIRS


def test_judging_named_runs_reads_only_those_runs(crowded: Conn) -> None:
    """What a tracking trigger pays per appended Run: the runs named, by index."""
    runs = f"ARRAY['{BIG}/r17', '{BIG}/r9000']"
    # The runs named, by run id, in a statement of their own.
    plan = explain_body(crowded, "compaction.judge_runs(text, text[], boolean)", BIG, run_ids=runs,
                        statement="named")
    scans = {(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in plan
             if "Relation Name" in n or "Index Name" in n}
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    scanned = sum(n["Actual Rows"] * n["Actual Loops"] for n in plan if "Relation Name" in n)
    assert scanned == 2
    # The verdicts: the two runs' messages, nothing else.
    plan = explain_body(crowded, "compaction.judge_runs(text, text[], boolean)", BIG, run_ids=runs,
                        values={"v_named_ids": runs,
                                "v_named_status": "ARRAY['completed', 'completed']"})
    scans = {(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in plan
             if "Relation Name" in n or "Index Name" in n}
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    scanned = sum(n["Actual Rows"] * n["Actual Loops"] for n in plan if "Relation Name" in n)
    assert scanned == 2 * 2  # their two messages each
    plan = explain_body(crowded, "compaction.judge_runs(text, text[], boolean)", BIG, run_ids=runs,
                        statement="foreign", values={"v_runs": runs})
    assert not [n for n in plan if n["Node Type"] == "Seq Scan"], plan
    scanned = sum(n["Actual Rows"] * n["Actual Loops"] for n in plan if "Relation Name" in n)
    # No run is read (the runs named are asked about as named), and no
    # message of the two is filed elsewhere.
    assert scanned == 0


def test_judging_named_runs_of_a_large_conversation_reads_no_other_run(conn: Conn) -> None:
    """judge_runs keeps one generic plan. Where conversations are small on average, its
    question across conversations found the named runs among the conversation's runs on
    the prefix of the runs' key, reading every run of a large conversation at each
    tracked write; it asks about the runs as named."""
    with conn.transaction():
        for k in range(300):
            seed_plain(conn, f"small{k}", 5)
        seed_plain(conn, BIG, 3_000)
    conn.execute("VACUUM (ANALYZE) compaction_source.runs, compaction_source.messages")

    def runs_read() -> int:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT idx_tup_read FROM pg_stat_user_indexes"
                           " WHERE indexrelid = 'compaction_source.runs_pkey'::regclass"
                           ).fetchone()
        assert row is not None
        return int(row[0])

    calls = 10  # more than five, as a tracking trigger's session makes
    before = runs_read()
    for k in range(calls):
        rows = conn.execute("SELECT run_id, reason FROM compaction.judge_runs(%s, %s)",
                            (BIG, [f"{BIG}/r{100 + k}"])).fetchall()
        assert rows == [(f"{BIG}/r{100 + k}", None)]
    read = runs_read() - before
    # The named run, found by both key columns: one entry a call (3,000 a call before).
    assert read <= 2 * calls, read


def test_large_conversation_counts(crowded: Conn) -> None:
    started = time.perf_counter()
    pairs = db.eligible_pairs(crowded, BIG)
    pairs_seconds = time.perf_counter() - started
    started = time.perf_counter()
    targets = db.plan_targets(crowded, BIG)
    plan_seconds = time.perf_counter() - started
    assert len(pairs) == BIG_PAIRS
    assert [t.from_pair for t in targets] == list(range(0, BIG_PAIRS - 20 - 9, 10))
    # Reported, not asserted: speed goals live in the benchmarks.
    print(f"eligible_pairs {pairs_seconds:.3f}s, plan_targets {plan_seconds:.3f}s "
          f"for {BIG_PAIRS} pairs")


#: The tables every claim -> complete cycle looks rows up in by key.
CYCLE_TABLES = ("compaction.jobs", "compaction.attempts", "compaction.job_summaries",
                "compaction.summary_verdicts")


def seq_scans(reader: Conn, worker: Conn) -> dict[str, int]:
    """Sequential scans of the cycle's tables so far, the worker's included: its counters
    are flushed before its next ReadyForQuery (pg_stat_force_next_flush), then read."""
    worker.execute("SELECT pg_stat_force_next_flush()")
    reader.execute("SELECT pg_stat_clear_snapshot()")
    rows = reader.execute(
        "SELECT relid::regclass::text, seq_scan FROM pg_stat_user_tables"
        " WHERE relid::regclass::text = ANY(%s)", (list(CYCLE_TABLES),)).fetchall()
    return {str(name): int(count) for name, count in rows}


def test_a_long_lived_worker_connection_keeps_index_plans(conn: Conn, dsn: str) -> None:
    """The worker's write calls plan every lookup on an index, so plans a
    connection caches while the engine's tables are still small (analyzed while nearly
    empty, as autovacuum does early) never scan them later, as they grow. Counted, not
    timed: after the first cycles have planned everything, further cycles on the same
    connection run no sequential scan of the tables they look rows up in."""
    targets = [target(conn, f"grow{i}") for i in range(12)]
    for table in CYCLE_TABLES:
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(*table.split("."))))
    with psycopg.connect(dsn, autocommit=True) as worker:
        def cycle(index: int) -> None:
            claimed = claim(worker, f"grow{index}", targets[index], now=None)
            assert claimed.claimed, claimed.reason
            assert claimed.job_id is not None
            assert db.complete(worker, claimed.job_id, 1, GOOD, "stop", 0).ok
        # Past plpgsql's first five custom plans: from here on the cached plans are used.
        for index in range(6):
            cycle(index)
        before = seq_scans(conn, worker)
        for index in range(6, 12):
            cycle(index)
        after = seq_scans(conn, worker)
    assert sorted(before) == sorted(CYCLE_TABLES)
    assert {t: after[t] - before[t] for t in CYCLE_TABLES} == dict.fromkeys(CYCLE_TABLES, 0)


#: The tables a tracked append looks rows up in by key (source_tracking among them,
#: read by the question whether a rebuild may take the write over).
TRACKED_TABLES = ("compaction_source.runs", "compaction_source.messages",
                  "compaction.conversation_state", "compaction.pairs", "compaction.ranges",
                  "compaction.source_tracking")


def test_tracked_appends_keep_index_plans(conn: Conn, dsn: str) -> None:
    """The tracking trigger and the re-derivation it calls plan every lookup on an index
    (the trigger forces generic plans and prices sequential scans out). Counted, not
    timed, on a writer connection past plpgsql's first plans: no sequential scan. An
    argument of a collatable type other than the text ids' (a trigger's name, whose
    collation is "C") would give the re-derivation's text parameters that collation and
    keep each of these lookups off its index."""
    history = History(conn)
    for k in range(20):
        history.pairs(f"c{k}", 12)
    for table in TRACKED_TABLES:
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(*table.split("."))))

    def counts(writer: Conn) -> dict[str, int]:
        writer.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return {str(name): int(count) for name, count in conn.execute(
            "SELECT relid::regclass::text, seq_scan FROM pg_stat_user_tables"
            " WHERE relid::regclass::text = ANY(%s)", (list(TRACKED_TABLES),))}

    with psycopg.connect(dsn, autocommit=True) as writer:
        own = History(writer)
        for k in range(6):
            with writer.transaction():
                own.pair(f"c{k}")
        before = counts(writer)
        for k in range(6, 12):
            with writer.transaction():
                own.pair(f"c{k}")
        after = counts(writer)
    assert sorted(before) == sorted(TRACKED_TABLES)
    assert {t: after[t] - before[t] for t in TRACKED_TABLES} == dict.fromkeys(TRACKED_TABLES, 0)


#: The tables a tracked write looks rows of its conversation up in by key.
KEYED_TABLES = ("compaction_source.runs", "compaction_source.messages", "compaction.pairs",
                "compaction.queue")


def test_tracked_writes_to_a_large_conversation_read_only_their_keys(conn: Conn,
                                                                     dsn: str) -> None:
    """The engine keeps generic plans. Where conversations are small on average, "these
    keys of this conversation" was planned on the conversation's prefix of an index (or
    as a hash join over it), so every tracked write to a large conversation read all its
    runs and pairs, three times an append, every range it completed read all its
    messages, and, on a queue without statistics, each statement read every queue entry.
    It looks each key up on its own. Counted, not timed: index entries read
    per write, on a writer connection past the first plans (custom ones, then generic),
    the source tables and the derived state analyzed, the queue never (as after an
    install)."""
    conn.execute("ALTER TABLE compaction.queue SET (autovacuum_enabled = off)")
    with conn.transaction():
        # 20 messages a conversation on average: range_hash's join, planned for that,
        # was a hash join over the conversation's messages
        for k in range(600):
            seed_plain(conn, f"small{k}", 5)
        seed_plain(conn, BIG, 3_000)
    conn.execute("VACUUM (ANALYZE) compaction_source.runs, compaction_source.messages,"
                 " compaction.pairs, compaction.ranges, compaction.conversation_state")
    # The seeding's own counts, flushed now: left pending, this session would flush them
    # whenever it next goes idle, in the middle of a measurement.
    conn.execute("SELECT pg_stat_force_next_flush()")

    def entries(writer: Conn) -> dict[str, int]:
        writer.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return {str(table): int(read) for table, read in conn.execute(
            "SELECT relid::regclass::text, sum(idx_tup_read) FROM pg_stat_user_indexes"
            " WHERE relid::regclass::text = ANY(%s) GROUP BY relid",
            (list(KEYED_TABLES),))}

    def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {t: after[t] - before[t] for t in KEYED_TABLES}

    with psycopg.connect(dsn, autocommit=True) as writer:
        own = History(writer)
        own._seq[BIG] = 2 * 3_000 + 1  # after the seeded messages' seq
        # Past plpgsql's first five custom plans, range_hash's included (nine ranges
        # completed), on small conversations.
        for k in range(100):
            with writer.transaction():
                own.pair(f"small{k % 3}")
        before = entries(writer)
        appended = []
        for _ in range(20):  # two ranges completed
            with writer.transaction():
                appended.append(own.pair(BIG))
        appends = since(before, entries(writer))
        before = entries(writer)
        for k in range(10):  # an edit of a pair already derived: its run's pair is looked up
            writer.execute("UPDATE compaction_source.messages SET content = content || '!'"
                           " WHERE conversation_id = %s AND message_id = %s",
                           (BIG, appended[k].assistant_message_id))
        edits = since(before, entries(writer))
    # Each table's entries a write, each key looked up on its own: an append
    # reads 9 of the runs (9,000), 8 of the messages (600: a range completed every ten
    # appends read all 6,000), 5 of the pairs (9,000) and 4 of the queue (1,800); an edit,
    # which re-hashes its range, reads 3 of the runs (3,000), 26 of the messages (4,800),
    # 24 of the pairs (7,500) and 2 of the queue (600).
    assert appends == {t: min(n, 20 * 15) for t, n in appends.items()}, appends
    assert edits == {t: min(n, 10 * 40) for t, n in edits.items()}, edits
    assert conn.execute("SELECT count(*) FROM compaction.verify_conversation(%s)",
                        (BIG,)).fetchone() == (0,)
    assert conn.execute("SELECT pair_count FROM compaction.conversation_state"
                        " WHERE conversation_id = %s", (BIG,)).fetchone() == (3_020,)
