"""`worker --api responses`: the Responses API through the real `openai` client against the
loopback scripted server, every outcome kind ending as contract §8 says."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from pycompactor.errors import UsageError
from pycompactor.summarizers.openai_compatible import (
    OpenAISummarizer,
    load_prompt,
    make_summarizer,
    replies_document,
)
from pycompactor.summarizers.outcomes import Reply, parse_response
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig
from tests.driver.conftest import make_pairs
from tests.modelserver import (
    ModelServer,
    ScriptedResponse,
    function_call_item,
    hang,
    http_error,
    json_response,
    message_item,
    output_text,
    raw,
    reasoning_item,
    refusal_part,
    response,
    response_body,
    tool_item,
)
from tests.workerkit import (
    MODEL,
    StringLog,
    attempts,
    events_named,
    seed,
    source_digest,
    summaries,
    user_text,
)

Conn = psycopg.Connection[Any]


def run_responses_worker(dsn: str, base_url: str, *, timeout_seconds: float = 10.0,
                         **options: Any) -> StringLog:
    log = StringLog()
    with OpenAISummarizer(MODEL, base_url=base_url, api_key="k", api="responses",
                          timeout_seconds=timeout_seconds) as summarizer:
        config = WorkerConfig(model=MODEL, dsn=dsn, once=True, log_format="json", **options)
        Worker(config, summarizer, log=EventLog("json", stream=log)).run()
    return log


def attempt_detail(conn: Conn) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(
        "SELECT attempt, state, reason, finish_reason, tool_call_count, response_id,"
        " input_tokens, output_tokens FROM compaction.audit_jobs ORDER BY job_id, attempt"
    ).fetchall()]


def test_request_shape_and_a_completed_summary(conn: Conn, dsn: str,
                                               model_server: ModelServer) -> None:
    seeded = seed(conn, "conv-1", 30)
    before = source_digest(conn)
    model_server.enqueue(response("Funds F0-F9: NAVs 10.25 to 19.25.", response_id="resp_42",
                                  usage=(2048, 96)))
    log = run_responses_worker(dsn, model_server.base_url)
    [request] = model_server.requests
    assert request.path == "/v1/responses"
    body = request.json
    # The same pinned prompt as instructions, the same labelled replies as input, no tools.
    pairs_0_9 = make_pairs([p.assistant_content for p in seeded[:10]])
    expected_input = json.loads(replies_document(pairs_0_9))
    assert set(body) == {"model", "instructions", "input", "store", "max_output_tokens",
                         "temperature"}
    assert (body["max_output_tokens"], body["temperature"]) == (2000, 0)
    assert (body["model"], body["instructions"], body["store"]) == (MODEL, load_prompt(), False)
    labelled = json.loads(body["input"])["assistant_replies"]
    assert [r["content"] for r in labelled] == [r["content"] for r in
                                                expected_input["assistant_replies"]]
    assert [r["assistant_message_id"] for r in labelled] == [p.assistant_message_id
                                                             for p in seeded[:10]]
    for i in range(30):  # never user text, of any pair
        assert user_text("conv-1", i).encode() not in request.body
    assert attempt_detail(conn) == [(1, "completed", "completed", "stop", 0, "resp_42", 2048,
                                     96)]
    assert summaries(conn) == [("conv-1", 0, "Funds F0-F9: NAVs 10.25 to 19.25.")]
    [done] = events_named(log.events(), "completed")
    # 0 and 9 (of F0-F9), 10.25 and 19.25: 4 of the range's 30 figures.
    assert (done["figures_total"], done["figures_kept"]) == (30, 4)
    assert source_digest(conn) == before


CASES: list[tuple[str, ScriptedResponse, str, str | None, int]] = [
    # (name, answer, recorded reason, stored finish_reason, tool_call_count)
    ("incomplete_max_output_tokens",
     response("Funds F0 to", status="incomplete", incomplete_reason="max_output_tokens"),
     "not_stopped", "incomplete:max_output_tokens", 0),
    ("incomplete_content_filter",
     response(None, status="incomplete", incomplete_reason="content_filter"),
     "not_stopped", "incomplete:content_filter", 0),
    ("status_failed", response(None, status="failed"), "not_stopped", "failed", 0),
    ("function_call_with_text",
     response("Good text.", extra_items=(function_call_item(),)), "tool_calls", "stop", 1),
    ("function_call_only",
     json_response(response_body([function_call_item()])), "tool_calls", "stop", 1),
    ("built_in_tool_items",
     response("Text.", extra_items=(tool_item("web_search_call"),
                                    tool_item("file_search_call", item_id="fs_1"))),
     "tool_calls", "stop", 2),
    ("empty_text", response(" \t\n"), "empty", "stop", 0),
    ("no_output", json_response(response_body([])), "empty", "stop", 0),
    ("too_long", response("x" * 6001), "too_long", "stop", 0),
]


@pytest.mark.parametrize(("answer", "reason", "finish_reason", "tools"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_judged_by_the_database(conn: Conn, dsn: str, model_server: ModelServer,
                                answer: ScriptedResponse, reason: str,
                                finish_reason: str | None, tools: int) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(answer)
    run_responses_worker(dsn, model_server.base_url)
    assert attempt_detail(conn) == [(1, "failed", reason, finish_reason, tools, "resp_test",
                                     1, 1)]
    assert summaries(conn) == []


PYTHON_FAILURES: list[tuple[str, list[ScriptedResponse], str]] = [
    ("refusal", [json_response(response_body([message_item(refusal_part("No."))]))],
     "refusal"),
    ("refusal_after_text", [json_response(response_body(
        [message_item(output_text("Partial."), refusal_part("No more."))]))], "refusal"),
    ("two_messages", [json_response(response_body(
        [message_item(output_text("One.")), message_item(output_text("Two."), item_id="m2")]
    ))], "multiple_messages"),
    ("non_text_part", [json_response(response_body(
        [message_item({"type": "output_image", "url": "x"})]))], "malformed_response"),
    ("no_status", [json_response({"id": "r", "output": []})], "malformed_response"),
    ("output_not_a_list", [json_response({"id": "r", "status": "completed",
                                          "output": {}})], "malformed_response"),
    ("not_json", [raw(b'{"id": "resp_x", "output": [')], "malformed_response"),
    ("nul_in_text", [response("bad \x00 text")], "invalid_text"),
    ("http_500", [http_error(500), http_error(500)], "http_500"),
    ("http_400", [http_error(400)], "http_400"),
    ("http_429_then_503", [http_error(429, retry_after="0"), http_error(503)], "http_503"),
]


@pytest.mark.parametrize(("script", "reason"), [c[1:] for c in PYTHON_FAILURES],
                         ids=[c[0] for c in PYTHON_FAILURES])
def test_failures_judged_in_python(conn: Conn, dsn: str, model_server: ModelServer,
                                   script: list[ScriptedResponse], reason: str) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(*script)
    log = run_responses_worker(dsn, model_server.base_url)
    assert len(model_server.requests) == len(script)
    assert all(r.path == "/v1/responses" for r in model_server.requests)
    assert [(a.attempt, a.state, a.reason) for a in attempts(conn)] == [(1, "failed", reason)]
    [failed] = events_named(log.events(), "failed")
    assert failed["reason"] == reason
    assert summaries(conn) == []


def test_timeout(conn: Conn, dsn: str, model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(hang(response("too late")))
    run_responses_worker(dsn, model_server.base_url, timeout_seconds=0.5)
    assert [(a.state, a.reason) for a in attempts(conn)] == [("failed", "timeout")]


def test_reasoning_items_are_not_tool_calls(conn: Conn, dsn: str,
                                            model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(json_response(response_body(
        [reasoning_item(), message_item(output_text("First "), output_text("second."))])))
    run_responses_worker(dsn, model_server.base_url)
    assert summaries(conn) == [("conv-1", 0, "First second.")]


def test_gate_applies_to_the_responses_api(conn: Conn, dsn: str,
                                           model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(response("Nothing numeric."))
    run_responses_worker(dsn, model_server.base_url, min_figure_retention=0.1)
    assert [(a.state, a.reason) for a in attempts(conn)] == [("failed", "figures_lost")]


@pytest.mark.parametrize(("body", "expected"), [
    (response_body([message_item(output_text("ok"))], usage=None),
     Reply("ok", "stop", 0, "resp_test")),
    (response_body([message_item(output_text("ok"))], usage=(7, 3)),
     Reply("ok", "stop", 0, "resp_test", 7, 3)),
    (response_body([], status="incomplete"), Reply("", "incomplete", 0, "resp_test", 1, 1)),
    (response_body([message_item(output_text("ok"))], status="in_progress"),
     Reply("ok", "in_progress", 0, "resp_test", 1, 1)),
])
def test_parse_response(body: dict[str, Any], expected: Reply) -> None:
    assert parse_response(json.dumps(body).encode()) == expected


def test_a_bad_api_is_refused() -> None:
    with pytest.raises(UsageError, match="--api must be one of chat, responses"):
        make_summarizer(MODEL, api_key="k", api="completions")  # type: ignore[arg-type]
