"""Where a command's result alone would hide a likely mistake (a conversation the source does
not hold, a budget that omits every pair), it warns on stderr (and, for evaluate --json, in
the report's `warnings`); and evaluate on an unmigrated database says what every other
command says."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg

from pycompactor.summarizers.extractive import OFFLINE_MODEL
from tests.e2e.cli import run_cli
from tests.history import History

Conn = psycopg.Connection[Any]
UNKNOWN = "the source holds no runs for conversation 'nope'; is the id right?"


def test_evaluate_warns_about_an_unknown_conversation(conn: Conn, dsn: str) -> None:
    History(conn).pairs("known", 30)
    result = run_cli("evaluate", "--database", "--conversation", "known", "--conversation",
                     "nope", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert f"pycompactor: warning: {UNKNOWN}" in result.stderr.splitlines()
    report = json.loads(result.stdout)
    assert report["warnings"] == [UNKNOWN]
    assert [c["conversation_id"] for c in report["conversations"]] == ["known", "nope"]


def test_the_worker_warns_about_an_unknown_conversation(dsn: str) -> None:
    result = run_cli("worker", "--once", "--conversation", "nope", "--model", OFFLINE_MODEL,
                     "--log-format", "json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines()]
    [warning] = [e for e in events if e["event"] == "warning"]
    assert warning["conversation_id"] == "nope"
    assert "is the id right?" in warning["warning"]


def test_a_budget_that_omits_every_pair_is_said(conn: Conn, dsn: str) -> None:
    History(conn).pairs("c", 5)
    result = run_cli("project", "c", "--budget-bytes", "20", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert {p["placement"] for p in json.loads(result.stdout)["pairs"]} == {"omitted"}
    assert result.stderr == (
        "pycompactor: warning: a budget of 20 bytes takes none of the 5 eligible pairs (the"
        " newest pair alone costs more); every pair is omitted\n")
    enough = run_cli("project", "c", "--budget-bytes", "100000", "--dsn", dsn)
    assert enough.stderr == ""


def test_evaluate_on_an_unmigrated_database_says_migrate(
        new_database: Callable[[], str]) -> None:
    blank = new_database()
    messages = []
    for command in (["evaluate", "--database"], ["plan", "c"], ["project", "c",
                                                                 "--budget-bytes", "9"]):
        result = run_cli(*command, "--dsn", blank)
        assert result.returncode == 1, result.stderr
        [line] = result.stderr.strip().splitlines()
        messages.append(line)
    assert all("run `pycompactor migrate` first" in m for m in messages), messages
