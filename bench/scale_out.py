"""`make bench-citus`: the same drain and projection on one node and on Citus.

Two setups from one PostgreSQL installation (the one whose pg_config is given, with Citus
installed), both durable (fsync, synchronous_commit and full_page_writes on), in one run:
one node with the engine migrated, and a Citus cluster on loopback (a coordinator and two
workers) set up as docs/operations.md says (extension, nodes, migrate, the owner may log
in, distribute, in the shard count given; trust on loopback in place of the owner's
password). On each:

- drain: conversations of 100 pairs (8 ranges each before the window), enqueued; one
  `pycompactor worker --once --concurrency 4` pass with the offline summarizer, timed
  until every range has its summary (the pass claims one range at a time and runs up to
  four model calls, with their reads of the replies and their completions, at once);
- one long conversation: a conversation of 10,000 pairs (998 ranges) enqueued and
  drained by the same pass, timed the same way (its ranges are claimed one at a time
  from one conversation's targets; up to four model calls at once);
- projection: `project_history` at 64 KiB on conversations of 100, 1,000 and 10,000
  pairs, every range summarized beforehand; p50 of repeated calls (15, or as many as fit
  in a minute, at least 3; a warm-up call over a minute is the one sample);
- a tracked append (an agent's Run: the run written running, its two messages, the run
  settled, in one transaction) to a conversation of 100 pairs, against the same writes to
  look-alike tables without the tracking triggers (co-located with the history on Citus);
- `claim` -> `complete` of one range, p50 of a cycle; `audit_stale_summaries` read whole
  after the drain and the projection's imports;
- the price of exactness: a read by key against a read of every shard of an empty table
  co-located with the history (and of one with a shard per worker); what each call of a
  drained range costs; contract §3's one question across conversations, as every read of
  a conversation asks it first (the record of foreign messages,
  compaction.foreign_messages, read whole: every shard on Citus); what a trigger on a
  shard may do.

    python -m bench.scale_out --pg-config /usr/lib/postgresql/15/bin/pg_config
    python -m bench.scale_out --pg-config ... --smoke     # tiny sizes: checks it runs
    python -m bench.scale_out --pg-config ... --shard-count 8   # fewer shards than 32

Goals (Citus with the derived state kept): the drain on Citus <= 3x the single node's
time, and of the one long conversation <= 3x; projection at 10,000 pairs on Citus <= 3x
the single node's, and its p50 at 10,000 pairs <= 1.5x its own p50 at 100 pairs; a
tracked append on Citus <= 2x an untracked one there; audit_stale_summaries on Citus <= 3x
the single node's. Results go to bench/results/scale_out.json and scale_out.md (ignored by
git; docs/benchmarks.md names the run it quotes). Not part of `make test` nor `make bench`.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from bench.common import latencies, median, seed_conversations, text_pool, vacuum_analyze
from pycompactor import db, schema
from pycompactor.cli.cluster import ThrowawayCluster
from pycompactor.projection import project_history
from pycompactor.summarizers.extractive import OFFLINE_MODEL, ExtractiveSummarizer
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "agent"
# The nodes reach each other over loopback without TLS: the server runs as another OS
# user than the one whose HOME its environment names, where libpq would look for certificates.
CITUS_SETTINGS = {"shared_preload_libraries": "citus", "citus.enable_unsafe_triggers": "on",
                  "citus.node_conninfo": "sslmode=disable", "max_connections": "200"}
BUDGET = 64 * 1024
#: The engine's shard count as docs/operations.md's step 7 leaves it (Citus's default);
#: `--shard-count` measures another ("How many shards" there).
RUNBOOK_SHARD_COUNT = 32


@dataclass(frozen=True)
class Sizes:
    drain_conversations: int
    drain_pairs: int
    long_pairs: int
    projection_pairs: tuple[int, ...]
    projection_calls: int
    probe_calls: int
    cycle_calls: int


FULL = Sizes(drain_conversations=38, drain_pairs=100, long_pairs=10_000,
             projection_pairs=(100, 1_000, 10_000), projection_calls=15, probe_calls=300,
             cycle_calls=40)
SMOKE = Sizes(drain_conversations=3, drain_pairs=40, long_pairs=60, projection_pairs=(40, 100, 200),
              projection_calls=3, probe_calls=5, cycle_calls=3)


def bindir_of(pg_config: str) -> Path:
    out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def dsn_of(cluster: ThrowawayCluster, dbname: str = DATABASE) -> str:
    return f"host=127.0.0.1 port={cluster.port} user=postgres dbname={dbname}"


def create_database(cluster: ThrowawayCluster) -> None:
    with psycopg.connect(cluster.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'")
                      .format(sql.Identifier(DATABASE)))


@contextmanager
def single_node(bindir: Path) -> Iterator[str]:
    with ThrowawayCluster(bindir, durable=True) as cluster:
        create_database(cluster)
        schema.upgrade(dsn_of(cluster))
        yield dsn_of(cluster)


@contextmanager
def citus_cluster(bindir: Path, shard_count: int = RUNBOOK_SHARD_COUNT) -> Iterator[str]:
    """docs/operations.md's steps on three durable loopback nodes, the engine distributed
    in `shard_count` shards; the coordinator's DSN."""
    with ExitStack() as stack:
        nodes = [stack.enter_context(ThrowawayCluster(bindir, durable=True,
                                                      settings=CITUS_SETTINGS))
                 for _ in range(3)]
        for node in nodes:
            create_database(node)
            with psycopg.connect(dsn_of(node), autocommit=True) as c:
                c.execute("CREATE EXTENSION citus")
        coordinator = dsn_of(nodes[0])
        with psycopg.connect(coordinator, autocommit=True) as c:
            c.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)", (nodes[0].port,))
            for worker in nodes[1:]:
                c.execute("SELECT citus_add_node('127.0.0.1', %s)", (worker.port,))
        schema.upgrade(coordinator)
        with psycopg.connect(coordinator, autocommit=True) as c:
            c.execute("ALTER ROLE compaction_owner LOGIN")
            c.execute("SELECT pg_catalog.set_config('citus.shard_count', %s, false)",
                      (str(shard_count),))
            c.execute("CALL compaction.distribute_on_citus()")
        yield coordinator


