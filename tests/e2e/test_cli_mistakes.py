"""What a new user mistypes or misconfigures at the command line is said plainly, names the
database, and points at the fix."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from bench.sdk_source import SDK_TABLES_DDL
from pycompactor import db, project_history
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from pycompactor.worker.eventlog import EventLog
from tests.e2e.cli import run_cli
from tests.history import History

Conn = psycopg.Connection[Any]
AGENTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def no_connection_env() -> dict[str, str]:
    """The environment without PYCOMPACTOR_DSN and libpq's PG* variables."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("PG") and k != "PYCOMPACTOR_DSN"}


def run_bare(*args: str, env: dict[str, str] | None = None,
             stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """`pycompactor ARGS` with exactly `env` (run_cli adds the caller's environment)."""
    return subprocess.run([sys.executable, "-m", "pycompactor", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, check=False, timeout=120,
                          env=env if env is not None else dict(os.environ))


def where(dsn: str) -> tuple[str, str, str]:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return str(info["dbname"]), str(info["host"]), str(info["port"])


# --- a mistyped conversation id ---------------------------------------------------------


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_unknown_conversation_is_said_on_stderr_and_exits_0(
        conn: Conn, dsn: str, json_flag: list[str]) -> None:
    History(conn).pairs("conv-known", 3)
    for args in (["project", "no-such-conv", "--budget-bytes", "1000"],
                 ["plan", "no-such-conv"], ["plan", ""]):
        result = run_cli(*args, *json_flag, "--dsn", dsn)
        assert result.returncode == 0, result.stderr
        conversation = args[1]
        assert result.stderr == (f"pycompactor: warning: the source holds no runs for"
                                 f" conversation {conversation!r}; is the id right?\n")
        if json_flag:
            json.loads(result.stdout)  # stdout stays one JSON document
    # A conversation the source holds says nothing on stderr, pairs or not.
    History(conn).pair("conv-unpaired", run_status="failed")
    for conversation in ("conv-known", "conv-unpaired"):
        for args in (["project", conversation, "--budget-bytes", "1000"], ["plan", conversation]):
            result = run_cli(*args, *json_flag, "--dsn", dsn)
            assert (result.returncode, result.stderr) == (0, ""), args


# --- every error about a database names which one ---------------------------------------


def test_errors_name_the_database_from_dsn_or_pg_variables(new_database: Any) -> None:
    blank = new_database()
    dbname, host, port = where(blank)
    named = f'database "{dbname}" on {host}, port {port}'
    for args in (["plan", "c"], ["project", "c", "--budget-bytes", "10"], ["audit"],
                 ["check-source"], ["worker", "--once", "--model", OFFLINE_MODEL]):
        by_dsn = run_cli(*args, "--dsn", blank)
        assert by_dsn.returncode == 1, (args, by_dsn.stderr)
        assert named in by_dsn.stderr, (args, by_dsn.stderr)
        assert by_dsn.stderr.count("\n") == 1, by_dsn.stderr
        # The same database chosen by libpq's variables alone.
        env = {**no_connection_env(), "PGHOST": host, "PGPORT": port, "PGUSER": "postgres",
               "PGDATABASE": dbname}
        by_env = run_bare(*args, env=env)
        assert by_env.returncode == 1, (args, by_env.stderr)
        assert named in by_env.stderr, (args, by_env.stderr)


def test_unreachable_database_is_named_even_on_the_default_socket() -> None:
    refused = run_cli("plan", "c", "--dsn", "host=127.0.0.1 port=1 dbname=nowhere"
                      " connect_timeout=3")
    assert refused.returncode == 1
    assert 'database "nowhere" on 127.0.0.1, port 1' in refused.stderr
    with tempfile.TemporaryDirectory() as nothing_listens:
        # No --dsn, no PYCOMPACTOR_DSN: libpq's defaults (a socket directory, port 5432,
        # the database named after the user) pick a database the user never named.
        env = {**no_connection_env(), "PGHOST": nothing_listens, "PGUSER": "someone"}
        result = run_bare("project", "c", "--budget-bytes", "10", env=env)
    assert result.returncode == 1
    assert (f'database "someone" on the local socket in {nothing_listens}, port 5432'
            in result.stderr), result.stderr
    assert result.stderr.count("\n") == 1
    # Nothing set at all: whatever libpq's default socket leads to, the error says so.
    bare = run_bare("project", "c", "--budget-bytes", "10", env=no_connection_env())
    if bare.returncode != 0:
        assert bare.stderr.endswith(
            ", port 5432, libpq's defaults: no --dsn, PYCOMPACTOR_DSN or PG* variable names"
            " one)\n"), bare.stderr


# --- unmigrated databases, migrate's wording, a bad DSN ---------------------------------


def test_audit_and_check_source_on_an_unmigrated_database_say_migrate(
        new_database: Any) -> None:
    blank = new_database()
    for args in (["audit"], ["audit", "--view", "queue"], ["check-source"],
                 ["check-source", "--json"]):
        result = run_cli(*args, "--dsn", blank)
        assert result.returncode == 1, result.stderr
        assert "run `pycompactor migrate` first" in result.stderr, (args, result.stderr)
        assert "check-source" not in result.stderr
        assert result.stdout == ""


def test_migrate_says_an_unreachable_database_as_every_command_does() -> None:
    dsn = "host=127.0.0.1 port=1 dbname=nowhere connect_timeout=3"
    migrate = run_cli("migrate", "--dsn", dsn)
    plan = run_cli("plan", "c", "--dsn", dsn)
    assert migrate.returncode == plan.returncode == 1
    assert migrate.stderr == plan.stderr
    assert migrate.stderr.startswith("pycompactor: error: cannot reach the database")
    assert "OperationalError" not in migrate.stderr


@pytest.mark.parametrize("command", [["migrate"], ["plan", "c"], ["audit"], ["check-source"]])
def test_a_malformed_dsn_is_said_with_the_fix(command: list[str]) -> None:
    result = run_cli(*command, "--dsn", "nonsense")
    assert result.returncode == 1
    assert result.stderr == (
        'pycompactor: error: invalid connection string (missing "=" after "nonsense" in'
        " connection info string); give key=value pairs (host=db dbname=agent) or a URI"
        " (postgresql://user@db/agent) in --dsn or PYCOMPACTOR_DSN\n")


# --- the budget's real bound ------------------------------------------------------------


def test_a_huge_budget_projects_and_one_past_the_bound_is_a_usage_error(
        conn: Conn, dsn: str) -> None:
    History(conn).pairs("conv-b", 3)
    huge = 2 ** 48
    result = run_cli("project", "conv-b", "--budget-bytes", str(huge), "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    projection = json.loads(result.stdout)
    assert [p["placement"] for p in projection["pairs"]] == ["raw"] * 3
    assert project_history(conn, "conv-b", budget_bytes=2 ** 63 - 1).budget_bytes == 2 ** 63 - 1
    past = run_cli("project", "conv-b", "--budget-bytes", str(2 ** 63), "--dsn", dsn)
    assert past.returncode == 2
    assert past.stderr.splitlines()[-1] == (
        "pycompactor project: error: argument --budget-bytes: expected at most"
        f" {2 ** 63 - 1} bytes, got {2 ** 63}")


# --- a closed pipe, and times in the text log -------------------------------------------


@pytest.mark.parametrize("args", [["check-source"], ["plan", "conv-p"], ["audit", "--json"]])
def test_a_closed_pipe_ends_the_command_quietly(conn: Conn, dsn: str, args: list[str]) -> None:
    History(conn).pairs("conv-p", 45)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written, as `| head` may be
    try:
        result = run_bare(*args, "--dsn", dsn, stdout=write)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


def test_text_log_quotes_a_time_once() -> None:
    stream = io.StringIO()
    at = datetime(2026, 12, 2, 17, 18, 36, 250000, tzinfo=UTC)
    EventLog("text", stream=stream).emit("claimed", lease_expires_at=at, reason="a b")
    line = stream.getvalue()
    assert " lease_expires_at=2026-12-02T17:18:36.250000+00:00 " in line, line
    assert line.endswith(' reason="a b"\n')


# --- the plan shows each target's state -------------------------------------------------


@pytest.fixture
def every_state(conn: Conn) -> dict[int, str]:
    """conv-s with 80 pairs: six targets, one in each state the plan shows."""
    seeded = History(conn).pairs("conv-s", 80)
    targets = {t.from_pair: t for t in db.plan_targets(conn, "conv-s")}

    def claim(from_pair: int) -> tuple[int, int]:
        t = targets[from_pair]
        c = db.claim(conn, "conv-s", "default", from_pair, t.source_message_ids,
                     t.source_hash, "model-x", PROMPT_VERSION, "test")
        assert c.claimed, c
        assert c.job_id is not None
        assert c.attempt is not None
        return c.job_id, c.attempt

    for from_pair in (0, 10):
        assert db.complete(conn, *claim(from_pair), "Summary.", "stop", 0,
                           conversation_id="conv-s").ok
    conn.execute("UPDATE compaction_source.messages SET content = 'edited' WHERE"
                 " message_id = %s", (seeded[12].assistant_message_id,))
    claim(20)
    db.fail(conn, *claim(30), "timeout", conversation_id="conv-s")
    for _ in range(2):
        db.fail(conn, *claim(40), "timeout", conversation_id="conv-s")
    return {0: "summarized", 10: "stale", 20: "running", 30: "failed", 40: "exhausted",
           50: "pending"}


def test_plan_shows_each_targets_state(every_state: dict[int, str], dsn: str) -> None:
    result = run_cli("plan", "conv-s", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert {t["from_pair"]: t["state"] for t in plan} == every_state
    assert set(plan[0]) == {"from_pair", "to_pair", "source_message_ids", "source_hash",
                            "state"}
    table = run_cli("plan", "conv-s", "--dsn", dsn)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split()[:2] == ["pairs", "state"]
    rows = {line.split()[0]: line.split()[1] for line in lines[3:]}
    assert rows == {f"{k}-{k + 9}": v for k, v in every_state.items()}


def test_plan_as_a_reader_shows_what_a_reader_may_read(
        every_state: dict[int, str], dsn: str, conn: Conn) -> None:
    name = f"reader_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE compaction_reader").format(
        sql.Identifier(name)))
    try:
        result = run_cli("plan", "conv-s", "--json", "--dsn", f"{dsn} user={name}")
        assert result.returncode == 0, result.stderr
        states = {t["from_pair"]: t["state"] for t in json.loads(result.stdout)}
        assert states == {0: "summarized", 10: "stale", 20: "not_summarized",
                          30: "not_summarized", 40: "not_summarized", 50: "not_summarized"}
        table = run_cli("plan", "conv-s", "--dsn", f"{dsn} user={name}")
        assert table.returncode == 0, table.stderr
        assert "compaction_auditor" in table.stdout
    finally:
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


# --- the Agents SDK's tables without the recipe -----------------------------------------


def test_sdk_tables_without_the_recipe_are_named(conn: Conn, dsn: str) -> None:
    conn.execute(SDK_TABLES_DDL)
    conn.execute("INSERT INTO public.agent_sessions (session_id) VALUES ('s1')")
    conn.execute("INSERT INTO public.agent_messages (session_id, message_data)"
                 " VALUES ('s1', '{\"role\":\"user\",\"content\":\"hi\"}')")
    hint = ("public.agent_messages looks like the OpenAI Agents SDK's SQLAlchemySession"
            " table, but the source views read the empty reference tables of"
            " compaction_source: run `pycompactor install-recipe agents-sqlalchemy`")
    check = run_cli("check-source", "--dsn", dsn)
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"problem: {hint}" in check.stdout
    migrate = run_cli("migrate", "--dsn", dsn)
    assert migrate.returncode == 0, migrate.stderr
    assert hint in migrate.stderr
    installed = run_cli("install-recipe", "agents-sqlalchemy", "--dsn", dsn)
    assert installed.returncode == 0, installed.stderr
    check = run_cli("check-source", "--dsn", dsn)
    assert "install-recipe" not in check.stdout + check.stderr


def test_agents_doc_setup_sweeps_the_existing_history() -> None:
    text = AGENTS_DOC.read_text(encoding="utf-8")
    setup = text.split("## Keeping the SDK's tables", 1)[1].split("```console\n", 1)[1]
    setup = setup.split("```", 1)[0]
    workers = [line for line in setup.splitlines() if re.search(r"pycompactor worker\b", line)]
    assert any("--sweep" in line for line in workers), setup
