"""Shared machinery of the benchmarks: sizes, the cluster, seeding, text, timing, statistics.

Every benchmark gets its own database, cloned from one migrated template, so the 700,000
messages of the finding-work benchmark never inflate the indexes the claim cycle uses.
"""

from __future__ import annotations

import math
import platform
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from pycompactor import schema
from pycompactor.cli.cluster import ThrowawayCluster

Conn = psycopg.Connection[Any]

REPETITIONS = 3


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each benchmark does; `smoke` shrinks everything to seconds."""

    smoke: bool
    # 1. claim -> complete: cycles per repetition (split over K connections), warm-up cycles.
    claim_cycles: int
    claim_warmup: int
    claim_connections: tuple[int, ...]
    claim_pairs: int  # pairs per conversation: 30..39 gives exactly one target (range 0)
    # 2. projection
    projection_pairs: tuple[int, ...]
    projection_budgets: tuple[int, ...]
    projection_ops: int
    projection_warmup: int
    reply_bytes: int
    # 3. finding work
    finding_conversations: int
    finding_small: int  # the idle pass is also timed with this many conversations
    finding_pairs: int
    finding_changed: int  # conversations that get new pairs before a busy pass
    finding_new_pairs: int
    finding_idle_passes: int
    # 4. hashing
    hash_calls: int
    hash_sql_calls: int
    # 5. writing: pairs of the bulk-loaded conversation, Runs appended to it per repetition,
    # and conversations of 5 pairs written first (most of a real database's conversations
    # are short: generic plans are priced for them)
    write_pairs: int
    write_appends: int
    write_crowd: int
    # 6. profile: operations of each kind measured under pg_stat_statements
    profile_ops: int
    # 7. quality: conversations of the evaluation corpus (None: the corpus's own size)
    quality_conversations: int | None
    # 8. instructions: claim -> complete cycles (warm-up, measured) under callgrind
    instruction_cycles: tuple[int, int]


FULL = Sizes(
    smoke=False,
    claim_cycles=240, claim_warmup=24, claim_connections=(1, 2, 8), claim_pairs=35,
    projection_pairs=(100, 1_000, 10_000), projection_budgets=(16 * 1024, 64 * 1024, 1024 * 1024),
    projection_ops=30, projection_warmup=5, reply_bytes=2048,
    finding_conversations=10_000, finding_small=100, finding_pairs=35, finding_changed=10,
    finding_new_pairs=10, finding_idle_passes=20,
    hash_calls=20_000, hash_sql_calls=300,
    write_pairs=10_000, write_appends=100, write_crowd=2_000,
    profile_ops=300,
    quality_conversations=None,
    instruction_cycles=(60, 250),
)

SMOKE = Sizes(
    smoke=True,
    claim_cycles=8, claim_warmup=8, claim_connections=(1, 2, 8), claim_pairs=35,
    projection_pairs=(40, 60, 100), projection_budgets=(16 * 1024, 64 * 1024, 1024 * 1024),
    projection_ops=2, projection_warmup=1, reply_bytes=512,
    finding_conversations=30, finding_small=10, finding_pairs=35, finding_changed=2,
    finding_new_pairs=10, finding_idle_passes=2,
    hash_calls=50, hash_sql_calls=5,
    write_pairs=100, write_appends=5, write_crowd=20,
    profile_ops=5,
    quality_conversations=3,
    instruction_cycles=(3, 5),
)


# --------------------------------------------------------------------------- the cluster


class BenchCluster:
    """A durable throwaway cluster with a migrated template; one database per benchmark."""

    TEMPLATE = "bench_template"

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.cluster = ThrowawayCluster(durable=True, settings=settings)

    def __enter__(self) -> BenchCluster:
        self.cluster.__enter__()
        with psycopg.connect(self.cluster.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'")
                          .format(sql.Identifier(self.TEMPLATE)))
        schema.upgrade(self.dsn_for(self.TEMPLATE))
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.cluster.port} user=postgres dbname={dbname}"

    def new_database(self, label: str) -> str:
        name = f"bench_{label}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(self.cluster.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(self.TEMPLATE)))
        return self.dsn_for(name)

    def settings(self) -> dict[str, str]:
        with psycopg.connect(self.cluster.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('fsync',"
                " 'synchronous_commit', 'full_page_writes', 'shared_buffers', 'wal_sync_method',"
                " 'server_version', 'max_connections')").fetchall()
        return {str(name): str(value) for name, value in rows}


# --------------------------------------------------------------------------- text

# Mixed scripts, as agents' replies are: Latin with figures, Chinese, emoji.
_LATIN = (
    "The fund's net asset value rose {a}.{b}% in March, ahead of its benchmark.",
    "Morningstar rates it {a} stars; the ongoing charge is 0.{b}% a year.",
    "We compared {a} share classes and kept the accumulating one in EUR.",
    "Café owners in Zürich asked about the naïve façade of the coöperative, again.",
    "Risk indicator {a} of 7: volatility stayed near {b}% over five years.",
)
_CHINESE = (
    "该基金在第{a}季度的净值上涨了百分之{b}。",
    "我们建议继续持有，并在下个月重新评估风险。",
    "晨星评级为{a}星，管理费用约为百分之零点{b}。",
    "请注意汇率波动对人民币计价份额的影响。",
)
_EMOJI = ("📈", "🚀", "✅", "🙂", "💶", "🧾", "🇪🇺", "👩‍💻")


def mixed_text(rng: random.Random, target_bytes: int) -> str:
    """A reply of about `target_bytes` UTF-8 bytes mixing Latin, Chinese and emoji."""
    parts: list[str] = []
    size = 0
    while size < target_bytes:
        kind = rng.random()
        if kind < 0.55:
            piece = rng.choice(_LATIN).format(a=rng.randint(1, 9), b=rng.randint(10, 99))
        elif kind < 0.9:
            piece = rng.choice(_CHINESE).format(a=rng.randint(1, 4), b=rng.randint(1, 9))
        else:
            piece = rng.choice(_EMOJI) * rng.randint(1, 3)
        parts.append(piece)
        size += len(piece.encode("utf-8")) + 1
    return " ".join(parts)


def text_pool(seed: int, count: int, target_bytes: int) -> list[str]:
    rng = random.Random(seed)
    return [mixed_text(rng, target_bytes) for _ in range(count)]


# --------------------------------------------------------------------------- seeding


def seed_conversations(conn: Conn, prefix: str, first: int, count: int, pairs: int, *,
                       user_pool: Sequence[str], assistant_pool: Sequence[str],
                       first_pair: int = 0) -> None:
    """Conversations `{prefix}{first..first+count-1}` with `pairs` pairs each, in SQL.

    generate_series writes each table in one statement, so the reference tables' enqueue
    trigger fires once per statement. Ids are fixed-width per pair, seq is 2p (user) and
    2p + 1 (assistant); `first_pair` appends pairs to existing conversations. Texts come
    from the pools, chosen by (conversation, pair), with the pair number appended.
    """
    params = {"prefix": prefix, "first": first, "last": first + count - 1,
              "p0": first_pair, "p1": first_pair + pairs - 1,
              "users": list(user_pool), "assistants": list(assistant_pool)}
    if first_pair == 0:
        conn.execute(
            "INSERT INTO compaction_source.conversations"
            " SELECT %(prefix)s || c FROM generate_series(%(first)s::int, %(last)s::int) c",
            params)
    conn.execute(
        "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
        " SELECT %(prefix)s || c || '-r' || lpad(p::text, 6, '0'), %(prefix)s || c,"
        "        'completed', now()"
        " FROM generate_series(%(first)s::int, %(last)s::int) c,"
        "      generate_series(%(p0)s::int, %(p1)s::int) p",
        params)
    conn.execute(
        "INSERT INTO compaction_source.messages"
        " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
        " SELECT %(prefix)s || c || '-' || left(role, 1) || lpad(p::text, 6, '0'),"
        "        %(prefix)s || c, %(prefix)s || c || '-r' || lpad(p::text, 6, '0'),"
        "        role, 'completed',"
        "        CASE role WHEN 'user'"
        "            THEN (%(users)s::text[])[1 + (c * 7 + p) %% cardinality(%(users)s::text[])]"
        "            ELSE (%(assistants)s::text[])"
        "                 [1 + (c * 13 + p) %% cardinality(%(assistants)s::text[])]"
        "        END || ' #' || p,"
        "        2 * p + (role = 'assistant')::int, now()"
        " FROM generate_series(%(first)s::int, %(last)s::int) c,"
        "      generate_series(%(p0)s::int, %(p1)s::int) p,"
        "      unnest(ARRAY['user', 'assistant']) role",
        params)


def drain_queue(conn: Conn) -> int:
    """Empty the work queue through compaction.dequeue and compaction.ack, scope by scope
    (seeding enqueued everything)."""
    taken = 0
    scopes = [str(r[0]) for r in conn.execute("SELECT DISTINCT scope FROM compaction.queue")]
    for scope in scopes:
        while True:
            row = conn.execute(
                # the most one dequeue takes
                "SELECT count(*) FROM compaction.dequeue(%s::text, 1000) AS d,"
                " LATERAL compaction.ack(d.conversation_id, d.scope, d.lease_token) AS a",
                (scope,)).fetchone()
            n = int(row[0]) if row else 0
            taken += n
            if n == 0:
                break
    return taken


def import_all_targets(conn: Conn, conversation_ids: Sequence[str], summary: str,
                       model: str = "bench/imported") -> int:
    """Summarize every current target of the conversations (import_summary, @3), in SQL.

    The ids and hash come from compaction.plan_targets, so every summary is valid and
    projectable. `model` is part of the identity: a worker running another model would
    see these ranges as still to do. Returns how many were imported.
    """
    row = conn.execute(
        "SELECT count(compaction.import_summary(c, 'default', t.from_pair,"
        "        t.source_message_ids, t.source_hash, %(model)s::text,"
        "        'conversation-compaction@3', %(summary)s::text || ' (pairs ' || t.from_pair"
        "        || '+)', now()))"
        " FROM unnest(%(ids)s::text[]) c, compaction.plan_targets(c) t",
        {"ids": list(conversation_ids), "summary": summary, "model": model}).fetchone()
    return int(row[0]) if row else 0


def vacuum_analyze(dsn: str) -> None:
    """Settle visibility maps and statistics after seeding (as autovacuum would, later)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed(operation: Callable[[], object]) -> float:
    """Seconds one call takes."""
    started = time.perf_counter()
    operation()
    return time.perf_counter() - started


def latencies(operation: Callable[[], object], ops: int) -> list[float]:
    """Latency in milliseconds of each of `ops` calls."""
    return [timed(operation) * 1000 for _ in range(ops)]


def ratio(numerator: float, denominator: float) -> float | None:
    return None if denominator == 0 else numerator / denominator


T = TypeVar("T")


def rotated(sides: Sequence[T], rep: int) -> list[T]:
    """The sides of a comparison, starting with a different one in each repetition, so
    drift between them favours none."""
    k = rep % len(sides)
    return [*sides[k:], *sides[:k]]


# --------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
