"""The OpenAI path end to end: the real `openai` client against the scripted loopback server.

What the server receives is asserted on the raw request bytes; what comes back is
asserted as the exact ModelOutcome the worker will turn into one database call.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pycompactor.cli.cluster import free_port
from pycompactor.errors import UsageError
from pycompactor.models import Pair
from pycompactor.summarizers.extractive import OFFLINE_MODEL, ExtractiveSummarizer
from pycompactor.summarizers.openai_compatible import (
    OpenAISummarizer,
    build_request,
    load_prompt,
    make_summarizer,
)
from pycompactor.summarizers.outcomes import (
    CONNECTION_ERROR,
    INVALID_TEXT,
    MALFORMED_RESPONSE,
    MULTIPLE_CHOICES,
    REFUSAL,
    TIMEOUT,
    Failure,
    ModelOutcome,
    Reply,
)
from tests import modelserver as ms
from tests.driver.conftest import make_pairs
from tests.modelserver import ModelServer
from tests.workerkit import complete_verdict

Conn = psycopg.Connection[Any]

MODEL = "acme/summarizer-2026:latest"


@pytest.fixture
def summarizer(model_server: ModelServer) -> Iterator[OpenAISummarizer]:
    with OpenAISummarizer(
        MODEL, base_url=model_server.base_url, api_key="test-key", retry_backoff_seconds=0
    ) as s:
        yield s


def run(
    server: ModelServer, summarizer: OpenAISummarizer, *script: ms.ScriptedResponse
) -> ModelOutcome:
    server.enqueue(*script)
    return summarizer.summarize(make_pairs())


# --- the request -----------------------------------------------------------------------


def test_request_carries_only_the_assistant_replies(
    model_server: ModelServer, summarizer: OpenAISummarizer, pairs: list[Pair]
) -> None:
    model_server.enqueue(ms.stop())
    summarizer.summarize(pairs)

    [request] = model_server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer test-key"
    raw = request.body
    for pair in pairs:
        assert pair.assistant_message_id.encode() in raw
        assert pair.assistant_content.encode() in raw
        assert pair.user_message_id.encode() not in raw
        assert pair.user_content.encode() not in raw
    assert b"USER-SECRET" not in raw
    for forbidden in (b'"tools"', b'"functions"', b'"tool_choice"', b'"function_call"'):
        assert forbidden not in raw

    body = request.json
    # The output limit and temperature are the only knobs (defaults: room for a
    # 6,000-character summary, and 0).
    assert set(body) == {"model", "messages", "max_tokens", "temperature"}
    assert (body["max_tokens"], body["temperature"]) == (2000, 0)
    assert body["model"] == MODEL
    system, replies = body["messages"]
    assert system == {"role": "system", "content": load_prompt()}
    assert replies["role"] == "user"
    assert json.loads(replies["content"]) == {
        "assistant_replies": [
            {"assistant_message_id": p.assistant_message_id, "content": p.assistant_content}
            for p in pairs
        ]
    }


def test_chinese_user_text_is_absent_in_every_encoding(
    model_server: ModelServer, summarizer: OpenAISummarizer
) -> None:
    secret = "我的风险偏好是保守型"
    pairs = [
        Pair(i, f"r{i}", f"u{i}", f"{secret}{i}", f"a{i}", f"基金A的净值为1.0{i}。")
        for i in range(10)
    ]
    model_server.enqueue(ms.stop())
    summarizer.summarize(pairs)
    raw = model_server.requests[0].body
    for encoded in (
        secret.encode(),
        json.dumps(secret).strip('"').encode(),  # \uXXXX escapes
        json.dumps(json.dumps(secret)).strip('"').encode(),  # escaped twice
    ):
        assert encoded not in raw
    assert "基金A的净值为1.03".encode() in raw or json.dumps("基金A的净值为1.03").encode() in raw


class _NoUserText:
    """A pair whose user side explodes when read: proves the request never reads it."""

    def __init__(self, i: int) -> None:
        self.assistant_message_id = f"a{i}"
        self.assistant_content = f"reply {i}"

    @property
    def user_content(self) -> str:
        raise AssertionError("user_content was read")

    @property
    def user_message_id(self) -> str:
        raise AssertionError("user_message_id was read")


def test_request_building_never_reads_user_fields() -> None:
    pairs = [_NoUserText(i) for i in range(10)]
    request = build_request(pairs, MODEL)
    assert "reply 9" in request["messages"][1]["content"]
    assert ExtractiveSummarizer().summarize(pairs) == Reply(
        "\n".join(f"[a{i}] reply {i}" for i in range(10)), "stop", 0, None
    )


@pytest.mark.parametrize("count", [0, 9, 11])
def test_a_request_covers_exactly_ten_pairs(count: int) -> None:
    with pytest.raises(ValueError, match="exactly 10 pairs"):
        build_request(make_pairs()[:count] if count < 10 else make_pairs() * 2, MODEL)


# --- outcomes that reach the model's message: Reply, judged by the database -------------


@pytest.mark.parametrize(
    ("script", "expected", "verdict"),
    [
        (
            ms.stop("Fund F1 NAV 11.25."),
            Reply("Fund F1 NAV 11.25.", "stop", 0, "chatcmpl-test", 1, 1),
            "completed",
        ),
        (
            ms.length("Fund F1 NAV"),
            Reply("Fund F1 NAV", "length", 0, "chatcmpl-test", 1, 1),
            "not_stopped",
        ),
        (ms.content_filter(), Reply("", "content_filter", 0, "chatcmpl-test", 1, 1), "not_stopped"),
        (
            ms.content_filter("partial"),
            Reply("partial", "content_filter", 0, "chatcmpl-test", 1, 1),
            "not_stopped",
        ),
        (ms.tool_call(), Reply("", "tool_calls", 1, "chatcmpl-test", 1, 1), "not_stopped"),
        (ms.tool_call(count=3), Reply("", "tool_calls", 3, "chatcmpl-test", 1, 1), "not_stopped"),
        (ms.reply("ok", function_call=True), Reply("ok", "stop", 1, "chatcmpl-test", 1, 1),
         "tool_calls"),
        (ms.reply(None), Reply("", "stop", 0, "chatcmpl-test", 1, 1), "empty"),
        (ms.reply(" \t\n"), Reply(" \t\n", "stop", 0, "chatcmpl-test", 1, 1), "empty"),
        (ms.reply("\u00a0"), Reply("\u00a0", "stop", 0, "chatcmpl-test", 1, 1), "completed"),
        (ms.reply("x", finish_reason=None), Reply("x", None, 0, "chatcmpl-test", 1, 1),
         "not_stopped"),
        (ms.reply("x", response_id="resp-42"), Reply("x", "stop", 0, "resp-42", 1, 1), "completed"),
        (ms.too_long(6000), Reply("x" * 6000, "stop", 0, "chatcmpl-test", 1, 1), "completed"),
        (ms.too_long(6001), Reply("x" * 6001, "stop", 0, "chatcmpl-test", 1, 1), "too_long"),
    ],
)
def test_replies_go_to_the_database_with_their_own_finish_reason(
    model_server: ModelServer,
    summarizer: OpenAISummarizer,
    script: ms.ScriptedResponse,
    expected: Reply,
    verdict: str,
    conn: Conn,
) -> None:
    outcome = run(model_server, summarizer, script)
    assert outcome == expected
    assert isinstance(outcome, Reply)
    assert complete_verdict(conn, outcome) == verdict
    assert len(model_server.requests) == 1


def test_case_a_good_text_plus_a_tool_call_is_not_a_summary(
    model_server: ModelServer, summarizer: OpenAISummarizer, conn: Conn
) -> None:
    """Article §6 Case A: excellent prose does not excuse a tool call."""
    prose = "Fund F1 had a NAV of 11.25 USD on 2026-10-11; that is not the current NAV."
    outcome = run(model_server, summarizer, ms.reply(prose, finish_reason="stop", tool_calls=1))
    assert outcome == Reply(prose, "stop", 1, "chatcmpl-test", 1, 1)
    assert isinstance(outcome, Reply)
    assert complete_verdict(conn, outcome) == "tool_calls"


# --- outcomes only Python can see: Failure ---------------------------------------------


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (ms.refusal(), REFUSAL),
        (ms.reply("text too", refusal="I won't"), REFUSAL),
        (ms.multiple_choices(2), MULTIPLE_CHOICES),
        (ms.multiple_choices(5), MULTIPLE_CHOICES),
        (ms.no_choices(), MALFORMED_RESPONSE),
        (ms.malformed_json(), MALFORMED_RESPONSE),
        (ms.raw(b"<html>bad gateway</html>"), MALFORMED_RESPONSE),
        (ms.raw(b"\xff\xfe not utf-8"), MALFORMED_RESPONSE),
        (ms.raw(b'"just a string"'), MALFORMED_RESPONSE),
        (ms.raw(b'{"id": "x"}'), MALFORMED_RESPONSE),
        (ms.raw(b'{"choices": {"0": {}}}'), MALFORMED_RESPONSE),
        (ms.raw(b'{"choices": [{"index": 0, "finish_reason": "stop"}]}'), MALFORMED_RESPONSE),
        (
            ms.raw(
                b'{"choices": [{"message": {"content": [{"type": "text", "text": "a"}]},'
                b' "finish_reason": "stop"}]}'
            ),
            MALFORMED_RESPONSE,
        ),
        (
            ms.raw(
                b'{"choices": [{"message": {"content": "a", "tool_calls": {}},'
                b' "finish_reason": "stop"}]}'
            ),
            MALFORMED_RESPONSE,
        ),
        (
            ms.raw(b'{"choices": [{"message": {"content": "a"}, "finish_reason": 1}]}'),
            MALFORMED_RESPONSE,
        ),
        (
            ms.raw(
                b'{"id": 7, "choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]}'
            ),
            MALFORMED_RESPONSE,
        ),
        (ms.reply("nul \x00 inside"), INVALID_TEXT),
        (
            ms.raw(
                b'{"choices": [{"message": {"content": "lone \\ud800"}, "finish_reason": "stop"}]}'
            ),
            INVALID_TEXT,
        ),
        (ms.http_error(400), "http_400"),
        (ms.http_error(401), "http_401"),
        (ms.http_error(404), "http_404"),
    ],
)
def test_failures_only_python_can_see(
    model_server: ModelServer,
    summarizer: OpenAISummarizer,
    script: ms.ScriptedResponse,
    reason: str,
) -> None:
    outcome = run(model_server, summarizer, script)
    assert isinstance(outcome, Failure)
    assert outcome.reason == reason
    assert len(model_server.requests) == 1  # none of these is retried


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503])
def test_retryable_status_is_retried_once_then_fails(
    model_server: ModelServer, summarizer: OpenAISummarizer, status: int
) -> None:
    outcome = run(model_server, summarizer, ms.http_error(status), ms.http_error(status))
    assert isinstance(outcome, Failure)
    assert outcome.reason == f"http_{status}"
    assert len(model_server.requests) == 2


def test_one_transport_retry_can_still_succeed(
    model_server: ModelServer, summarizer: OpenAISummarizer
) -> None:
    outcome = run(model_server, summarizer, ms.http_error(500), ms.stop("second time"))
    assert outcome == Reply("second time", "stop", 0, "chatcmpl-test", 1, 1)
    assert len(model_server.requests) == 2
    # Both requests are the same request.
    assert model_server.requests[0].body == model_server.requests[1].body


def test_no_retry_that_would_outlast_the_deadline(model_server: ModelServer) -> None:
    """A Retry-After beyond the call's deadline ends the call now, without sleeping."""
    with OpenAISummarizer(
        MODEL, base_url=model_server.base_url, api_key="k", timeout_seconds=30
    ) as summarizer:
        outcome = run(model_server, summarizer, ms.http_error(429, retry_after="60"))
    assert isinstance(outcome, Failure)
    assert outcome.reason == "http_429"
    assert len(model_server.requests) == 1


