"""Benchmark 6: the Agents SDK recipe's views against the reference tables.

Two databases hold the same history: one in the OpenAI Agents SDK's SQLAlchemySession
tables (`agent_sessions`, `agent_messages`: one JSON item per row, non-ASCII escaped as
the SDK writes it) behind the shipped recipe (pycompactor/recipes), one in the reference
tables of `compaction_source`, stored as PycompactorSession stores the same items. Each
has 1,000 other sessions of 100 items besides the measured one, whose turns carry
function calls, their outputs, interim assistant messages and Chinese text. Measured on
both: `plan` (compaction.plan_targets), `project` (64 KiB) and `check-source` on the
measured conversation; the recipe's p50 over the reference's p50 is the ratio (goal <= 3).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg import sql

from bench.common import (
    REPETITIONS,
    BenchCluster,
    Conn,
    Sizes,
    drain_queue,
    import_all_targets,
    latencies,
    median,
    percentile,
    ratio,
    text_pool,
    vacuum_analyze,
)
from pycompactor import db, project_history
from pycompactor.cli.source import check_source
from pycompactor.recipes import install_agents_sqlalchemy

# The tables as SQLAlchemySession(create_tables=True) creates them on PostgreSQL.
SDK_TABLES_DDL = """
CREATE TABLE IF NOT EXISTS public.agent_sessions (
    session_id varchar NOT NULL PRIMARY KEY,
    created_at timestamp without time zone DEFAULT CURRENT_TIMESTAMP NOT NULL,
    updated_at timestamp without time zone DEFAULT CURRENT_TIMESTAMP NOT NULL
);
CREATE TABLE IF NOT EXISTS public.agent_messages (
    id serial PRIMARY KEY,
    session_id varchar NOT NULL REFERENCES public.agent_sessions (session_id) ON DELETE CASCADE,
    message_data text NOT NULL,
    created_at timestamp without time zone DEFAULT CURRENT_TIMESTAMP NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_agent_messages_session_time
    ON public.agent_messages (session_id, created_at);
"""

MEASURED = "sdk-measured"
OTHER_SESSIONS = 1_000
OTHER_ITEMS = 100
BUDGET = 64 * 1024
MODEL = "bench/imported"


def turn_items(session: int, turn: int, users: list[str], replies: list[str]
               ) -> list[dict[str, Any]]:
    """One turn as the SDK saves it: the user message, and for every third turn an
    interim assistant message, a function call and its output, then the answer."""
    question = f"{users[(session * 7 + turn) % len(users)]} #{turn}"
    answer = f"{replies[(session * 13 + turn) % len(replies)]} #{turn}"
    items: list[dict[str, Any]] = [{"content": question, "role": "user"}]
    if turn % 3 == 2:
        call_id = f"call_{session}_{turn}"
        items += [
            {"id": "__fake_id__", "type": "message", "role": "assistant",
             "status": "completed", "content": [
                 {"type": "output_text", "text": "让我查一下。Let me look that up.",
                  "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "__fake_id__", "call_id": call_id,
             "name": "lookup_nav", "arguments": json.dumps({"fund": turn})},
            {"type": "function_call_output", "call_id": call_id,
             "output": f"基金 F{turn} 的净值是 {10 + turn}.25"},
        ]
    items.append({"id": "__fake_id__", "type": "message", "role": "assistant",
                  "status": "completed", "content": [
                      {"type": "output_text", "text": answer, "annotations": [],
                       "logprobs": []}]})
    return items


def sessions(measured_turns: int, others: int) -> Iterator[tuple[str, int, int]]:
    """(session id, session number, turns): the measured one, then the others (about
    OTHER_ITEMS items each: 3 turns make 2 + 2 + 5 = 9 items)."""
    yield MEASURED, 0, measured_turns
    for i in range(1, others + 1):
        yield f"sdk-other-{i:05d}", i, OTHER_ITEMS * 3 // 9


def _items_of(plan: list[tuple[str, int, int]], users: list[str], replies: list[str]
              ) -> Iterator[tuple[str, int, list[dict[str, Any]]]]:
    for session_id, number, turns in plan:
        for turn in range(turns):
            yield session_id, turn, turn_items(number, turn, users, replies)


def seed_sdk(conn: Conn, plan: list[tuple[str, int, int]], users: list[str],
             replies: list[str]) -> None:
    """The SDK's rows: its JSON (separators and ASCII escaping as SQLAlchemySession)."""
    conn.execute(SDK_TABLES_DDL)
    with conn.cursor() as cur:
        with cur.copy("COPY public.agent_sessions (session_id) FROM STDIN") as copy:
            for session_id, _, _ in plan:
                copy.write_row((session_id,))
        with cur.copy("COPY public.agent_messages (session_id, message_data) FROM STDIN"
                      ) as copy:
            for session_id, _, items in _items_of(plan, users, replies):
                for item in items:
                    copy.write_row((session_id, json.dumps(item, ensure_ascii=True,
                                                           separators=(",", ":"))))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if isinstance(p.get("text"), str))


