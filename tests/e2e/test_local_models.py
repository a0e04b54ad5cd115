"""Your own model: the worker and evaluate pointed at a local OpenAI-compatible server by
flag (llama.cpp's llama-server, vLLM, Ollama, answered as each would by the scripted
server), the output limit and temperature they send, model names checked up front, and
a server that is not there."""

from __future__ import annotations

import json
import socket
from typing import Any

import psycopg
import pytest

from pycompactor.summarizers.openai_compatible import DEFAULT_MAX_OUTPUT_TOKENS, OpenAISummarizer
from tests import modelserver as ms
from tests.e2e.cli import run_cli
from tests.history import History
from tests.modelserver import LOCAL_SERVERS, ModelServer, local_server
from tests.workerkit import worker_env

Conn = psycopg.Connection[Any]
#: No figure: the replies' figures are their pair numbers, and a summary stating any
#: other would fail `figures_invented` (contract §8), which these tests do not measure.
SUMMARY = "Funds compared: NAVs and fees as the replies gave them."
#: What docs/models.md gives as each server's model name (llama.cpp takes any).
MODEL = {"llama.cpp": "qwen2.5-7b-instruct", "vllm": "Qwen/Qwen2.5-7B-Instruct",
         "ollama": "llama3.1:8b"}


def attempts(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT model, state, reason, finish_reason FROM compaction.audit_jobs"
                        " ORDER BY job_id, attempt").fetchall()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def env(dsn: str) -> dict[str, str]:
    # The flag alone points the worker, over OPENAI_BASE_URL (here a port nobody serves);
    # a local server takes any key.
    return worker_env(dsn, None, OPENAI_API_KEY="local",
                      OPENAI_BASE_URL=f"http://127.0.0.1:{closed_port()}/v1")


@pytest.mark.parametrize("kind", sorted(LOCAL_SERVERS))
def test_the_worker_reaches_a_local_server_by_flag(conn: Conn, dsn: str, kind: str) -> None:
    History(conn).pairs("c", 30)
    with ModelServer(handler=local_server(kind, SUMMARY)) as server:
        result = run_cli("worker", "--once", "--conversation", "c", "--model", MODEL[kind],
                         "--base-url", server.base_url, env=env(dsn))
        [request] = server.requests
    assert result.returncode == 0, result.stderr
    assert server.errors == []
    body = request.json
    assert (body["model"], body["max_tokens"], body["temperature"]) == (
        MODEL[kind], DEFAULT_MAX_OUTPUT_TOKENS, 0)
    assert attempts(conn) == [(MODEL[kind], "completed", "completed", "stop")]


@pytest.mark.parametrize("kind", sorted(LOCAL_SERVERS))
def test_a_wordy_model_with_and_without_the_limit(conn: Conn, dsn: str, kind: str) -> None:
    """Without a limit (0 sends none), a 7,000-character answer fails too_long as before;
    with one, the server stops the model at the limit ("length": not_stopped) instead of
    letting it write on; a model that ends within the limit completes."""
    History(conn).pairs("w", 50)  # ranges 0 and 10
    wordy = "The fund's NAV was stable. " * 260  # 7,020 characters, no figure
    with ModelServer(handler=local_server(kind, wordy)) as server:
        unlimited = run_cli("worker", "--once", "--conversation", "w", "--model", MODEL[kind],
                            "--base-url", server.base_url, "--max-output-tokens", "0",
                            env=env(dsn))
        assert unlimited.returncode == 0, unlimited.stderr
        assert "max_tokens" not in server.requests[-1].json
        assert attempts(conn)[-2:] == [(MODEL[kind], "failed", "too_long", "stop")] * 2

        conn.execute("DELETE FROM compaction_source.messages WHERE conversation_id = 'w'")
        History(conn).pairs("w2", 30)
        limited = run_cli("worker", "--once", "--conversation", "w2", "--model", MODEL[kind],
                          "--base-url", server.base_url, "--max-output-tokens", "1000",
                          env=env(dsn))
        assert limited.returncode == 0, limited.stderr
        assert server.requests[-1].json["max_tokens"] == 1000
        assert attempts(conn)[-1] == (MODEL[kind], "failed", "not_stopped", "length")
    with ModelServer(handler=local_server(kind, wordy[:3900])) as server:
        History(conn).pairs("w3", 30)
        fits = run_cli("worker", "--once", "--conversation", "w3", "--model", MODEL[kind],
                       "--base-url", server.base_url, "--max-output-tokens", "1000",
                       env=env(dsn))
        assert fits.returncode == 0, fits.stderr
    assert attempts(conn)[-1] == (MODEL[kind], "completed", "completed", "stop")


