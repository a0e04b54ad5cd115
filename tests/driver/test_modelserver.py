"""The scripted model server itself: paths, unscripted requests, subprocess mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pycompactor.summarizers.openai_compatible import OpenAISummarizer
from pycompactor.summarizers.outcomes import Failure, Reply
from tests import modelserver as ms
from tests.driver.conftest import make_pairs
from tests.modelserver import ModelServer

ROOT = Path(__file__).resolve().parents[2]


def test_base_url_without_v1_is_served() -> None:
    with ModelServer([ms.stop("no v1")]) as server:
        base_url = server.base_url.removesuffix("/v1")
        with OpenAISummarizer("m", base_url=base_url, api_key="k") as summarizer:
            assert summarizer.summarize(make_pairs()) == Reply(
                "no v1", "stop", 0, "chatcmpl-test", 1, 1)
        assert [r.path for r in server.requests] == ["/chat/completions"]


def test_unscripted_request_is_a_non_retryable_500_and_an_error() -> None:
    with ModelServer() as server:
        with OpenAISummarizer(
            "m", base_url=server.base_url, api_key="k", retry_backoff_seconds=0
        ) as summarizer:
            outcome = summarizer.summarize(make_pairs())
        assert isinstance(outcome, Failure)
        assert outcome.reason == "http_500"
        assert len(server.requests) == 2  # our own retry; the header stops openai's only
        assert server.errors == ["unscripted request #1", "unscripted request #2"]


def test_handler_answers_after_the_queue() -> None:
    seen: list[int] = []

    def handler(request: ms.RecordedRequest) -> ms.ScriptedResponse:
        seen.append(len(request.body))
        return ms.stop("from handler")

    with (
        ModelServer([ms.stop("queued")], handler=handler) as server,
        OpenAISummarizer("m", base_url=server.base_url, api_key="k") as summarizer,
    ):
        first = summarizer.summarize(make_pairs())
        second = summarizer.summarize(make_pairs())
    assert (first, second) == (
        Reply("queued", "stop", 0, "chatcmpl-test", 1, 1),
        Reply("from handler", "stop", 0, "chatcmpl-test", 1, 1),
    )
    assert len(seen) == 1


def test_runs_as_a_subprocess_for_end_to_end_tests() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "tests.modelserver", "--reply", "served from a subprocess"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        base_url = proc.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:")
        with OpenAISummarizer("m", base_url=base_url, api_key="k") as summarizer:
            outcome = summarizer.summarize(make_pairs())
        proc.stdin.close()  # tells the server to stop
        assert proc.wait(timeout=30) == 0
    assert outcome == Reply("served from a subprocess", "stop", 0, "chatcmpl-test", 1, 1)