def enqueue_all(conn: psycopg.Connection[Any], prefix: str, count: int) -> None:
    # On Citus the reference tables' queue triggers are detached: writers enqueue.
    for c in range(count):
        conn.execute("SELECT compaction.enqueue(%s)", (f"{prefix}{c}",))


def drain(dsn: str, sizes: Sizes, prefix: str = "drain-", conversations: int | None = None,
          pairs: int | None = None) -> dict[str, Any]:
    """One worker pass over `conversations` fresh conversations of `pairs` pairs (the
    drain's sizes unless given), timed until every range has its summary."""
    count = sizes.drain_conversations if conversations is None else conversations
    users = text_pool(31, 32, 240)
    replies = text_pool(32, 64, 900)
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed_conversations(conn, prefix, 0, count,
                           sizes.drain_pairs if pairs is None else pairs,
                           user_pool=users, assistant_pool=replies)
        enqueue_all(conn, prefix, count)
        expected = sum(len(db.plan_targets(conn, f"{prefix}{c}")) for c in range(count))
        before = _summaries(conn)
    vacuum_analyze(dsn)
    config = WorkerConfig(model=OFFLINE_MODEL, dsn=dsn, once=True, concurrency=4,
                          log_format="json")
    worker = Worker(config, ExtractiveSummarizer(),
                    connect=lambda: psycopg.connect(dsn, autocommit=True,
                                                    application_name="bench-scale-out"),
                    log=EventLog("json", stream=io.StringIO()))
    started = time.perf_counter()
    report = worker.run()
    seconds = time.perf_counter() - started
    with psycopg.connect(dsn, autocommit=True) as conn:
        summaries = _summaries(conn) - before
    if summaries != expected:
        raise RuntimeError(f"the drain left work: {summaries} summaries of {expected} ranges")
    return {"conversations": count, "ranges": expected,
            "claimed": report.claimed, "seconds": round(seconds, 3),
            "ranges_per_s": round(expected / seconds, 1)}


