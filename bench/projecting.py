"""Benchmark 2: projection (`pycompactor.project_history`) against a bare newest-rows query.

Three conversations (100, 1,000 and 10,000 pairs; replies of about 2 KB in mixed scripts)
with every eligible range summarized, three budgets. The bare query is the least any
application must do: walk the conversation's messages newest first (the
(conversation_id, seq) index) and stop once the same byte budget is spent, in one
statement. The per-statement breakdown and `indexed_pairs` alone show where the rest goes.

Each cell also times the engine statements of that projection alone (as project_history
sent them: usually the one compaction.projection_read, the frame and
the texts; replayed as plain autocommit statements with their rows fetched: no planning
or rendering in Python). That is the floor of a projection that plans from metadata and
reads only the texts it includes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import psycopg

from bench.common import (
    REPETITIONS,
    Conn,
    Sizes,
    drain_queue,
    import_all_targets,
    latencies,
    median,
    percentile,
    ratio,
    rotated,
    seed_conversations,
    text_pool,
    vacuum_analyze,
)
from pycompactor import Projection, project_history
from pycompactor.projection import MESSAGE_OVERHEAD_BYTES

# The baseline, in the benchmark's own schema: a plpgsql FOR loop reads through a cursor,
# so only the rows up to the budget are fetched, exactly as project_history's budget rule
# counts them (UTF-8 bytes + 16 per message).
BARE_DDL = f"""
CREATE SCHEMA IF NOT EXISTS bench;
CREATE FUNCTION bench.newest_messages(p_conversation_id text, p_budget bigint)
RETURNS TABLE (role text, content text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_spent bigint := 0;
    v_cost  bigint;
    r       record;
BEGIN
    FOR r IN SELECT m.role, m.content FROM compaction_source.messages AS m
             WHERE m.conversation_id = p_conversation_id
             ORDER BY m.seq DESC, m.message_id DESC LOOP
        v_cost := octet_length(r.content) + {MESSAGE_OVERHEAD_BYTES};
        EXIT WHEN v_spent + v_cost > p_budget;
        v_spent := v_spent + v_cost;
        role := r.role;
        content := r.content;
        RETURN NEXT;
    END LOOP;
END
$$;
"""
BARE_SQL = "SELECT role, content FROM bench.newest_messages(%(c)s::text, %(b)s::bigint)"
_INDEXED_PAIRS_SQL = "SELECT count(*) FROM compaction.indexed_pairs(%(c)s::text)"


class TimingCursor(psycopg.Cursor[Any]):
    """Adds each read statement's wall time, from execute to its rows fetched, to a shared
    dict (a statement sent in a pipeline gets its rows when the pipeline is synced)."""

    timings: ClassVar[dict[str, list[float]]] = {}
    recording: ClassVar[bool] = False
    #: While not None, every engine statement executed, with its parameters.
    captured: ClassVar[list[tuple[str, Any]] | None] = None

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        self._started = (str(query), time.perf_counter())
        if TimingCursor.captured is not None and "compaction." in str(query):
            TimingCursor.captured.append((str(query), params))
        return super().execute(query, params, **kwargs)

    def fetchall(self) -> list[Any]:
        rows = super().fetchall()
        if TimingCursor.recording:
            text, started = self._started
            name = text[text.index("compaction."):].split("(")[0] \
                if "compaction." in text else text.split()[0].lower()
            TimingCursor.timings.setdefault(name, []).append(
                (time.perf_counter() - started) * 1000)
        return rows


@contextmanager
def _recording() -> Iterator[dict[str, list[float]]]:
    TimingCursor.timings = {}
    TimingCursor.recording = True
    try:
        yield TimingCursor.timings
    finally:
        TimingCursor.recording = False


def project_recorded(conn: Conn, conversation: str,
                     budget: int) -> tuple[Projection, list[tuple[str, Any]]]:
    """One project_history call, and the engine statements it sent (conn's cursors must
    be TimingCursor), in order, with their parameters."""
    statements: list[tuple[str, Any]] = []
    TimingCursor.captured = statements
    try:
        return project_history(conn, conversation, budget_bytes=budget), statements
    finally:
        TimingCursor.captured = None


def conversation_of(pairs: int) -> str:
    """The conversation `prepare_conversations` made with `pairs` pairs."""
    return f"proj-{pairs}0"


def prepare_conversations(dsn: str, sizes: Sizes, pair_counts: Sequence[int]) -> int:
    """The bare query's function, and one conversation per pair count (conversation_of)
    with every target summarized; returns how many summaries were imported."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BARE_DDL)
        users = text_pool(21, 32, 240)
        replies = text_pool(22, 64, sizes.reply_bytes)
        for pairs in pair_counts:
            seed_conversations(conn, f"proj-{pairs}", 0, 1, pairs,
                               user_pool=users, assistant_pool=replies)
        drain_queue(conn)
        vacuum_analyze(dsn)
        summary = text_pool(23, 1, 1500)[0]
        imported = import_all_targets(conn, [conversation_of(p) for p in pair_counts], summary)
    vacuum_analyze(dsn)
    return imported


def run(dsn: str, sizes: Sizes) -> dict[str, Any]:
    imported = prepare_conversations(dsn, sizes, sizes.projection_pairs)

    cells: list[dict[str, Any]] = []
    judging: list[dict[str, Any]] = []
    breakdown: list[dict[str, Any]] = []
    with psycopg.connect(dsn, autocommit=True, cursor_factory=TimingCursor,
                         application_name="bench-projection") as conn:
        for pairs in sizes.projection_pairs:
            conversation = conversation_of(pairs)
            for budget in sizes.projection_budgets:
                cells.append(_measure_cell(conn, conversation, pairs, budget, sizes))
            judging.append(_measure_judging(conn, conversation, pairs, sizes))
            breakdown.append(_measure_breakdown(conn, conversation, pairs, sizes))

        judged_views = [_measure_from_the_views(conn, conversation_of(pairs), pairs, sizes)
                        for pairs in sizes.projection_pairs]

    scaling: list[dict[str, Any]] = []
    smallest, largest = min(sizes.projection_pairs), max(sizes.projection_pairs)
    for budget in sizes.projection_budgets:
        p50 = {c["pairs"]: c["pycompactor_p50_ms"] for c in cells if c["budget_bytes"] == budget}
        scaling.append({"budget_bytes": budget, "small_pairs": smallest,
                        "large_pairs": largest,
                        "ratio_large_over_small": ratio(p50[largest], p50[smallest])})
    return {"summaries_imported": imported, "cells": cells, "scaling": scaling,
            "indexed_pairs": judging, "breakdown_64k": breakdown,
            "from_the_views_64k": judged_views}


def _measure_from_the_views(conn: Conn, conversation: str, pairs: int,
                            sizes: Sizes) -> dict[str, Any]:
    """project_history at 64 KiB with the derived state out of use (a tracking trigger
    disabled, as before an install's rebuild has finished): every
    call judges the conversation from the views and hashes each summarized range. The
    trigger is enabled again and the derived state rebuilt afterwards."""
    budget = 64 * 1024

    def ours() -> None:
        project_history(conn, conversation, budget_bytes=budget)

    derived = percentile(latencies(ours, sizes.projection_ops), 50)
    conn.execute("ALTER TABLE compaction_source.runs DISABLE TRIGGER runs_track_insert")
    try:
        row = conn.execute("SELECT compaction.derived_state_current()").fetchone()
        assert row == (False,), row
        ours()
        views = percentile(latencies(ours, max(3, sizes.projection_ops // 20)), 50)
    finally:
        conn.execute("ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_insert")
        conn.execute("CALL compaction.rebuild_derived_state()")
    return {"pairs": pairs, "budget_bytes": budget, "derived_p50_ms": derived,
            "from_the_views_p50_ms": views, "ratio": ratio(views, derived)}


def _measure_cell(conn: Conn, conversation: str, pairs: int, budget: int,
                  sizes: Sizes) -> dict[str, Any]:
    def ours() -> None:
        project_history(conn, conversation, budget_bytes=budget)

    def bare() -> None:
        conn.execute(BARE_SQL, {"c": conversation, "b": budget}).fetchall()

    check, statements = project_recorded(conn, conversation, budget)

    def alone() -> None:
        for query, params in statements:
            conn.execute(query, params).fetchall()

    bare_rows = conn.execute(BARE_SQL, {"c": conversation, "b": budget}).fetchall()
    latencies(ours, sizes.projection_warmup)
    latencies(bare, sizes.projection_warmup)
    latencies(alone, sizes.projection_warmup)
    ours_p50: list[float] = []
    ours_p95: list[float] = []
    bare_p50: list[float] = []
    bare_p95: list[float] = []
    alone_p50: list[float] = []
    alone_p95: list[float] = []
    for rep in range(REPETITIONS):
        for operation, p50s, p95s in rotated([(ours, ours_p50, ours_p95),
                                              (bare, bare_p50, bare_p95),
                                              (alone, alone_p50, alone_p95)], rep):
            sample = latencies(operation, sizes.projection_ops)
            p50s.append(percentile(sample, 50))
            p95s.append(percentile(sample, 95))
    summarized = sum(1 for p in check.pairs if p.placement == "summarized")
    return {
        "pairs": pairs,
        "budget_bytes": budget,
        "used_bytes": check.used_bytes,
        "messages": len(check.messages),
        "pairs_summarized": summarized,
        "bare_messages": len(bare_rows),
        "pycompactor_p50_ms_reps": ours_p50,
        "bare_p50_ms_reps": bare_p50,
        "pycompactor_p50_ms": median(ours_p50),
        "pycompactor_p95_ms": median(ours_p95),
        "bare_p50_ms": median(bare_p50),
        "bare_p95_ms": median(bare_p95),
        "ratio_p50": ratio(median(ours_p50), median(bare_p50)),
        "engine_statements": len(statements),
        "statements_alone_p50_ms": median(alone_p50),
        "statements_alone_ratio_p50": ratio(median(alone_p50), median(bare_p50)),
    }


def _measure_judging(conn: Conn, conversation: str, pairs: int,
                     sizes: Sizes) -> dict[str, Any]:
    """compaction.indexed_pairs alone: eligibility judges every run, reading no text."""
    def judge() -> None:
        conn.execute(_INDEXED_PAIRS_SQL, {"c": conversation}).fetchone()

    latencies(judge, sizes.projection_warmup)
    p50s = [percentile(latencies(judge, sizes.projection_ops), 50) for _ in range(REPETITIONS)]
    return {"pairs": pairs, "p50_ms": median(p50s),
            "us_per_run": median(p50s) * 1000 / pairs}


def _measure_breakdown(conn: Conn, conversation: str, pairs: int,
                       sizes: Sizes) -> dict[str, Any]:
    """Median time of each statement project_history sends, at the 64 KiB budget."""
    budget = 64 * 1024
    with _recording() as timings:
        for _ in range(sizes.projection_ops):
            started = time.perf_counter()
            project_history(conn, conversation, budget_bytes=budget)
            timings.setdefault("(total)", []).append((time.perf_counter() - started) * 1000)
    return {"pairs": pairs, "budget_bytes": budget,
            "statement_p50_ms": {name: median(v) for name, v in sorted(timings.items())}}
