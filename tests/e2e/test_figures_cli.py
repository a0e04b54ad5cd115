"""Figures kept and token usage through the command line: the worker's
--min-figure-retention (flag and environment), and what `pycompactor audit` shows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pycompactor.summarizers.extractive import OFFLINE_MODEL
from tests.e2e.cli import run_cli
from tests.modelserver import ModelServer, stop
from tests.workerkit import MODEL, attempts, events_named, run_worker_cli, seed, worker_env

Conn = psycopg.Connection[Any]

#: 20 of the 30 figures of the seeded range pairs 0-9 (see tests/driver/test_figures.py).
TWENTY = " ".join([f"{10 + i}.25" for i in range(10)] + [f"2026-03-{i:02d}" for i in
                                                          range(1, 11)])


def table_cells(text: str) -> list[dict[str, str]]:
    """The rows of a rendered table by column name (columns start where headers do)."""
    header, rule, *rows = text.splitlines()
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    names = header.split()
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{n: row[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)}
            for row in rows]


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    with ModelServer(handler=lambda _request: stop(TWENTY, usage=(1500, 120))) as server:
        yield server
    assert server.errors == []


def test_help_documents_the_flag_and_its_variable() -> None:
    result = run_cli("worker", "--help")
    assert "--min-figure-retention R" in result.stdout
    assert "PYCOMPACTOR_MIN_FIGURE_RETENTION" in result.stdout


@pytest.mark.parametrize("value", ["-0.1", "1.01", "nan", "seventy", ""])
def test_a_bad_environment_value_is_a_usage_error(value: str) -> None:
    result = run_cli("worker", "--model", OFFLINE_MODEL,
                     env={"PYCOMPACTOR_MIN_FIGURE_RETENTION": value})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.rstrip("\n").split("\n")
    assert lines[-1].startswith("pycompactor worker: error: argument --min-figure-retention:")
    assert [line for line in lines if ": error:" in line] == [lines[-1]]
    assert "Traceback" not in result.stderr


def test_gate_from_the_environment_and_the_flag(conn: Conn, dsn: str,
                                                model_server: ModelServer) -> None:
    """20 of 30 figures kept: 0.7 (from the environment) fails it, and the flag (which
    wins over the environment) at 0.6 lets the retry complete."""
    seed(conn, "conv-1", 30)
    env = worker_env(dsn, model_server.base_url, PYCOMPACTOR_MIN_FIGURE_RETENTION="0.7")
    code, events, stderr = run_worker_cli("--model", MODEL, "--once", env=env)
    assert code == 0, stderr
    [started] = events_named(events, "started")
    assert started["min_figure_retention"] == 0.7
    [failed] = events_named(events, "failed")
    assert (failed["reason"], failed["figures_total"], failed["figures_kept"],
            failed["input_tokens"], failed["output_tokens"]) == ("figures_lost", 30, 20,
                                                                  1500, 120)
    code, events, stderr = run_worker_cli("--model", MODEL, "--once",
                                          "--min-figure-retention", "0.6", env=env)
    assert code == 0, stderr
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn)] == [
        (1, "failed", "figures_lost"), (2, "completed", "completed")]

    table = run_cli("audit", "--dsn", dsn)
    assert table.returncode == 0, table.stderr
    cells = table_cells(table.stdout)
    assert [(r["attempt"], r["reason"], r["figures_kept"], r["input_tokens"],
             r["output_tokens"]) for r in cells] == [
        ("1", "figures_lost", "", "", ""), ("2", "completed", "20/30", "1500", "120")]

    out = run_cli("audit", "--json", "--dsn", dsn)
    [first, second] = json.loads(out.stdout)
    assert {k: second[k] for k in ("attempt", "input_tokens", "output_tokens",
                                   "figures_total", "figures_kept")} == {
        "attempt": 2, "input_tokens": 1500, "output_tokens": 120, "figures_total": 30,
        "figures_kept": 20}
    assert (first["reason"], first["figures_total"], first["input_tokens"]) == (
        "figures_lost", None, None)


def test_extractive_worker_keeps_all_30_figures(conn: Conn, dsn: str) -> None:
    seed(conn, "conv-1", 30)
    code, events, stderr = run_worker_cli(
        "--model", OFFLINE_MODEL, "--once", "--min-figure-retention", "1",
        env=worker_env(dsn))
    assert code == 0, stderr
    [done] = events_named(events, "completed")
    assert (done["figures_total"], done["figures_kept"]) == (30, 30)
    assert "input_tokens" not in done  # the offline summarizer reports no usage
    out = json.loads(run_cli("audit", "--json", "--dsn", dsn).stdout)
    assert [(r["state"], r["figures_kept"], r["figures_total"], r["input_tokens"])
            for r in out] == [("completed", 30, 30, None)]


def test_help_documents_max_invented_figures() -> None:
    result = run_cli("worker", "--help")
    assert "--max-invented-figures N" in result.stdout
    assert "PYCOMPACTOR_MAX_INVENTED_FIGURES" in result.stdout


@pytest.mark.parametrize("value", ["-1", "6001", "1.5", "many"])
def test_a_bad_allowance_is_a_usage_error(value: str) -> None:
    result = run_cli("worker", "--model", OFFLINE_MODEL, "--max-invented-figures", value)
    assert result.returncode == 2, result.stderr
    last = result.stderr.rstrip("\n").split("\n")[-1]
    assert last.startswith("pycompactor worker: error: argument --max-invented-figures:")
    assert "Traceback" not in result.stderr


def test_invented_figures_fail_by_default_and_the_flag_allows_them(conn: Conn, dsn: str,
                                                                   ) -> None:
    """The model's summary quotes 99.99, which no reply holds: the default fails the
    attempt (figures_invented); the environment's allowance of 1 lets the retry through,
    and `audit` shows the count."""
    seed(conn, "conv-1", 30)
    text = TWENTY + " and 99.99"
    with ModelServer(handler=lambda _request: stop(text, usage=(1500, 120))) as server:
        env = worker_env(dsn, server.base_url)
        code, events, stderr = run_worker_cli("--model", MODEL, "--once", env=env)
        assert code == 0, stderr
        [failed] = events_named(events, "failed")
        assert (failed["reason"], failed["figures_invented"]) == ("figures_invented", 1)
        env["PYCOMPACTOR_MAX_INVENTED_FIGURES"] = "1"
        code, events, stderr = run_worker_cli("--model", MODEL, "--once", env=env)
        assert code == 0, stderr
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn)] == [
        (1, "failed", "figures_invented"), (2, "completed", "completed")]
    cells = table_cells(run_cli("audit", "--dsn", dsn).stdout)
    assert [(r["reason"], r["figures_invented"]) for r in cells] == [
        ("figures_invented", ""), ("completed", "1")]
    rows = json.loads(run_cli("audit", "--json", "--dsn", dsn).stdout)
    assert [r["figures_invented"] for r in rows] == [None, 1]
