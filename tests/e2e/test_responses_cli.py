"""`pycompactor worker --api responses` as a subprocess: the real `openai` client against
the loopback server's /v1/responses, results in the audit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pycompactor.summarizers.openai_compatible import load_prompt
from tests.e2e.cli import run_cli
from tests.modelserver import ModelServer, RecordedRequest, ScriptedResponse, response
from tests.workerkit import (
    MODEL,
    attempts,
    events_named,
    run_worker_cli,
    seed,
    summaries,
    user_text,
    worker_env,
)

Conn = psycopg.Connection[Any]


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    def answer(request: RecordedRequest) -> ScriptedResponse:
        if b"conv-inc-a" in request.body:
            return response("cut", status="incomplete", incomplete_reason="max_output_tokens")
        return response("NAVs 10.25 and 11.25 on 2026-03-01.", usage=(3000, 40))

    with ModelServer(handler=answer) as server:
        yield server
    assert server.errors == []


def test_worker_speaks_the_responses_api(conn: Conn, dsn: str,
                                         model_server: ModelServer) -> None:
    seed(conn, "conv-ok", 30)
    seed(conn, "conv-inc", 30)
    code, events, stderr = run_worker_cli(
        "--model", MODEL, "--once", "--api", "responses",
        env=worker_env(dsn, model_server.base_url))
    assert code == 0, stderr
    [started] = events_named(events, "started")
    assert started["api"] == "responses"
    assert sorted(r.path for r in model_server.requests) == ["/v1/responses"] * 2
    for request in model_server.requests:
        assert request.json["instructions"] == load_prompt()
        assert b"USER-SECRET" not in request.body
        assert user_text("conv-ok", 0).encode() not in request.body
    assert [(a.state, a.reason) for a in attempts(conn)] == [
        ("failed", "not_stopped"), ("completed", "completed")]  # conv-inc, conv-ok
    assert summaries(conn, "conv-ok") == [("conv-ok", 0, "NAVs 10.25 and 11.25 on 2026-03-01.")]
    rows = {r["conversation_id"]: r for r in json.loads(
        run_cli("audit", "--json", "--dsn", dsn).stdout)}
    ok, inc = rows["conv-ok"], rows["conv-inc"]
    assert (ok["input_tokens"], ok["output_tokens"], ok["figures_total"],
            ok["figures_kept"]) == (3000, 40, 30, 3)
    assert (inc["finish_reason"], inc["reason"], inc["figures_kept"]) == (
        "incomplete:max_output_tokens", "not_stopped", 0)


def test_offline_model_ignores_the_api_flag(conn: Conn, dsn: str) -> None:
    seed(conn, "conv-1", 30)
    code, _events, stderr = run_worker_cli(
        "--model", "pycompactor/extractive-1", "--once", "--api", "responses",
        env=worker_env(dsn))
    assert code == 0, stderr
    assert [(a.state, a.reason) for a in attempts(conn)] == [("completed", "completed")]
