"""Benchmark 4: source binding. `pycompactor.source_hash` against bare hashlib, and the SQL.

Python: one range of 10 pairs, each user and assistant message about 2 KB in mixed
scripts. The physical limit is hashlib.sha256 over the very bytes the contract hashes,
already encoded and length-prefixed in one buffer; source_hash has to encode the texts
and feed the length prefixes itself. SQL: compaction.source_hash(conversation, 0) per
call, next to compaction.range_hash (the hash alone, given the 20 ids) and `SELECT 1`
(the round trip), on a 35-pair and a 1,000-pair conversation: source_hash numbers every
pair first (compaction.indexed_pairs), so its cost follows the conversation's length.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.common import (
    REPETITIONS,
    Sizes,
    drain_queue,
    latencies,
    median,
    percentile,
    ratio,
    seed_conversations,
    text_pool,
    vacuum_analyze,
)
from pycompactor import source_hash
from pycompactor.models import Pair


def _pairs(message_bytes: int, *, ascii_only: bool = False) -> list[Pair]:
    if ascii_only:
        users = [f"question {i} " + "x" * message_bytes for i in range(10)]
        replies = [f"answer {i} " + "y" * message_bytes for i in range(10)]
    else:
        users = text_pool(41, 10, message_bytes)
        replies = text_pool(42, 10, message_bytes)
    return [Pair(i, f"run-{i:04d}", f"msg-u-{i:04d}", users[i], f"msg-a-{i:04d}", replies[i])
            for i in range(10)]


def _fields(pairs: list[Pair]) -> list[str]:
    return [f for p in pairs for f in (p.user_message_id, p.user_content,
                                       p.assistant_message_id, p.assistant_content)]


def _contract_bytes(pairs: list[Pair]) -> bytes:
    chunks: list[bytes] = []
    for field in _fields(pairs):
        data = field.encode("utf-8")
        chunks += (len(data).to_bytes(4, "big"), data)
    return b"".join(chunks)


def _throughput(operation: Callable[[], object], calls: int, nbytes: int) -> float:
    """MB/s (10^6 bytes) over `calls` calls of an operation hashing `nbytes`."""
    started = time.perf_counter()
    for _ in range(calls):
        operation()
    return calls * nbytes / (time.perf_counter() - started) / 1e6


def _python(pairs: list[Pair], sizes: Sizes) -> dict[str, Any]:
    data = _contract_bytes(pairs)
    fields = _fields(pairs)
    if hashlib.sha256(data).hexdigest() != source_hash(pairs):
        raise RuntimeError("the baseline does not hash the contract's bytes")

    def ours() -> None:
        source_hash(pairs)

    def bare() -> None:
        hashlib.sha256(data).hexdigest()

    def encode_and_hash() -> None:
        # The floor for any implementation that is handed str: UTF-8 encoding is part
        # of the contract's bytes, so it cannot be skipped (only the prefixes are left out).
        hashlib.sha256(b"".join([f.encode("utf-8") for f in fields])).hexdigest()

    operations: list[tuple[Callable[[], None], list[float]]] = [
        (ours, []), (bare, []), (encode_and_hash, [])]
    for operation, _ in operations:
        _throughput(operation, max(1, sizes.hash_calls // 10), len(data))
    for rep in range(REPETITIONS):
        for operation, sink in operations if rep % 2 == 0 else operations[::-1]:
            sink.append(_throughput(operation, sizes.hash_calls, len(data)))
    ours_mbs, bare_mbs, floor_mbs = (sink for _, sink in operations)
    return {
        "bytes_per_range": len(data),
        "source_hash_mb_s": median(ours_mbs),
        "hashlib_mb_s": median(bare_mbs),
        "encode_and_hashlib_mb_s": median(floor_mbs),
        "source_hash_mb_s_reps": ours_mbs,
        "hashlib_mb_s_reps": bare_mbs,
        "source_hash_us_per_call": len(data) / median(ours_mbs),
        "ratio": ratio(median(ours_mbs), median(bare_mbs)),
        "ratio_vs_encode_and_hashlib": ratio(median(ours_mbs), median(floor_mbs)),
    }


def run(dsn: str, sizes: Sizes) -> dict[str, Any]:
    return {
        # Mixed scripts (Latin, Chinese, emoji: CPython stores these str as 4 bytes per
        # character, and encoding them is real work) and plain ASCII (encoding is a copy).
        "python": _python(_pairs(2048), sizes),
        "python_ascii": _python(_pairs(2048, ascii_only=True), sizes),
        "sql": _sql(dsn, sizes),
    }


def _sql(dsn: str, sizes: Sizes) -> list[dict[str, Any]]:
    texts = text_pool(43, 32, 2048)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pairs in (35, 1_000):
            seed_conversations(conn, f"hash-{pairs}-", 0, 1, pairs,
                               user_pool=texts, assistant_pool=texts)
        drain_queue(conn)
    vacuum_analyze(dsn)
    results: list[dict[str, Any]] = []
    with psycopg.connect(dsn, autocommit=True, application_name="bench-hashing") as conn:
        for pairs in (35, 1_000):
            conversation = f"hash-{pairs}-0"
            row = conn.execute(
                "SELECT source_message_ids FROM compaction.plan_targets(%s) WHERE from_pair = 0",
                (conversation,)).fetchone()
            assert row is not None
            ids = list(row[0])
            statements: dict[str, tuple[str, Any]] = {
                "source_hash": ("SELECT compaction.source_hash(%s, 0)", (conversation,)),
                "range_hash": ("SELECT compaction.range_hash(%s, %s::text[])",
                               (conversation, ids)),
                "select_1": ("SELECT 1", None),
            }
            cell: dict[str, Any] = {"pairs": pairs}
            for name, (query, params) in statements.items():
                def call(query: str = query, params: Any = params) -> None:
                    conn.execute(query, params).fetchone()
                latencies(call, max(1, sizes.hash_sql_calls // 10))
                p50s = [percentile(latencies(call, sizes.hash_sql_calls), 50) * 1000
                        for _ in range(REPETITIONS)]
                cell[f"{name}_p50_us"] = median(p50s)
            results.append(cell)
    return results