def test_timeout_against_a_hanging_server(model_server: ModelServer) -> None:
    with OpenAISummarizer(
        MODEL, base_url=model_server.base_url, api_key="k", timeout_seconds=0.3
    ) as summarizer:
        outcome = run(model_server, summarizer, ms.hang())
    assert isinstance(outcome, Failure)
    assert outcome.reason == TIMEOUT
    # The timeout spent the whole deadline: no second request.
    assert len(model_server.requests) == 1
    assert model_server.hanging.is_set()


def test_a_released_hang_answers(model_server: ModelServer, summarizer: OpenAISummarizer) -> None:
    model_server.enqueue(ms.hang(then=ms.stop("after the wait")))
    outcomes: list[ModelOutcome] = []
    caller = threading.Thread(target=lambda: outcomes.append(summarizer.summarize(make_pairs())))
    caller.start()
    assert model_server.hanging.wait(timeout=10)
    assert outcomes == []  # still waiting on the server
    model_server.release()
    caller.join(timeout=10)
    assert outcomes == [Reply("after the wait", "stop", 0, "chatcmpl-test", 1, 1)]


def test_connection_error_against_a_closed_port() -> None:
    with OpenAISummarizer(
        MODEL,
        base_url=f"http://127.0.0.1:{free_port()}/v1",
        api_key="k",
        timeout_seconds=10,
        retry_backoff_seconds=0,
    ) as summarizer:
        outcome = summarizer.summarize(make_pairs())
    assert isinstance(outcome, Failure)
    assert outcome.reason == CONNECTION_ERROR


