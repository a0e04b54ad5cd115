"""Benchmark 3: finding work. One `pycompactor worker --once` pass, in-process.

10,000 conversations of 35 pairs, the queue drained (everything was looked at before).
An idle pass is timed with 100 conversations in the database and again with 10,000; a
busy pass after 10 conversations got 10 new pairs each (the reference tables' trigger
enqueues them; their range 0 was summarized earlier, so range 1 is the new work). The
offline summarizer `pycompactor/extractive-1` stands in for the model.

Statements are counted exactly, by a cursor that records every statement the worker
sends. Whether a pass read message text is answered by the server's own statistics on
compaction_source.messages and its TOAST table (scans and blocks), read after the
worker's connections have closed (a backend flushes its statistics on exit).
"""

from __future__ import annotations

import io
import time
from collections import Counter
from typing import Any, ClassVar

import psycopg

from bench.common import (
    REPETITIONS,
    Conn,
    Sizes,
    drain_queue,
    import_all_targets,
    median,
    percentile,
    seed_conversations,
    text_pool,
    vacuum_analyze,
)
from pycompactor.summarizers.extractive import OFFLINE_MODEL, ExtractiveSummarizer
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig

_APP = "bench-finding-worker"


class CountingCursor(psycopg.Cursor[Any]):
    """Counts every statement the worker sends, by the engine function it calls."""

    calls: ClassVar[Counter[str]] = Counter()

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        # An inline call (db._call) is one query of two statements, its timeouts' and
        # the call: both count, as when they travel in a pipeline.
        for statement in str(query).split("; SELECT ", 1):
            CountingCursor.calls[_function_of(statement)] += 1
        return super().execute(query, params, **kwargs)


def _function_of(text: str) -> str:
    """What a statement calls: an engine function, or set_config (the driver's
    transaction-local lock and statement timeouts before each call)."""
    if "compaction." in text:
        return text[text.index("compaction."):].split("(")[0]
    if "set_config" in text:
        return "set_config"
    return text.split()[0].lower()


_MESSAGE_IO = """
SELECT coalesce(t.seq_scan, 0) + coalesce(t.idx_scan, 0),
       coalesce(io.heap_blks_read, 0) + coalesce(io.heap_blks_hit, 0)
         + coalesce(io.toast_blks_read, 0) + coalesce(io.toast_blks_hit, 0),
       coalesce(t.seq_tup_read, 0) + coalesce(t.idx_tup_fetch, 0)
FROM pg_stat_user_tables t JOIN pg_statio_user_tables io USING (relid)
WHERE t.schemaname = 'compaction_source' AND t.relname = 'messages'
"""


def _message_io(conn: Conn) -> tuple[int, int, int]:
    """(scans, heap + TOAST blocks touched, rows read) of the messages table so far."""
    # This (seeding) connection's own counts are flushed lazily, up to seconds later:
    # force them out now, so they never land inside a measured interval.
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")
    # Backends flush their statistics when they exit: wait for every other client of this
    # database (the worker's connections, the last VACUUM's) to be gone.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity"
                           " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                           " AND backend_type = 'client backend'").fetchone()
        if row is not None and row[0] == 0:
            break
        time.sleep(0.02)
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(_MESSAGE_IO).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _one_pass(dsn: str) -> tuple[float, Counter[str], int]:
    """Seconds, statements by function, and conversations claimed, for one --once pass."""
    CountingCursor.calls = Counter()
    config = WorkerConfig(model=OFFLINE_MODEL, dsn=dsn, once=True, log_format="json")
    worker = Worker(config, ExtractiveSummarizer(),
                    connect=lambda: psycopg.connect(dsn, autocommit=True,
                                                    application_name=_APP,
                                                    cursor_factory=CountingCursor),
                    log=EventLog("json", stream=io.StringIO()))
    started = time.perf_counter()
    report = worker.run()
    seconds = time.perf_counter() - started
    return seconds, Counter(CountingCursor.calls), report.claimed


def _idle(dsn: str, admin: Conn, conversations: int, sizes: Sizes) -> dict[str, Any]:
    _one_pass(dsn)  # warm-up
    before = _message_io(admin)
    p50s: list[float] = []
    statements: set[int] = set()
    calls: Counter[str] = Counter()
    for _ in range(REPETITIONS):
        sample: list[float] = []
        for _ in range(sizes.finding_idle_passes):
            seconds, calls, claimed = _one_pass(dsn)
            if claimed:
                raise RuntimeError("the idle pass claimed work: the queue was not drained")
            sample.append(seconds * 1000)
            statements.add(sum(calls.values()))
        p50s.append(percentile(sample, 50))
    after = _message_io(admin)
    return {
        "conversations": conversations,
        "pass_p50_ms": median(p50s),
        "pass_p50_ms_reps": p50s,
        "statements_per_pass": sorted(statements),
        "statements_by_function": dict(calls),
        "message_scans": after[0] - before[0],
        "message_blocks": after[1] - before[1],
    }