def seed_reference(conn: Conn, plan: list[tuple[str, int, int]], users: list[str],
                   replies: list[str]) -> None:
    """The same items in the reference tables, as PycompactorSession stores them."""
    runs: list[tuple[str, str]] = []
    messages: list[tuple[str, str, str, str, str, int]] = []
    seq = 0
    for session_id, turn, items in _items_of(plan, users, replies):
        run_id = f"{session_id}/run-{turn:06d}"
        runs.append((run_id, session_id))
        for position, item in enumerate(items):
            seq += 1
            role = item.get("role") if item.get("type", "message") == "message" else None
            if role == "assistant" and position < len(items) - 1:
                role = "assistant_interim"
            content = (_text(item["content"]) if role
                       else json.dumps(item, ensure_ascii=False))
            messages.append((f"{session_id}/{seq}", session_id, run_id, role or "sdk_item",
                             content, seq))
    with conn.cursor() as cur:
        with cur.copy("COPY compaction_source.conversations (conversation_id) FROM STDIN"
                      ) as copy:
            for session_id, _, _ in plan:
                copy.write_row((session_id,))
        with cur.copy("COPY compaction_source.runs (run_id, conversation_id, status)"
                      " FROM STDIN") as copy:
            for run_id, session_id in runs:
                copy.write_row((run_id, session_id, "completed"))
        with cur.copy("COPY compaction_source.messages (message_id, conversation_id, run_id,"
                      " role, status, content, seq) FROM STDIN") as copy:
            for message_id, session_id, run_id, role, content, s in messages:
                copy.write_row((message_id, session_id, run_id, role, "completed", content, s))


def _p50s(dsn: str, sizes: Sizes) -> dict[str, Any]:
    ops = max(3, sizes.projection_ops // 3)
    out: dict[str, Any] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        operations: dict[str, Callable[[], object]] = {
            "plan": lambda: db.plan_targets(conn, MEASURED),
            "project_64k": lambda: project_history(conn, MEASURED, budget_bytes=BUDGET),
            "check_source": lambda: check_source(conn, [MEASURED]),
        }
        for name, operation in operations.items():
            for _ in range(sizes.projection_warmup):
                operation()
            runs = [latencies(operation, ops) for _ in range(REPETITIONS)]
            out[name] = {"p50_ms": median([percentile(r, 50) for r in runs]),
                         "p95_ms": median([percentile(r, 95) for r in runs])}
        out["targets"] = len(db.plan_targets(conn, MEASURED))
        out["pairs"] = len(db.eligible_pairs(conn, MEASURED))
        projection = project_history(conn, MEASURED, budget_bytes=BUDGET)
        out["placements"] = {p: sum(1 for x in projection.pairs if x.placement == p)
                             for p in ("raw", "summarized", "omitted")}
        report = check_source(conn, [MEASURED])
        out["check_source_ok"] = report.ok
        out["check_source_problems"] = list(report.problems)
        out["derived_state"] = report.derived_state
    return out


def _sibling_database(dsn: str) -> str:
    """A second database beside `dsn`'s, cloned from the same migrated template."""
    parts = dict(item.split("=", 1) for item in dsn.split())
    name = f"{parts['dbname']}_ref"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(BenchCluster.TEMPLATE)))
    return " ".join(f"{k}={name if k == 'dbname' else v}" for k, v in parts.items())