def test_server_stopped_while_hanging_is_a_connection_error() -> None:
    server = ModelServer([ms.hang()])
    base_url = server.start()
    outcomes: list[ModelOutcome] = []
    with OpenAISummarizer(
        MODEL, base_url=base_url, api_key="k", retry_backoff_seconds=0
    ) as summarizer:
        caller = threading.Thread(
            target=lambda: outcomes.append(summarizer.summarize(make_pairs()))
        )
        caller.start()
        assert server.hanging.wait(timeout=10)
        server.stop()  # must return although a handler is blocked
        caller.join(timeout=30)
    assert [o.reason for o in outcomes if isinstance(o, Failure)] == [CONNECTION_ERROR]


# --- configuration -----------------------------------------------------------------------


def test_make_summarizer_picks_offline_for_extractive_1() -> None:
    summarizer = make_summarizer(OFFLINE_MODEL)
    assert isinstance(summarizer, ExtractiveSummarizer)
    assert summarizer.model == OFFLINE_MODEL


def test_make_summarizer_reads_openai_env(
    model_server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", model_server.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    summarizer = make_summarizer(MODEL, timeout_seconds=5)
    try:
        assert isinstance(summarizer, OpenAISummarizer)
        assert summarizer.model == MODEL
        model_server.enqueue(ms.stop("env"))
        assert summarizer.summarize(make_pairs()) == Reply("env", "stop", 0, "chatcmpl-test", 1, 1)
    finally:
        summarizer.close()
    [request] = model_server.requests
    assert request.headers["authorization"] == "Bearer from-env"
    assert request.json["model"] == MODEL


def test_missing_api_key_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UsageError, match="OPENAI_API_KEY"):
        make_summarizer(MODEL, base_url="http://127.0.0.1:9/v1")


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_timeout_must_be_positive_and_finite(timeout: float) -> None:
    with pytest.raises(UsageError, match="timeout"):
        OpenAISummarizer(MODEL, api_key="k", timeout_seconds=timeout)


def test_empty_model_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="model"):
        make_summarizer("", api_key="k")


