"""`pycompactor evaluate` as a subprocess: a JSONL file with the offline model, a live
database as a read-only role (left byte for byte as it was), and an OpenAI-compatible
server through the real `openai` client on both APIs, reporting token usage."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor.summarizers.openai_compatible import load_prompt
from tests.e2e.cli import run_cli
from tests.e2e.test_cli_contract import documented_shapes, mismatches
from tests.modelserver import ModelServer, RecordedRequest, ScriptedResponse, response, stop
from tests.workerkit import seed, worker_env

Conn = psycopg.Connection[Any]


def write_jsonl(path: Path) -> Path:
    """Two conversations: 41 English pairs (ranges 0-9 and 10-19 are targets) and 30
    Chinese ones (range 0-9), plus one too short for any target."""
    lines = [
        {"conversation_id": "en-1", "language": "en", "pairs": [
            {"user": f"USER-SECRET question {i}",
             "assistant": f"Fund F{i} is no longer at {i}.25 since 2026-10-{i % 28 + 1:02d}. "
                          "Some background without numbers."} for i in range(41)]},
        {"conversation_id": "zh-1", "language": "zh", "pairs": [
            {"user": f"问题 {i}", "assistant": f"基金{i}的费用不再是{i}.5%，仅限今年。"}
            for i in range(30)]},
        {"conversation_id": "short", "language": "en", "pairs": [
            {"user": "hi", "assistant": "hello"}]},
    ]
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def test_jsonl_with_the_offline_model(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "history.jsonl")
    result = run_cli("evaluate", "--jsonl", str(source), "--json",
                     "--model", "pycompactor/extractive-2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"model", "api", "source", "budgets", "overall", "by_language",
                           "reach", "worst", "conversations", "label", "frontier",
                           "compared", "warnings", "stored_by_model"}
    assert (report["model"], report["api"], report["source"]) == (
        "pycompactor/extractive-2", None, "jsonl:history.jsonl")
    assert report["budgets"] == [8192, 16384, 32768, 65536]
    en, zh, short = report["conversations"]
    assert [(r["from_pair"], r["to_pair"]) for r in en["ranges"]] == [(0, 9), (10, 19)]
    assert [(r["from_pair"], r["to_pair"]) for r in zh["ranges"]] == [(0, 9)]
    assert (short["pairs"], short["ranges"]) == (1, [])
    first = en["ranges"][0]
    # Ten fund numbers (F0..F9), ten values and ten dates, all distinct.
    assert first["figures_total"] == 30
    # extractive-2 writes at most 0.35 of the replies' bytes by default: here room for
    # the figures of six of the ten replies, cut to the figures and their "no longer",
    # and the measures say so.
    assert first["figure_retention"] == first["figures_kept"] / 30 == 0.6
    assert first["compression"] <= 0.35
    assert first["qualifiers_total"] == 30  # each of them with "no longer"
    assert (first["input_tokens"], first["output_tokens"]) == (None, None)
    assert first["compression"] == first["summary_bytes"] / first["replies_bytes"]
    assert set(report["by_language"]) == {"en", "zh"}
    assert report["overall"]["ranges"] == 3
    assert [r["pairs"] for r in report["reach"]] == [72] * 4
    for reach in report["reach"]:
        assert 0 <= reach["raw_only"] <= reach["pairs"]
        assert reach["gain"] == reach["compacted"] - reach["raw_only"]

    table = run_cli("evaluate", "--jsonl", str(source))
    assert table.returncode == 0, table.stderr
    for heading in ("Per range", "Pooled", "History the next Run sees", "compression",
                    "figure retention", "qualifier retention", "reached raw only"):
        assert heading in table.stdout
    assert "\x1b[" not in table.stdout  # readable off a terminal


def test_corpus_with_extractive_3_by_default() -> None:
    result = run_cli("evaluate", "--corpus", "--limit", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["model"], report["source"]) == ("pycompactor/extractive-3", "corpus:seed=0")
    assert report["label"] == "pycompactor/extractive-3@0.4"  # its own default target
    assert len(report["conversations"]) == 2
    assert report["overall"]["ranges"] == sum(
        len(c["ranges"]) for c in report["conversations"]) > 0
    assert report["overall"]["compression"] <= 0.4
    assert report["overall"]["invented_figures"] == 0


def test_html_report_is_one_self_contained_file(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "history.jsonl")
    page = tmp_path / "report.html"
    result = run_cli("evaluate", "--jsonl", str(source), "--html", str(page))
    assert result.returncode == 0, result.stderr
    assert f"HTML report written to {page}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl", "report.html"]
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert html.count("<svg") == 6
    for outside in ("http://", "https://", "<script", "<link", "@import", "url(", "src="):
        assert outside not in html, outside


def test_compare_puts_models_side_by_side(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "history.jsonl")
    page = tmp_path / "report.html"
    args = ("evaluate", "--jsonl", str(source), "--model", "pycompactor/extractive-2",
            "--compare", "baseline/whole-sentences@0.5", "--compare", "pycompactor/extractive-1")
    result = run_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert mismatches(documented_shapes()["evaluate"], report) == []
    assert report["label"] == "pycompactor/extractive-2@0.35"
    assert [p["label"] for p in report["frontier"]] == [
        "pycompactor/extractive-2@0.35", "baseline/whole-sentences@0.5",
        "pycompactor/extractive-1"]
    baseline = report["compared"][0]
    assert baseline["overall"]["ranges"] == report["overall"]["ranges"] == 3
    assert baseline["overall"]["compression"] <= 0.5
    assert [w["from_pair"] for w in baseline["worst"]] == [
        w["from_pair"] for w in report["worst"]]
    assert report["worst"], "the sample's ranges ask questions"
    table = run_cli(*args, "--html", str(page))
    assert table.returncode == 0, table.stderr
    for heading in ("Side by side", "The worst ranges", "attribution", "qualifier scope",
                    "baseline/whole-sentences@0.5"):
        assert heading in table.stdout
    html = page.read_text(encoding="utf-8")
    assert html.count("<circle") >= 3  # the frontier: one point per summarizer
    bad = run_cli("evaluate", "--jsonl", str(source), "--compare", "m@1.5")
    assert bad.returncode == 2
    assert "expected MODEL or MODEL@R" in bad.stderr


def test_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text('{"conversation_id": "c", "language": "en", "pairs": []}\n'
                      '{"conversation_id": "d", "pairs": []}\n', encoding="utf-8")
    result = run_cli("evaluate", "--jsonl", str(source))
    assert result.returncode == 1
    assert result.stderr.startswith(f"pycompactor: error: {source}:2: expected ")
    assert result.stderr.count("\n") == 1


# --- a live database, read-only -------------------------------------------------------


def snapshot(conn: Conn) -> dict[str, list[str]]:
    """Every row of every table of the engine (schema compaction) and of the source
    tables, as text, in order: equal snapshots mean nothing was written."""
    tables = conn.execute(
        "SELECT table_schema, table_name FROM information_schema.tables"
        " WHERE table_schema IN ('compaction', 'compaction_source')"
        " AND table_type = 'BASE TABLE' ORDER BY 1, 2").fetchall()
    assert len(tables) > 10
    out = {}
    for schema, table in tables:
        rows = conn.execute(sql.SQL("SELECT t::text FROM {}.{} AS t ORDER BY 1").format(
            sql.Identifier(schema), sql.Identifier(table))).fetchall()
        out[f"{schema}.{table}"] = [str(r[0]) for r in rows]
    # Sequences too: a write that rolled back would still have advanced one.
    out["sequences"] = [str(r) for r in conn.execute(
        "SELECT schemaname, sequencename, last_value FROM pg_catalog.pg_sequences"
        " WHERE schemaname IN ('compaction', 'compaction_source') ORDER BY 1, 2").fetchall()]
    return out


@pytest.fixture
def reader_dsn(conn: Conn, dsn: str, postgresql_proc: PostgreSQLExecutor) -> Iterator[str]:
    """A LOGIN role with only compaction_reader's grants."""
    name = f"evaluator_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE compaction_reader").format(
        sql.Identifier(name)))
    yield dsn.replace("user=postgres", f"user={name}")
    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_live_database_as_a_reader_writes_nothing(conn: Conn, dsn: str,
                                                  reader_dsn: str) -> None:
    seed(conn, "conv-a", 45)
    seed(conn, "conv-b", 30)
    seed(conn, "conv-c", 12)
    # A worker pass first, so the engine's tables hold jobs, attempts, summaries and
    # events whose rows the evaluation must leave alone.
    worker = run_cli("worker", "--once", "--conversation", "conv-b", "--model",
                     "pycompactor/extractive-1", "--dsn", dsn)
    assert worker.returncode == 0, worker.stderr
    before = snapshot(conn)
    assert before["compaction.jobs"]
    assert before["compaction.queue"]

    result = run_cli("evaluate", "--database", "--dsn", reader_dsn, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["source"] == "database"
    assert [(c["conversation_id"], c["pairs"], len(c["ranges"]))
            for c in report["conversations"]] == [("conv-a", 45, 2), ("conv-b", 30, 1),
                                                  ("conv-c", 12, 0)]
    assert {c["language"] for c in report["conversations"]} == {"en"}
    assert all(r["failure"] is None for c in report["conversations"] for r in c["ranges"])
    assert snapshot(conn) == before

    # One conversation, as the superuser: no write at all, not just none permitted.
    only = run_cli("evaluate", "--database", "--conversation", "conv-a", "--dsn", dsn)
    assert only.returncode == 0, only.stderr
    assert "conv-a" in only.stdout
    assert "conv-b" not in only.stdout
    assert snapshot(conn) == before


def test_database_options_need_database(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "history.jsonl")
    result = run_cli("evaluate", "--jsonl", str(source), "--limit", "3")
    assert result.returncode == 1
    assert "--limit applies to --database and --corpus only" in result.stderr
    result = run_cli("evaluate", "--corpus", "--conversation", "c")
    assert result.returncode == 1
    assert "--conversation applies to --database only" in result.stderr


# --- an OpenAI-compatible server, both APIs -------------------------------------------


SUMMARY = "Fund F1 is no longer at 1.25 since 2026-10-02."


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    def answer(request: RecordedRequest) -> ScriptedResponse:
        if request.path in ("/v1/responses", "/responses"):
            return response(SUMMARY, usage=(2100, 35))
        return stop(SUMMARY, usage=(2000, 30))

    with ModelServer(handler=answer) as server:
        yield server
    assert server.errors == []


@pytest.mark.parametrize(("api", "path", "usage"), [
    ("chat", "/v1/chat/completions", (2000, 30)),
    ("responses", "/v1/responses", (2100, 35)),
])
def test_openai_compatible_server_reports_tokens(
        tmp_path: Path, model_server: ModelServer, api: str, path: str,
        usage: tuple[int, int]) -> None:
    source = write_jsonl(tmp_path / "history.jsonl")
    # The key from the environment, the server from --base-url.
    env = {k: v for k, v in worker_env("", model_server.base_url).items()
           if k not in {"OPENAI_BASE_URL", "PYCOMPACTOR_DSN"}}
    result = run_cli("evaluate", "--jsonl", str(source), "--model", "test-model-7",
                     "--base-url", model_server.base_url, "--api", api, "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["model"], report["api"]) == ("test-model-7", api)
    assert [r.path for r in model_server.requests] == [path] * 3
    for request in model_server.requests:
        body = request.json
        assert body["model"] == "test-model-7"
        assert b"USER-SECRET" not in request.body  # the model sees replies only
        prompt = body["instructions"] if api == "responses" else body["messages"][0]["content"]
        assert prompt == load_prompt()
    ranges = [r for c in report["conversations"] for r in c["ranges"]]
    assert [(r["input_tokens"], r["output_tokens"]) for r in ranges] == [usage] * 3
    assert (report["overall"]["input_tokens"], report["overall"]["output_tokens"]) == (
        3 * usage[0], 3 * usage[1])
    first = report["conversations"][0]["ranges"][0]
    assert first["summary_bytes"] == len(SUMMARY)
    # F1's 1, 1.25 and 2026-10-02, each still with its "no longer".
    assert (first["figures_kept"], first["qualifiers_kept"]) == (3, 3)
    table = run_cli("evaluate", "--jsonl", str(source), "--model", "test-model-7",
                    "--base-url", model_server.base_url, "--api", api, env=env)
    assert table.returncode == 0, table.stderr
    assert f"{usage[0]}/{usage[1]}" in table.stdout
    assert f"{3 * usage[0]}/{3 * usage[1]}" in table.stdout