def _append_p50(dsn: str, sdk: bool, sizes: Sizes, users: list[str],
                replies: list[str]) -> float:
    """p50 ms of appending one settled turn (question and answer, one durable commit) to
    the measured conversation, as the SDK writes it or as PycompactorSession does (no goal:
    the tracking triggers re-derive the touched session whole on the SDK's table, which
    has no run column)."""
    counter = iter(range(10_000, 20_000))
    with psycopg.connect(dsn, autocommit=True) as conn:
        def append() -> None:
            turn = next(counter)
            question, answer = turn_items(0, turn * 3, users, replies)  # a plain turn
            with conn.transaction():
                if sdk:
                    conn.execute("INSERT INTO public.agent_messages (session_id, message_data)"
                                 " VALUES (%(s)s, %(q)s), (%(s)s, %(a)s)",
                                 {"s": MEASURED, "q": json.dumps(question, separators=(",", ":")),
                                  "a": json.dumps(answer, separators=(",", ":"))})
                    conn.execute("UPDATE public.agent_sessions SET updated_at = now()"
                                 " WHERE session_id = %s", (MEASURED,))
                else:
                    run_id = f"{MEASURED}/run-x{turn}"
                    conn.execute("INSERT INTO compaction_source.runs (run_id, conversation_id,"
                                 " status) VALUES (%s, %s, 'completed')", (run_id, MEASURED))
                    conn.execute(
                        "INSERT INTO compaction_source.messages (message_id, conversation_id,"
                        " run_id, role, status, content, seq) VALUES"
                        " (%(r)s || '/u', %(c)s, %(r)s, 'user', 'completed', %(q)s, %(n)s),"
                        " (%(r)s || '/a', %(c)s, %(r)s, 'assistant', 'completed', %(a)s,"
                        "  %(n)s + 1)",
                        {"r": run_id, "c": MEASURED, "q": question["content"],
                         "a": _text(answer["content"]), "n": 10_000_000 + 2 * turn})
        for _ in range(sizes.projection_warmup):
            append()
        return median([percentile(latencies(append, sizes.projection_ops), 50)
                       for _ in range(REPETITIONS)])


def run(dsn: str, sizes: Sizes) -> dict[str, Any]:
    """`dsn` gets the SDK tables, a sibling database the reference ones."""
    reference_dsn = _sibling_database(dsn)
    measured_turns = 200 if not sizes.smoke else 45
    others = OTHER_SESSIONS if not sizes.smoke else 20
    plan = list(sessions(measured_turns, others))
    users = text_pool(61, 32, 200)
    replies = text_pool(62, 64, 1024 if not sizes.smoke else 256)
    summary = text_pool(63, 1, 1500)[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed_sdk(conn, plan, users, replies)
    vacuum_analyze(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        install_agents_sqlalchemy(conn)
        import_all_targets(conn, [MEASURED], summary, MODEL)
    with psycopg.connect(reference_dsn, autocommit=True) as conn:
        seed_reference(conn, plan, users, replies)
        drain_queue(conn)
        import_all_targets(conn, [MEASURED], summary, MODEL)
    vacuum_analyze(dsn)
    vacuum_analyze(reference_dsn)
    sdk = _p50s(dsn, sizes)
    reference = _p50s(reference_dsn, sizes)
    ratios = {name: ratio(sdk[name]["p50_ms"], reference[name]["p50_ms"])
              for name in ("plan", "project_64k", "check_source")}
    sdk_append = _append_p50(dsn, True, sizes, users, replies)
    reference_append = _append_p50(reference_dsn, False, sizes, users, replies)
    appends = {"sdk_p50_ms": sdk_append, "reference_p50_ms": reference_append,
               "ratio_p50": ratio(sdk_append, reference_append)}
    return {"measured_turns": measured_turns, "other_sessions": others,
            "other_items": OTHER_ITEMS, "sdk": sdk, "reference": reference,
            "ratio_p50": ratios, "append_turn": appends}
