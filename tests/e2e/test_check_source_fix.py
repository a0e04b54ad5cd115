"""`pycompactor check-source` on the worked example as a DBA built it before issue 31
(no run id index, no ANALYZE): the problems and the statements that fix them on the
command line, and `--fix` printing only those statements, which psql-style runs make
clean."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from tests.e2e.cli import run_cli
from tests.sql.test_host_schema import INDEXES_BEFORE_0019, load_history, run_example

Conn = psycopg.Connection[Any]
FIXES = ["CREATE INDEX CONCURRENTLY ON agent.turns (((turn_id)::text));",
         "ANALYZE agent.chat_messages;"]


def test_check_source_fix_prints_the_statements(conn: Conn, dsn: str) -> None:
    run_example(conn, "host-schema")
    load_history(conn, threads=200, turns=10)
    conn.execute(INDEXES_BEFORE_0019)
    run_example(conn, "repoint")

    table = run_cli("check-source", "--dsn", dsn)
    assert table.returncode == 1, table.stderr
    lines = table.stdout.splitlines()
    assert sum(line.startswith("problem: ") for line in lines) == 3
    assert [line.strip() for line in lines if line.startswith("  ")] == FIXES
    assert "run_by_id" in table.stdout

    fix = run_cli("check-source", "--fix", "--dsn", dsn)
    assert fix.returncode == 1
    assert fix.stdout.splitlines() == FIXES
    report = json.loads(run_cli("check-source", "--json", "--dsn", dsn).stdout)
    assert report["fixes"] == FIXES

    for statement in fix.stdout.splitlines():
        conn.execute(statement.encode())
    clean = run_cli("check-source", "--fix", "--dsn", dsn)
    assert (clean.returncode, clean.stdout) == (0, "")