def _summaries(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM compaction.job_summaries").fetchone()
    return int(row[0]) if row else 0


def projection(dsn: str, sizes: Sizes) -> dict[str, Any]:
    users = text_pool(41, 32, 240)
    replies = text_pool(42, 64, 900)
    summary = text_pool(43, 1, 1500)[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pairs in sizes.projection_pairs:
            seed_conversations(conn, f"proj-{pairs}-", 0, 1, pairs,
                               user_pool=users, assistant_pool=replies)
            conversation = f"proj-{pairs}-0"
            conn.execute(
                "SELECT count(compaction.import_summary(%(c)s, 'default', t.from_pair,"
                " t.source_message_ids, t.source_hash, 'bench/imported',"
                " 'conversation-compaction@3', %(s)s::text || t.from_pair, now()))"
                " FROM compaction.plan_targets(%(c)s) AS t",
                {"c": conversation, "s": summary})
    vacuum_analyze(dsn)
    p50: dict[int, float] = {}
    calls: dict[int, int] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pairs in sizes.projection_pairs:
            conversation = f"proj-{pairs}-0"
            started = time.perf_counter()
            project_history(conn, conversation, budget_bytes=BUDGET)  # warm-up
            warm_up = (time.perf_counter() - started) * 1000
            # At most a minute a conversation, at least three calls; a warm-up call that
            # alone took over a minute (an untracked cluster's largest history: about ten
            # minutes on 2026-12-03) is the one sample.
            times: list[float] = [warm_up] if warm_up > 60_000 else []
            deadline = time.perf_counter() + 60
            while len(times) < sizes.projection_calls and (
                    len(times) < 3 or time.perf_counter() < deadline) and warm_up <= 60_000:
                started = time.perf_counter()
                project_history(conn, conversation, budget_bytes=BUDGET)
                times.append((time.perf_counter() - started) * 1000)
            calls[pairs] = len(times)
            p50[pairs] = round(median(times), 2)
    small, large = sizes.projection_pairs[0], sizes.projection_pairs[-1]
    return {"budget_bytes": BUDGET, "p50_ms": {str(k): v for k, v in p50.items()},
            "calls": {str(k): v for k, v in calls.items()},
            "large_over_small": round(p50[large] / p50[small], 2)}


def _p50_ms(conn: psycopg.Connection[Any], query: LiteralString, calls: int,
            params: dict[str, Any] | None = None) -> float:
    def call() -> None:
        conn.execute(query, params).fetchall()

    latencies(call, max(3, calls // 10))  # warm-up: the executor's connections, plans
    return round(median(latencies(call, calls)), 3)


#: What a drained range costs, call by call: a worker pass reads its conversation's targets
#: (worker_targets), claims (which judges the range with current_range), reads the replies
#: (range_replies: by the claimed job's ids, measured after the drain claimed that range),
#: and completes; claim and complete each write an admission slot, a row of a reference
#: table. Each judging call reads the conversation from the views when the derived state
#: is not in use, and judge_runs is the eligibility they all start from.
RANGE_CALLS: dict[str, LiteralString] = {
    "judge_runs": "SELECT count(*) FROM compaction.judge_runs(%(c)s)",
    "current_range": "SELECT * FROM compaction.current_range(%(c)s, 0)",
    "worker_targets": "SELECT * FROM compaction.worker_targets(%(c)s, 'default', %(m)s,"
                      " 'conversation-compaction@3')",
    "range_replies": "SELECT * FROM compaction.range_replies(%(c)s, 0, %(h)s)",
    # In a transaction of its own, which commits (on Citus: on every node).
    "admission_write": "UPDATE compaction.admission SET lease_expires_at = lease_expires_at"
                       " WHERE slot = 1 RETURNING slot",
}


#: §3's one question that crosses conversations, as every read of a conversation asks it
#: first (compaction.derived_state_serves): is a run of this conversation
#: named by a message filed under a conversation without that run? The tracking keeps the
#: answer per conversation, co-located with it (compaction.foreign_messages: the run ids
#: each conversation's foreign messages name, rows only while a message waits for its Run
#: or is misfiled), so the question is one read of that small record, whole: every shard
#: on Citus, one index-only read on one node; the conversation's pairs are then looked up
#: by the few run ids it names.
FOREIGN_RECORD: LiteralString = (
    "SELECT pg_catalog.array_agg(DISTINCT f.run_id) FROM compaction.foreign_messages AS f")

#: What a row trigger on a shard may do (Citus, citus.enable_unsafe_triggers on): each
#: body runs for every row written to bench_probe.writes, a table co-located with the
#: history; bench_probe.counts is co-located too.
SHARD_TRIGGER_PROBES: dict[str, LiteralString] = {
    "write its own conversation's row of a co-located table":
        "INSERT INTO bench_probe.counts AS k (conversation_id, n)"
        " VALUES (NEW.conversation_id, 1)"
        " ON CONFLICT (conversation_id) DO UPDATE SET n = k.n + 1",
    "read every shard of a co-located table":
        "PERFORM count(*) FROM bench_probe.counts",
    # NEAR, FAR: conversations in another shard on the written row's node, and on another
    # node (a write to another conversation succeeds only by the accident of placement)
    "write another conversation's row, on the same node":
        "INSERT INTO bench_probe.counts AS k (conversation_id, n) VALUES (NEAR, 1)"
        " ON CONFLICT (conversation_id) DO UPDATE SET n = k.n + 1",
    "write another conversation's row, on another node":
        "INSERT INTO bench_probe.counts AS k (conversation_id, n) VALUES (FAR, 1)"
        " ON CONFLICT (conversation_id) DO UPDATE SET n = k.n + 1",
}


def appends(dsn: str, sizes: Sizes, citus: bool) -> dict[str, Any]:
    """p50 ms of an agent's Run written to a conversation of the drain's size: tracked
    (the source tables, with their triggers) against untracked (look-alike tables without
    them, co-located with the history on Citus). Each Run in one transaction: inserted
    running, its user and assistant message, settled."""
    calls = max(5, sizes.probe_calls // 10)
    users = text_pool(51, 8, 240)
    replies = text_pool(52, 8, 900)
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed_conversations(conn, "append-", 0, 1, sizes.drain_pairs,
                           user_pool=users, assistant_pool=replies)
        conn.execute("CREATE SCHEMA bench_append")
        for table in ("runs", "messages"):
            conn.execute(sql.SQL("CREATE TABLE bench_append.{} (LIKE compaction_source.{}"
                                 " INCLUDING DEFAULTS INCLUDING INDEXES)").format(
                sql.Identifier(table), sql.Identifier(table)))
            if citus:
                conn.execute("SELECT create_distributed_table(%s, 'conversation_id',"
                             " colocate_with => 'compaction_source.messages')",
                             (f"bench_append.{table}",))
        conn.execute("INSERT INTO bench_append.runs SELECT * FROM compaction_source.runs"
                     " WHERE conversation_id = 'append-0'")
        conn.execute("INSERT INTO bench_append.messages SELECT * FROM"
                     " compaction_source.messages WHERE conversation_id = 'append-0'")
        vacuum_analyze(dsn)
        timed: dict[str, float] = {}
        keys = iter(range(10**9))
        for label, schema_name in (("tracked", "compaction_source"),
                                   ("untracked", "bench_append")):
            tables = (sql.SQL("{}.runs").format(sql.Identifier(schema_name)),
                      sql.SQL("{}.messages").format(sql.Identifier(schema_name)))

            def append(tables: tuple[sql.Composed, sql.Composed] = tables) -> None:
                runs, messages = tables
                k = next(keys)
                run = f"append-0-x{k:06d}"
                seq = 10_000_000 + 2 * k
                with conn.transaction():
                    conn.execute(sql.SQL("INSERT INTO {} (conversation_id, run_id, status)"
                                         " VALUES ('append-0', %s, 'running')").format(runs),
                                 (run,))
                    conn.execute(sql.SQL(
                        "INSERT INTO {} (conversation_id, message_id, run_id, role, status,"
                        " content, seq) VALUES ('append-0', %(r)s || '-u', %(r)s, 'user',"
                        " 'completed', 'a question', %(s)s), ('append-0', %(r)s || '-a',"
                        " %(r)s, 'assistant', 'completed', 'an answer', %(s)s + 1)"
                    ).format(messages), {"r": run, "s": seq})
                    conn.execute(sql.SQL("UPDATE {} SET status = 'completed'"
                                         " WHERE conversation_id = 'append-0'"
                                         " AND run_id = %s").format(runs), (run,))

            latencies(append, max(3, calls // 5))  # warm-up
            timed[label] = round(median(latencies(append, calls)), 3)
        problems = conn.execute("SELECT count(*) FROM"
                                " compaction.verify_conversation('append-0')").fetchone()
        conn.execute("DROP SCHEMA bench_append CASCADE")
    if problems != (0,):
        raise RuntimeError("the tracked appends left the derived state inexact")
    return {"tracked_ms": timed["tracked"], "untracked_ms": timed["untracked"],
            "tracked_over_untracked": round(timed["tracked"] / timed["untracked"], 2),
            "pairs": sizes.drain_pairs, "calls": calls}


def cycles(dsn: str, sizes: Sizes) -> dict[str, Any]:
    """p50 ms of `claim` -> `complete` of one range of a conversation of the drain's size
    (a fresh target each cycle), and of `audit_stale_summaries` read whole."""
    users = text_pool(61, 8, 240)
    replies = text_pool(62, 8, 900)
    pairs = 30 + 10 * (sizes.cycle_calls + 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed_conversations(conn, "cycle-", 0, 1, pairs, user_pool=users, assistant_pool=replies)
        vacuum_analyze(dsn)
        targets = iter(db.plan_targets(conn, "cycle-0"))

        def cycle() -> None:
            t = next(targets)
            got = db.claim(conn, "cycle-0", "default", t.from_pair, t.source_message_ids,
                           t.source_hash, "bench/cycle", "conversation-compaction@3", "bench")
            if got.job_id is None or got.attempt is None:
                raise RuntimeError(f"the cycle's claim was refused: {got.reason}")
            done = db.complete(conn, got.job_id, got.attempt, "A summary.", "stop", 0,
                               conversation_id="cycle-0")
            if not done.ok:
                raise RuntimeError("the cycle's completion was refused")

        latencies(cycle, 1)
        cycle_ms = round(median(latencies(cycle, sizes.cycle_calls)), 3)
        audit_ms = _p50_ms(conn, "SELECT count(*) FROM compaction.audit_stale_summaries",
                           max(3, sizes.projection_calls // 3))
    return {"claim_complete_ms": cycle_ms, "audit_stale_summaries_ms": audit_ms}


def shard_triggers(dsn: str, calls: int) -> dict[str, Any]:
    """On Citus: what each SHARD_TRIGGER_PROBES body does on a write (ok, or Citus's
    refusal), and the p50 ms of a one-row insert without a trigger and with the first."""
    outcomes: dict[str, str] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA bench_probe")
        for table, columns in (("writes", "conversation_id text, k int,"
                                          " PRIMARY KEY (conversation_id, k)"),
                               ("counts", "conversation_id text PRIMARY KEY, n int")):
            conn.execute(sql.SQL("CREATE TABLE bench_probe.{} ({})").format(
                sql.Identifier(table), sql.SQL(columns)))
            conn.execute("SELECT create_distributed_table(%s, 'conversation_id',"
                         " colocate_with => 'compaction_source.messages')",
                         (f"bench_probe.{table}",))
        keys = iter(range(10**9))

        def insert() -> None:
            conn.execute("INSERT INTO bench_probe.writes VALUES ('probe', %s)", (next(keys),))

        # Conversations in other shards than the written row's, each with whether its
        # shard is on the same node (the first of each kind).
        placed = conn.execute(
            "WITH c AS (SELECT g.n, 'other-' || g.n AS id,"
            " get_shard_id_for_distribution_column('bench_probe.counts', 'other-' || g.n)"
            " AS shard FROM pg_catalog.generate_series(1, 1000) AS g (n)),"
            " home AS (SELECT get_shard_id_for_distribution_column('bench_probe.counts',"
            " 'probe') AS shard)"
            " SELECT c.id, (SELECT p.groupid FROM pg_dist_placement AS p"
            "               WHERE p.shardid = c.shard)"
            "      = (SELECT p.groupid FROM pg_dist_placement AS p"
            "         WHERE p.shardid = home.shard)"
            " FROM c, home WHERE c.shard <> home.shard ORDER BY c.n").fetchall()
        others = {name: sql.Literal(next((i for i, near in placed if near is want), "other"))
                  .as_string(conn)
                  for name, want in (("NEAR", True), ("FAR", False))}
        plain = round(median(latencies(insert, calls)), 3)
        timed: float | None = None
        for number, (label, body) in enumerate(SHARD_TRIGGER_PROBES.items()):
            function = f"bench_probe.t{number}"
            conn.execute(
                f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$"
                f" BEGIN {body.replace('NEAR', others['NEAR']).replace('FAR', others['FAR'])};"
                " RETURN NULL; END $$")
            conn.execute(f"CREATE TRIGGER probe AFTER INSERT ON bench_probe.writes"
                         f" FOR EACH ROW EXECUTE FUNCTION {function}()")
            try:
                insert()
                outcomes[label] = "ok"
                if timed is None:
                    timed = round(median(latencies(insert, calls)), 3)
            except psycopg.Error as exc:
                outcomes[label] = f"refused: {exc.diag.message_primary}"
            conn.execute("DROP TRIGGER probe ON bench_probe.writes")
        conn.execute("DROP SCHEMA bench_probe CASCADE")
    return {"outcomes": outcomes, "insert_ms": plain, "insert_with_own_row_ms": timed}


def price_of_exactness(dsn: str, sizes: Sizes, citus: bool) -> dict[str, Any]:
    """p50 ms of a read by key, and of a read of every shard of an empty table: co-located
    with the history (as many shards as it has), and with one shard per worker node; of
    each drained range's calls; of the cross-conversation question for the projection's
    conversations; and on Citus what a trigger on a shard may do (shard_triggers)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS bench_probe")
        for name in ("colocated", "per_worker"):
            conn.execute(sql.SQL(
                "CREATE TABLE bench_probe.{} (conversation_id text, message_id text,"
                " run_id text, PRIMARY KEY (conversation_id, message_id))")
                .format(sql.Identifier(name)))
        shards = {"colocated": 1, "per_worker": 1}
        if citus:
            conn.execute("SELECT create_distributed_table('bench_probe.colocated',"
                         " 'conversation_id', colocate_with => 'compaction_source.messages')")
            workers = conn.execute("SELECT count(*) FROM pg_dist_node"
                                   " WHERE noderole = 'primary' AND groupid <> 0").fetchone()
            conn.execute("SELECT create_distributed_table('bench_probe.per_worker',"
                         " 'conversation_id', shard_count => %s, colocate_with => 'none')",
                         (int(workers[0]) if workers else 1,))
            for row in conn.execute("SELECT logicalrelid::regclass::text, count(*)"
                                    " FROM pg_dist_shard WHERE logicalrelid::regclass::text"
                                    " LIKE 'bench_probe.%' GROUP BY 1").fetchall():
                shards[str(row[0]).removeprefix("bench_probe.")] = int(row[1])
        by_key = _p50_ms(conn, "SELECT pair_count FROM compaction.conversation_state"
                               " WHERE conversation_id = 'probe'", sizes.probe_calls)
        calls = max(3, sizes.probe_calls // 10)
        first = conn.execute("SELECT t.source_hash FROM compaction.plan_targets('drain-0') AS t"
                             " WHERE t.from_pair = 0").fetchone()
        params = {"c": "drain-0", "m": OFFLINE_MODEL, "h": first[0] if first else None}
        range_calls = {name: _p50_ms(conn, query, calls, params)
                       for name, query in RANGE_CALLS.items()}
        every = {name: _p50_ms(conn, f"SELECT EXISTS (SELECT 1 FROM bench_probe.{name})",
                               sizes.probe_calls)
                 for name in ("colocated", "per_worker")}
        conn.execute("DROP SCHEMA bench_probe CASCADE")
        # As judge_runs asks it on Citus: one connection per node.
        if citus:
            conn.execute("SET citus.max_adaptive_executor_pool_size = 1")
        foreign = _p50_ms(conn, FOREIGN_RECORD, calls)
    return {"by_key_ms": by_key, "every_shard_ms": every, "shards": shards,
            "range_calls_ms": range_calls, "range_pairs": sizes.drain_pairs,
            "foreign_question_ms": foreign,
            "shard_triggers": shard_triggers(dsn, calls) if citus else None}


def run(bindir: Path, sizes: Sizes, shard_count: int = RUNBOOK_SHARD_COUNT) -> dict[str, Any]:
    results: dict[str, Any] = {"shard_count": shard_count}
    for name in ("single_node", "citus"):
        citus = name == "citus"
        setup = citus_cluster(bindir, shard_count) if citus else single_node(bindir)
        with setup as dsn:
            results[name] = {"drain": drain(dsn, sizes),
                             "long_drain": drain(dsn, sizes, "long-", 1, sizes.long_pairs),
                             "projection": projection(dsn, sizes),
                             "cycles": cycles(dsn, sizes),
                             "appends": appends(dsn, sizes, citus),
                             "probe": price_of_exactness(dsn, sizes, citus)}
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT compaction.derived_state_status()").fetchone()
                results[name]["derived_state"] = row[0] if row else None
                if citus:
                    row = conn.execute("SELECT citus_version(), version()").fetchone()
                    results["server"] = f"{row[0]} | {row[1]}" if row else "unknown"
    one, citus_run = results["single_node"], results["citus"]
    large = str(sizes.projection_pairs[-1])
    drain_ratio = citus_run["drain"]["seconds"] / one["drain"]["seconds"]
    long_ratio = citus_run["long_drain"]["seconds"] / one["long_drain"]["seconds"]
    projection_ratio = (citus_run["projection"]["p50_ms"][large]
                        / one["projection"]["p50_ms"][large])
    audit_ratio = (citus_run["cycles"]["audit_stale_summaries_ms"]
                   / one["cycles"]["audit_stale_summaries_ms"])
    results["goals"] = {
        "drain_citus_over_single": round(drain_ratio, 2),
        "drain_met": drain_ratio <= 3,
        "long_drain_citus_over_single": round(long_ratio, 2),
        "long_drain_met": long_ratio <= 3,
        "projection_citus_over_single": round(projection_ratio, 2),
        "projection_met": projection_ratio <= 3,
        "projection_large_over_small_citus": citus_run["projection"]["large_over_small"],
        "projection_scaling_met": citus_run["projection"]["large_over_small"] <= 1.5,
        "append_tracked_over_untracked_citus": citus_run["appends"]["tracked_over_untracked"],
        "append_met": citus_run["appends"]["tracked_over_untracked"] <= 2,
        "audit_citus_over_single": round(audit_ratio, 2),
        "audit_met": audit_ratio <= 3,
    }
    return results


def markdown(results: dict[str, Any], sizes: Sizes, label: str) -> str:
    one, citus, goals = results["single_node"], results["citus"], results["goals"]
    small, large = str(sizes.projection_pairs[0]), str(sizes.projection_pairs[-1])

    def met(flag: bool) -> str:
        return "yes" if flag else "no"

    def ratio(a: float, b: float) -> str:
        return str(round(a / b, 2)) if b else "-"

    lines = [
        f"## {label} (scale-out run, `make bench-citus`)", "",
        f"{results['server']}; a coordinator and two workers on loopback against one node,"
        f" both durable; the engine in {results['shard_count']} shards; derived state: one node"
        f" {one['derived_state']}, Citus {citus['derived_state']}.", "",
        "| workload | one node | Citus | Citus / one node | goal | met |",
        "|---|---:|---:|---:|---|---|",
        f"| drain: {one['drain']['ranges']} ranges of {one['drain']['conversations']}"
        f" conversations, `worker --once --concurrency 4` (s) | {one['drain']['seconds']}"
        f" | {citus['drain']['seconds']} | {goals['drain_citus_over_single']} | <= 3 |"
        f" {met(goals['drain_met'])} |",
        f"| drain: one conversation of {sizes.long_pairs:,} pairs,"
        f" {one['long_drain']['ranges']} ranges, the same pass (s) |"
        f" {one['long_drain']['seconds']} | {citus['long_drain']['seconds']} |"
        f" {goals['long_drain_citus_over_single']} | <= 3 | {met(goals['long_drain_met'])} |",
    ]
    for pairs in (str(p) for p in sizes.projection_pairs):
        single = one["projection"]["p50_ms"][pairs]
        distributed = citus["projection"]["p50_ms"][pairs]
        goal, flag = ("<= 3", met(goals["projection_met"])) if pairs == large else ("", "")
        lines.append(f"| `project_history` 64 KiB, {pairs} pairs, p50 (ms) | {single} |"
                     f" {distributed} | {ratio(distributed, single)} | {goal} | {flag} |")
    lines += [
        f"| p50 at {large} pairs / p50 at {small} pairs | {one['projection']['large_over_small']}"
        f" | {citus['projection']['large_over_small']} | | <= 1.5 on Citus |"
        f" {met(goals['projection_scaling_met'])} |",
        f"| tracked append (a Run: 3 statements, one transaction) to {one['appends']['pairs']}"
        f" pairs, p50 (ms) | {one['appends']['tracked_ms']} | {citus['appends']['tracked_ms']}"
        f" | {ratio(citus['appends']['tracked_ms'], one['appends']['tracked_ms'])} | | |",
        f"| the same, untracked (tables without the triggers), p50 (ms) |"
        f" {one['appends']['untracked_ms']} | {citus['appends']['untracked_ms']} |"
        f" {ratio(citus['appends']['untracked_ms'], one['appends']['untracked_ms'])} | | |",
        f"| tracked / untracked append | {one['appends']['tracked_over_untracked']} |"
        f" {citus['appends']['tracked_over_untracked']} | | <= 2 on Citus |"
        f" {met(goals['append_met'])} |",
        f"| `claim` -> `complete` of one range, p50 (ms) | {one['cycles']['claim_complete_ms']}"
        f" | {citus['cycles']['claim_complete_ms']} |"
        f" {ratio(citus['cycles']['claim_complete_ms'], one['cycles']['claim_complete_ms'])}"
        " | | |",
        f"| `audit_stale_summaries` read whole, p50 (ms) |"
        f" {one['cycles']['audit_stale_summaries_ms']} |"
        f" {citus['cycles']['audit_stale_summaries_ms']} | {goals['audit_citus_over_single']}"
        f" | <= 3 | {met(goals['audit_met'])} |",
        "",
        "The price of exactness (p50 ms of one statement):",
        "",
        "| statement | one node | Citus | Citus / one node's projection at"
        f" {large} pairs |",
        "|---|---:|---:|---:|",
    ]
    base = one["projection"]["p50_ms"][large]
    probes = [("a read by key (`conversation_state`)", one["probe"]["by_key_ms"],
               citus["probe"]["by_key_ms"])]
    for name, what in (("colocated", "co-located with the history"),
                       ("per_worker", "one shard per worker")):
        probes.append((f"a read of every shard of an empty table, {what}"
                       f" ({citus['probe']['shards'][name]} shards)",
                       one["probe"]["every_shard_ms"][name],
                       citus["probe"]["every_shard_ms"][name]))
    probes.append(("[§3](contract.md#3-eligible-pairs)'s cross-conversation question, as"
                   " every read asks it first: the record of foreign messages read whole",
                   one["probe"]["foreign_question_ms"], citus["probe"]["foreign_question_ms"]))
    for what, single, distributed in probes:
        lines.append(f"| {what} | {single} | {distributed} |"
                     f" {round(distributed / base, 2) if base else '-'} |")
    triggers = citus["probe"]["shard_triggers"]
    lines += [
        "",
        "What a row trigger on a shard may do (`citus.enable_unsafe_triggers` on; a one-row"
        f" insert into a table co-located with the history: {triggers['insert_ms']} ms"
        f" p50 without a trigger, {triggers['insert_with_own_row_ms']} ms with the first):",
        "",
        "| the trigger's body | outcome |",
        "|---|---|",
    ]
    for label, outcome in triggers["outcomes"].items():
        lines.append(f"| {label} | {outcome} |")
    lines += [
        "",
        f"What a drained range's calls cost (p50 ms, a conversation of"
        f" {one['probe']['range_pairs']} pairs; each reads the derived state where it is in"
        " use):",
        "",
        "| call | one node | Citus | Citus / one node |",
        "|---|---:|---:|---:|",
    ]
    for name in RANGE_CALLS:
        single, distributed = (one["probe"]["range_calls_ms"][name],
                               citus["probe"]["range_calls_ms"][name])
        label = ("an admission slot written and committed (a reference table on Citus)"
                 if name == "admission_write" else f"`{name}`")
        lines.append(f"| {label} | {single} | {distributed} |"
                     f" {round(distributed / single, 1) if single else '-'} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_out",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--pg-config", required=True,
                        help="pg_config of a PostgreSQL with Citus installed")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--shard-count", type=int, default=RUNBOOK_SHARD_COUNT,
                        help="the engine's shard count on Citus (default: the runbook's,"
                             f" {RUNBOOK_SHARD_COUNT})")
    parser.add_argument("--out", type=Path, default=None,
                        help="write scale_out.json and scale_out.md into this directory"
                             " instead of bench/results/")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    bindir = bindir_of(args.pg_config)
    results = run(bindir, sizes, args.shard_count)
    label = datetime.now(UTC).isoformat(timespec="seconds")
    text = markdown(results, sizes, label)
    print(text, flush=True)
    out = args.out or ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_out.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "scale_out.md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
