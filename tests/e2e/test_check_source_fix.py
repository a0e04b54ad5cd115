"""`pycompactor check-source` on the worked example with no index on the run id
(agent.turns.turn_id) and agent.chat_messages never analyzed: the problems and the
statements that fix them on the command line, and `--fix` printing only those statements,
which psql-style runs make clean."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import psycopg.sql
import pytest

from tests.e2e.cli import run_cli
from tests.sql.test_host_schema import INDEXES_WITHOUT_RUN_ID_INDEX, load_history, run_example

Conn = psycopg.Connection[Any]
FIXES = ["CREATE INDEX CONCURRENTLY ON agent.turns (((turn_id)::text));",
         "ANALYZE agent.chat_messages;"]


def test_check_source_fix_prints_the_statements(conn: Conn, dsn: str) -> None:
    run_example(conn, "host-schema")
    load_history(conn, threads=200, turns=10)
    conn.execute(INDEXES_WITHOUT_RUN_ID_INDEX)
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


HOSTILE = "x; DROP TABLE public.pwn; --"


def repoint_runs_at(conn: Conn, schema: str, table: str) -> str:
    """Source runs read from a table of these (hostile) names, with no index: check-source
    advises one. Returns the table's name as SQL needs it."""
    name = psycopg.sql.Identifier(schema, table)
    conn.execute(psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
        psycopg.sql.Identifier(schema)))
    conn.execute(psycopg.sql.SQL(
        "CREATE TABLE {} (conversation_id text, run_id text, status text)").format(name))
    conn.execute(psycopg.sql.SQL(
        "INSERT INTO {} SELECT 'c' || g % 7, 'r' || g, 'completed'"
        " FROM generate_series(1, 500) AS g").format(name))
    conn.execute(psycopg.sql.SQL("GRANT USAGE ON SCHEMA {} TO compaction_owner").format(
        psycopg.sql.Identifier(schema)))
    conn.execute(psycopg.sql.SQL("GRANT SELECT ON {} TO compaction_owner").format(name))
    conn.execute(psycopg.sql.SQL(
        "CREATE OR REPLACE VIEW compaction.source_runs AS"
        " SELECT run_id, conversation_id, status FROM {}").format(name))
    return name.as_string(conn)


def test_advice_pasted_into_psql_drops_no_table(conn: Conn, dsn: str) -> None:
    """A table named `x; DROP TABLE public.pwn; --`, printed bare, would make the advice
    `ANALYZE h.x; DROP TABLE public.pwn; --`. Every name check-source prints is quoted
    as SQL needs it, in the advice and in --fix; run as psql would run them, the
    statements build the index and public.pwn survives."""
    conn.execute("CREATE TABLE public.pwn (k int)")
    repoint_runs_at(conn, "h", HOSTILE)
    quoted = 'h."x; DROP TABLE public.pwn; --"'

    table = run_cli("check-source", "--dsn", dsn)
    assert table.returncode == 1, table.stderr
    assert quoted in table.stdout
    assert table.stdout.count(HOSTILE) == table.stdout.count(f'"{HOSTILE}"')
    fix = run_cli("check-source", "--fix", "--dsn", dsn)
    assert fix.returncode == 1
    statements = fix.stdout.splitlines()
    assert statements
    assert all(quoted in s for s in statements), statements
    report = json.loads(run_cli("check-source", "--json", "--dsn", dsn).stdout)
    assert report["fixes"] == statements
    for text in [table.stdout, json.dumps(report)]:
        assert f"h.{HOSTILE}" not in text
    # psql runs what it is given, statement by statement: so does this.
    for statement in statements:
        conn.execute(statement.encode())
    assert conn.execute("SELECT to_regclass('public.pwn')").fetchone() == ("pwn",)
    assert run_cli("check-source", "--fix", "--dsn", dsn).stdout == ""


@pytest.mark.parametrize(("schema", "table"), [("we.ird", "runs"), ("h", "a.b"),
                                               ("Select", "user"), ("h", 'q"uote')])
def test_fix_names_the_table_it_means(conn: Conn, dsn: str, schema: str, table: str) -> None:
    """A schema with a dot was split at its dot in --fix (`"we".ird.runs`). Keywords and
    quotes are quoted as quote_ident quotes them; the fix builds the index on that very
    table, and check-source is then clean."""
    quoted = repoint_runs_at(conn, schema, table)
    fix = run_cli("check-source", "--fix", "--dsn", dsn)
    assert fix.returncode == 1, fix.stderr
    statements = fix.stdout.splitlines()
    assert statements
    for statement in statements:
        on = statement.split(" ON ", 1)[1].rsplit(" ((", 1)[0]
        assert conn.execute("SELECT %s::regclass = %s::regclass", (on, quoted)).fetchone() \
            == (True,), (quoted, statement)
    for statement in statements:
        conn.execute(statement.encode())
    assert conn.execute(
        "SELECT count(*) FROM pg_index WHERE indrelid = %s::regclass", (quoted,)
    ).fetchone() == (len(statements),)
    assert run_cli("check-source", "--fix", "--dsn", dsn).stdout == ""
