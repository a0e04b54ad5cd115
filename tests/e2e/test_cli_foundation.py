"""`pycompactor migrate | plan | check-source` as subprocesses: output, JSON, exit codes."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from tests.e2e.cli import run_cli
from tests.history import History

Conn = psycopg.Connection[Any]


def test_migrate_reports_the_revision(dsn: str) -> None:
    result = run_cli("migrate", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert "compaction schema at revision" in result.stdout


def test_plan_json_and_table(conn: Conn, dsn: str) -> None:
    seeded = History(conn).pairs("conv-1", 41)
    result = run_cli("plan", "conv-1", "--json", env={"PYCOMPACTOR_DSN": dsn})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [(t["from_pair"], t["to_pair"]) for t in plan] == [(0, 9), (10, 19)]
    assert plan[0]["source_message_ids"][:2] == [seeded[0].user_message_id,
                                                 seeded[0].assistant_message_id]
    assert set(plan[0]) == {"from_pair", "to_pair", "source_message_ids", "source_hash",
                            "state"}

    table = run_cli("plan", "conv-1", "--dsn", dsn)
    assert table.returncode == 0
    assert "41 eligible pairs, 2 targets" in table.stdout
    assert "0-9" in table.stdout
    assert "10-19" in table.stdout


def test_plan_of_unknown_conversation_is_empty(dsn: str) -> None:
    result = run_cli("plan", "nobody", "--json", "--dsn", dsn)
    assert (result.returncode, json.loads(result.stdout)) == (0, [])


def test_check_source_reports_exclusions(conn: Conn, dsn: str) -> None:
    h = History(conn)
    h.pairs("conv-1", 3)
    h.pair("conv-1", run_status="failed")
    h.pair("conv-1", assistant_status="streaming")
    h.pair("conv-1", user=" \t ")
    result = run_cli("check-source", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # The engine's lookups through the reference tables' views, each served by an index.
    lookups = report.pop("lookups")
    assert [(lk["lookup"], lk["view"], lk["column"], lk["uses_index"], lk["advice"])
            for lk in lookups] == [
        ("runs_by_conversation", "compaction.source_runs", "conversation_id", True, None),
        ("run_by_id", "compaction.source_runs", "run_id", True, None),
        ("messages_by_run", "compaction.source_messages", "run_id", True, None),
        ("message_by_id", "compaction.source_messages", "message_id", True, None)]
    assert report == {
        "ok": True,
        "problems": [],
        "fixes": [],
        "derived_state": "in_use",
        "samples": [{
            "conversation_id": "conv-1", "runs": 6, "pairs": 3,
            "excluded": {"assistant_not_completed": 1, "empty_user_content": 1,
                         "run_status": 1},
        }],
    }
    table = run_cli("check-source", "--conversation", "conv-1", "--dsn", dsn)
    assert table.returncode == 0
    assert "source views match the contract" in table.stdout
    assert "run_status: 1" in table.stdout
    assert "messages_by_run" in table.stdout


def test_check_source_exits_1_naming_each_problem(conn: Conn, dsn: str) -> None:
    conn.execute("DROP VIEW compaction.source_messages")
    conn.execute("DROP VIEW compaction.source_runs")
    conn.execute(
        "CREATE VIEW compaction.source_runs AS"
        " SELECT run_id, conversation_id, 1::int AS status FROM compaction_source.runs"
    )
    result = run_cli("check-source", "--dsn", dsn)
    assert result.returncode == 1
    assert "problem: compaction.source_runs.status is integer, expected text" in result.stdout
    assert "problem: view compaction.source_messages is missing" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan"], "the following arguments are required: CONVERSATION"),
        (["check-source", "--sample", "0"], "expected a number of at least 1"),
        (["check-source", "--sample", "many"], "expected a whole number"),
        (["frobnicate"], "invalid choice"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2_with_usage_and_one_error_line(
    args: list[str], message: str
) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("usage: pycompactor")
    assert message in lines[-1]
    assert "Traceback" not in result.stderr


def test_unreachable_database_is_one_clear_line() -> None:
    result = run_cli("plan", "c", "--dsn", "host=127.0.0.1 port=1 user=nobody dbname=nowhere "
                     "password=s3cret-pw connect_timeout=3")
    assert result.returncode == 1
    assert result.stderr.startswith("pycompactor: error: cannot reach the database")
    assert result.stderr.count("\n") == 1
    assert "s3cret-pw" not in result.stderr + result.stdout


def test_unmigrated_database_says_to_migrate(new_database: Any) -> None:
    result = run_cli("plan", "c", "--dsn", new_database())
    assert result.returncode == 1
    assert "run `pycompactor migrate` first" in result.stderr
    assert result.stderr.count("\n") == 1


def test_debug_shows_the_traceback() -> None:
    result = run_cli("plan", "c", "--debug", "--dsn", "host=127.0.0.1 port=1 connect_timeout=3")
    assert result.returncode == 1
    assert "Traceback" in result.stderr


def test_every_subcommand_has_help_with_examples() -> None:
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("migrate", "plan", "check-source", "demo"):
        result = run_cli(command, "--help")
        assert result.returncode == 0, command
        assert "examples:" in result.stdout, command
        assert "PYCOMPACTOR_DSN" in result.stdout, command
