"""`pycompactor project` as a subprocess: JSON equals Projection.to_dict(), table, exit codes."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from pycompactor import project_history
from tests.e2e.cli import run_cli
from tests.history import History
from tests.sql.test_projection import V1, import_summary

Conn = psycopg.Connection[Any]


def test_project_json_is_to_dict_and_table_is_readable(conn: Conn, dsn: str) -> None:
    pairs = History(conn).pairs("conv-p", 25, text="净值 🙂")
    used = import_summary(conn, "conv-p", pairs, 0, text="基金比较（上周净值）")
    old = import_summary(conn, "conv-p", pairs, 10, version=V1)

    result = run_cli("project", "conv-p", "--budget-bytes", "100000", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    expected = project_history(conn, "conv-p", budget_bytes=100_000).to_dict()
    assert json.loads(result.stdout) == expected
    assert expected["pairs"][0] == {"pair_index": 0, "placement": "summarized",
                                    "summary_id": used}

    table = run_cli("project", "conv-p", "--budget-bytes", "100000", "--dsn", dsn)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == (f"conversation conv-p (scope default): 25 eligible pairs, "
                        f"{len(expected['messages'])} messages, "
                        f"{expected['used_bytes']} of 100000 bytes used")
    assert any(line.split() == ["0-9", "summarized", str(used)] for line in lines)
    assert any(line.split() == ["10-24", "raw"] for line in lines)
    assert "rejected summaries:" in lines
    assert any(line.split() == [str(old), "10-19", "version_not_projectable"]
               for line in lines)


def test_project_unknown_conversation_is_empty_and_exits_0(dsn: str) -> None:
    result = run_cli("project", "nobody", "--budget-bytes", "0", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"messages": [], "pairs": [], "rejected_summaries": [],
                                         "used_bytes": 0, "budget_bytes": 0}


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "expected a number of at least 0, got -1"),
    ("lots", "expected a whole number, got 'lots'"),
])
def test_project_bad_budget_exits_2_with_usage(value: str, message: str) -> None:
    result = run_cli("project", "conv", "--budget-bytes", value)
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert errors[0].startswith("usage: pycompactor project")
    assert errors[-1] == f"pycompactor project: error: argument --budget-bytes: {message}"
    assert result.stdout == ""