def test_evaluate_takes_the_same_options(tmp_path: Any) -> None:
    history = tmp_path / "h.jsonl"
    history.write_text(json.dumps({"conversation_id": "c", "language": "en", "pairs": [
        {"user": f"q{i}", "assistant": f"Fund F{i} NAV {i}.25."} for i in range(30)]}) + "\n")
    with ModelServer(handler=local_server("ollama", SUMMARY)) as server:
        result = run_cli("evaluate", "--jsonl", str(history), "--model", "llama3.1:8b",
                         "--base-url", server.base_url, "--max-output-tokens", "700",
                         "--temperature", "0.2", "--json", env={"OPENAI_API_KEY": "ollama"})
        [request] = server.requests
    assert result.returncode == 0, result.stderr
    assert (request.json["max_tokens"], request.json["temperature"]) == (700, 0.2)
    report = json.loads(result.stdout)
    assert report["overall"]["failed"] == 0
    assert report["warnings"] == []


def test_a_model_the_server_does_not_serve_fails_every_range_and_evaluate_says_so(
        tmp_path: Any) -> None:
    history = tmp_path / "h.jsonl"
    history.write_text(json.dumps({"conversation_id": "c", "language": "en", "pairs": [
        {"user": f"q{i}", "assistant": f"reply {i}"} for i in range(40)]}) + "\n")
    with ModelServer(handler=local_server("vllm", SUMMARY)) as server:
        result = run_cli("evaluate", "--jsonl", str(history), "--model", "qwen-typo",
                         "--base-url", server.base_url, "--json",
                         env={"OPENAI_API_KEY": "x"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "pycompactor: every one of the 2 ranges failed (http_404); nothing was measured")


@pytest.mark.parametrize("command", [["worker", "--once"], ["evaluate", "--corpus"]])
def test_a_mistyped_offline_model_gets_did_you_mean(dsn: str, command: list[str]) -> None:
    for key in ({}, {"OPENAI_API_KEY": "sk-set"}):
        result = run_cli(*command, "--model", "pycompactor/extractve-2", "--dsn", dsn,
                         env=key)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines()[-1].endswith(
            "error: unknown model 'pycompactor/extractve-2'; did you mean "
            "pycompactor/extractive-2? (offline models: pycompactor/extractive-1, "
            "pycompactor/extractive-2, pycompactor/extractive-3)")


def test_a_remote_model_without_a_key_is_pointed_at_the_default_offline_model(dsn: str) -> None:
    result = run_cli("worker", "--once", "--model", "gpt-4o-mini", "--dsn", dsn,
                     env={"OPENAI_API_KEY": ""})
    assert result.returncode == 2
    assert "or use the offline --model pycompactor/extractive-3" in result.stderr


def test_the_worker_stops_when_its_first_call_cannot_connect(conn: Conn, dsn: str) -> None:
    History(conn).pairs("c", 50)
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = run_cli("worker", "--once", "--conversation", "c", "--model", "m",
                     "--base-url", url, "--timeout-seconds", "5", env=env(dsn))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pycompactor: error: cannot connect to the model server at {url}/ ")
    assert last.endswith("start the server or fix --base-url (OPENAI_BASE_URL)")
    # The first attempt is recorded as any failed one; the worker claimed no more after it.
    assert {row[1:3] for row in attempts(conn)} <= {("failed", "connection_error")}


def test_evaluate_stops_when_its_first_call_cannot_connect() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = run_cli("evaluate", "--corpus", "--limit", "2", "--model", "m", "--base-url", url,
                     "--timeout-seconds", "5", env={"OPENAI_API_KEY": "x"})
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"pycompactor: error: cannot connect to the model server at {url}/ ")


def test_a_refused_knob_is_dropped_or_renamed(model_server: ModelServer) -> None:
    """As OpenAI's reasoning models answer: no temperature but the default, and the
    output limit only as max_completion_tokens."""
    model_server.enqueue(
        ms.json_response({"error": {"message": "Unsupported value: 'temperature' does not "
                                    "support 0 with this model.", "type": "invalid_request_error",
                                    "param": "temperature", "code": "unsupported_value"}},
                         status=400),
        ms.json_response({"error": {"message": "Unsupported parameter: 'max_tokens' is not "
                                    "supported with this model. Use 'max_completion_tokens' "
                                    "instead.", "type": "invalid_request_error",
                                    "param": None, "code": "unsupported_parameter"}},
                         status=400),
        ms.stop(SUMMARY), ms.stop(SUMMARY))
    pairs = [ms_pair(i) for i in range(10)]
    with OpenAISummarizer("o4-mini", base_url=model_server.base_url, api_key="k") as summarizer:
        first = summarizer.summarize(pairs)
        second = summarizer.summarize(pairs)
        assert summarizer.knobs == {"max_completion_tokens": DEFAULT_MAX_OUTPUT_TOKENS}
    assert getattr(first, "text", None) == getattr(second, "text", None) == SUMMARY
    sent = [set(r.json) - {"model", "messages"} for r in model_server.requests]
    assert sent == [{"max_tokens", "temperature"}, {"max_tokens"},
                    {"max_completion_tokens"}, {"max_completion_tokens"}]


def ms_pair(i: int) -> Any:
    from pycompactor.models import Pair

    return Pair(i, f"r{i}", f"u{i}", "user text", f"a{i}", f"reply {i}")
