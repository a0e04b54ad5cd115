"""Benchmark 7: where the time of each measured operation goes, statement by statement.

The other benchmarks run on a cluster without extensions. This one starts a second
durable cluster with pg_stat_statements tracking every statement, nested ones included
(the statements inside the engine's functions and triggers, and the foreign-key checks),
and runs on one connection, after a warm-up:

* the claim -> complete cycle of benchmark 1 (one conversation of 35 pairs per cycle),
  and benchmark 1's plain-SQL cycle, the goal's denominator;
* `project_history` at 64 KiB on a conversation as long as benchmark 2's longest, with
  every target summarized, and benchmark 2's bare query on it;
* appending a Run to a conversation as long as benchmark 5's, as benchmark 5 does.

For each operation: the client's wall time, the server's execution and planning time of
the statements the client sent, and the statements that cost the most, nested ones
included (a nested statement's time is part of the statement that ran it). What the
client waited for beyond those is the rest: the network, the commit of an autocommit
call (its WAL flush), the driver and Python. Two CPU clocks tell the parts apart: this
process's (the driver and Python: one thread, so the process's clock is theirs) and
the connection's server process's (every statement it ran, parsing, planning and
commits included; read from /proc, the cluster being local, in clock ticks (10 ms
on Linux) over the whole run). pg_stat_statements costs a little on every
statement, so these figures explain the goals' ratios; they are not those ratios.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import psycopg

from bench import writing
from bench.claims import BASELINE_DDL, baseline_cycle, prepare_ranges, pycompactor_cycle
from bench.common import BenchCluster, Conn, Sizes, text_pool
from bench.projecting import BARE_SQL, conversation_of, prepare_conversations
from pycompactor.projection import project_history

#: The server settings of this benchmark's cluster.
SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
    "pg_stat_statements.max": "5000",
}
#: How many of the costliest statements each operation lists.
TOP = 12
BUDGET = 64 * 1024

_RESET_SQL = "SELECT pg_stat_statements_reset()"
_READ_SQL = """
SELECT s.toplevel, s.calls, s.total_exec_time, s.total_plan_time, s.query
FROM pg_stat_statements AS s
WHERE s.dbid = (SELECT d.oid FROM pg_database AS d WHERE d.datname = current_database())
  AND s.query NOT LIKE '%pg_stat_statements%'
ORDER BY s.total_exec_time DESC
"""


def _short(query: str) -> str:
    """One line, at most 100 characters: enough to recognise the statement."""
    line = re.sub(r"\s+", " ", query).strip()
    return line if len(line) <= 100 else line[:99] + "…"


def _server_cpu_s(conn: Conn) -> float | None:
    """The CPU seconds the connection's server process has used (user and system), or
    None where /proc cannot tell."""
    try:
        with open(f"/proc/{conn.info.backend_pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command's name: state is field 3, utime 14, stime 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(conn: Conn, operations: list[Callable[[], object]], warmup: int) -> dict[str, Any]:
    """Run the warm-up, reset the statistics, run the rest and split their time."""
    for operation in operations[:warmup]:
        operation()
    measured = operations[warmup:]
    n = len(measured)
    conn.execute(_RESET_SQL)
    started = time.perf_counter()
    cpu_started = time.process_time()
    server_started = _server_cpu_s(conn)
    for operation in measured:
        operation()
    client_cpu_ms = (time.process_time() - cpu_started) * 1000 / n
    server_ended = _server_cpu_s(conn)
    client_ms = (time.perf_counter() - started) * 1000 / n
    rows = conn.execute(_READ_SQL).fetchall()
    top_exec = sum(r[2] for r in rows if r[0]) / n
    top_plan = sum(r[3] for r in rows if r[0]) / n
    return {
        "operations": n,
        "client_ms": client_ms,
        "top_level_exec_ms": top_exec,
        "top_level_plan_ms": top_plan,
        "rest_ms": client_ms - top_exec - top_plan,
        "client_cpu_ms": client_cpu_ms,
        "server_cpu_ms": (None if server_started is None or server_ended is None
                          else (server_ended - server_started) * 1000 / n),
        "statements": [
            {"toplevel": bool(r[0]), "calls_per_op": r[1] / n, "exec_ms_per_op": r[2] / n,
             "query": _short(str(r[4]))}
            for r in rows[:TOP]
        ],
    }


def _claim_cycle(dsn: str, sizes: Sizes, warmup: int) -> dict[str, Any]:
    targets = prepare_ranges(dsn, sizes, warmup + sizes.profile_ops)
    with psycopg.connect(dsn, autocommit=True) as conn:
        operations: list[Callable[[], object]] = [
            partial(pycompactor_cycle, conn, item, "bench-statements") for item in targets
        ]
        return _measure(conn, operations, warmup)


def _plain_cycle(dsn: str, sizes: Sizes, warmup: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BASELINE_DDL)
        operations: list[Callable[[], object]] = [
            partial(baseline_cycle, conn, f"statements-{op}", "bench-statements")
            for op in range(warmup + sizes.profile_ops)
        ]
        return _measure(conn, operations, warmup)


def _projection(dsn: str, sizes: Sizes, warmup: int) -> dict[str, Any]:
    pairs = max(sizes.projection_pairs)
    conversation = conversation_of(pairs)
    prepare_conversations(dsn, sizes, [pairs])
    with psycopg.connect(dsn, autocommit=True) as conn:
        count = warmup + sizes.profile_ops

        def ours() -> None:
            project_history(conn, conversation, budget_bytes=BUDGET)

        def bare() -> None:
            conn.execute(BARE_SQL, {"c": conversation, "b": BUDGET}).fetchall()

        return {"pairs": pairs, "budget_bytes": BUDGET,
                "pycompactor": _measure(conn, [ours] * count, warmup),
                "bare": _measure(conn, [bare] * count, warmup)}


def _append(dsn: str, sizes: Sizes, warmup: int) -> dict[str, Any]:
    users = text_pool(7, 50, 200)
    assistants = text_pool(8, 50, sizes.reply_bytes)
    conversation = "appends0"
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            writing.seed(conn, writing.ENGINE, conversation, sizes.write_pairs, 0, users,
                          assistants)
        conn.execute("VACUUM (ANALYZE) compaction_source.runs, compaction_source.messages")
        operations: list[Callable[[], object]] = [
            partial(writing.append_run, conn, writing.ENGINE, conversation,
                    1_000_000 + 2 * op, users[op % 50], assistants[op % 50])
            for op in range(warmup + sizes.profile_ops)
        ]
        return {"pairs": sizes.write_pairs, **_measure(conn, operations, warmup)}


def run(sizes: Sizes) -> dict[str, Any]:
    """The profile of each operation, in a cluster of its own (SETTINGS)."""
    warmup = max(2, sizes.profile_ops // 10)
    with BenchCluster(SETTINGS) as cluster:
        with psycopg.connect(cluster.dsn_for(cluster.TEMPLATE), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
        return {
            "claim_cycle": _claim_cycle(cluster.new_database("statements"), sizes, warmup),
            "plain_cycle": _plain_cycle(cluster.new_database("statements"), sizes, warmup),
            "projection": _projection(cluster.new_database("statements"), sizes, warmup),
            "append": _append(cluster.new_database("statements"), sizes, warmup),
        }