def run(dsn: str, sizes: Sizes) -> dict[str, Any]:
    users = text_pool(31, 16, 120)
    replies = text_pool(32, 32, 300)
    n_changed = sizes.finding_changed * (REPETITIONS + 1)  # warm-up + each repetition
    with psycopg.connect(dsn, autocommit=True) as admin:
        # The statistics must show the worker's reads only: VACUUM runs explicitly instead.
        admin.execute("ALTER TABLE compaction_source.messages SET (autovacuum_enabled = off,"
                      " toast.autovacuum_enabled = off)")
        seed_conversations(admin, "fw-", 0, sizes.finding_small, sizes.finding_pairs,
                           user_pool=users, assistant_pool=replies)
        drain_queue(admin)
        vacuum_analyze(dsn)
        idle_small = _idle(dsn, admin, sizes.finding_small, sizes)

        # In chunks, so no single statement has to sort and index 700,000 rows at once.
        chunk = 2_000
        for first in range(sizes.finding_small, sizes.finding_conversations, chunk):
            seed_conversations(admin, "fw-", first,
                               min(chunk, sizes.finding_conversations - first),
                               sizes.finding_pairs, user_pool=users, assistant_pool=replies)
        # Steady state for the conversations that will change: their one target (range 0)
        # was summarized long ago, so a busy pass has exactly the new range 1 to do.
        changed = [f"fw-{i}" for i in range(n_changed)]
        vacuum_analyze(dsn)
        import_all_targets(admin, changed, text_pool(33, 1, 800)[0], model=OFFLINE_MODEL)
        drain_queue(admin)
        vacuum_analyze(dsn)
        row = admin.execute("SELECT count(*) FROM compaction_source.conversations").fetchone()
        total = int(row[0]) if row else 0
        idle_large = _idle(dsn, admin, total, sizes)

        busy_ms: list[float] = []
        busy_statements: list[dict[str, int]] = []
        busy_claimed: list[int] = []
        busy_rows: list[int] = []
        after_ms: list[float] = []
        after_statements: list[dict[str, int]] = []
        for rep in range(REPETITIONS + 1):
            # Start from an empty queue: the previous pass put its conversations back.
            drain_queue(admin)
            # 10 new pairs in each of the next 10 conversations; the trigger enqueues them.
            seed_conversations(admin, "fw-", rep * sizes.finding_changed,
                               sizes.finding_changed, sizes.finding_new_pairs,
                               user_pool=users, assistant_pool=replies,
                               first_pair=sizes.finding_pairs)
            before = _message_io(admin)
            seconds, calls, claimed = _one_pass(dsn)
            rows_read = _message_io(admin)[2] - before[2]
            # The next pass meets the entries the busy pass put back (crash insurance
            # after each claim): nothing is left to do, but each is examined again.
            later, later_calls, _ = _one_pass(dsn)
            if rep == 0:
                continue  # warm-up
            busy_ms.append(seconds * 1000)
            busy_statements.append(dict(calls))
            busy_claimed.append(claimed)
            busy_rows.append(rows_read)
            after_ms.append(later * 1000)
            after_statements.append(dict(later_calls))
    return {
        "idle": [idle_small, idle_large],
        "busy": {
            "conversations": total,
            "changed_conversations": sizes.finding_changed,
            "new_pairs_each": sizes.finding_new_pairs,
            "pass_ms_reps": busy_ms,
            "pass_ms": median(busy_ms),
            "claimed_reps": busy_claimed,
            "message_rows_read_reps": busy_rows,
            "message_rows_per_claimed_range": max(
                (r / c for r, c in zip(busy_rows, busy_claimed, strict=True) if c),
                default=None),
            "statements_per_pass": [sum(c.values()) for c in busy_statements],
            "statements_by_function": busy_statements[-1],
        },
        "after_busy": {
            "conversations": total,
            "pass_ms": median(after_ms),
            "pass_ms_reps": after_ms,
            "statements_per_pass": [sum(c.values()) for c in after_statements],
            "statements_by_function": after_statements[-1],
        },
    }
