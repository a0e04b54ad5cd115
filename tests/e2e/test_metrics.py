"""Prometheus metrics: a real worker's `--metrics-port` endpoint, scraped over HTTP while
it works, and the projection counters of an agent's process (pycompactor.metrics).

The counters are read before and after, and must have moved by exactly what the database
says happened. Scrapes are polled with a deadline: the worker bumps a counter just after
the database call it counts returns, so the database state can be seen a moment earlier.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from pycompactor import db, metrics, project_history
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from tests.history import History
from tests.modelserver import (
    ModelServer,
    RecordedRequest,
    ScriptedResponse,
    hang,
    refusal,
    stop,
)
from tests.workerkit import MODEL, WorkerProcess, attempts, seed, summaries, wait_for, worker_env

Conn = psycopg.Connection[Any]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def poll_scrape(port: int, done: Callable[[Samples], bool], *, timeout: float = 30.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        if done(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never reached the expected values: {samples}")
        time.sleep(0.05)


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    def answer(request: RecordedRequest) -> ScriptedResponse:
        # conv-bad's replies are always refused: two failed attempts, then exhausted.
        return refusal("no") if b"conv-bad-a" in request.body else stop("Metrics summary.")

    with ModelServer(handler=answer) as server:
        yield server
    assert server.errors == []


def import_range_0(conn: Conn, conversation_id: str) -> None:
    """A summary made by an earlier system under the worker's identity (same model and
    prompt version): the worker skips it without a claim (already_completed)."""
    [target] = db.plan_targets(conn, conversation_id)
    db.import_summary(conn, conversation_id, "default", 0, target.source_message_ids,
                      target.source_hash, MODEL, PROMPT_VERSION, "Imported.",
                      datetime.now(UTC))


def test_worker_endpoint_counts_what_the_run_did(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    proc = WorkerProcess("--model", MODEL, "--metrics-port", "0", "--poll-seconds", "0.2",
                         env=worker_env(dsn, model_server.base_url))
    try:
        port = int(proc.wait_event("metrics_listening")["port"])
        before = scrape(port)
        assert ("pycompactor_worker_claims_total", frozenset()) in before

        seed(conn, "conv-ok", 30)
        seed(conn, "conv-bad", 30)
        with conn.transaction():  # the worker must not see conv-imp before its import
            seed(conn, "conv-imp", 30)
            import_range_0(conn, "conv-imp")
        wait_for(lambda: [(a.state, a.reason) for a in attempts(conn)] == [
            ("failed", "refusal"), ("failed", "refusal"),  # conv-bad, attempts 1 and 2
            ("completed", "completed"),  # conv-ok
        ], what="conv-ok completed and conv-bad exhausted")

        def delta(samples: Samples, name: str, **labels: str) -> float:
            return value(samples, name, **labels) - value(before, name, **labels)

        expected: Mapping[tuple[str, tuple[tuple[str, str], ...]], float] = {
            ("pycompactor_worker_claims_total", ()): 3,
            ("pycompactor_worker_attempts_total",
             (("outcome", "completed"), ("reason", "completed"))): 1,
            ("pycompactor_worker_attempts_total",
             (("outcome", "failed"), ("reason", "refusal"))): 2,
            ("pycompactor_worker_model_call_seconds_count", (("model", MODEL),)): 3,
        }

        def reached(samples: Samples) -> bool:
            # conv-imp is skipped before any claim (already_completed): its import is the
            # summary.
            return all(delta(samples, name, **dict(labels)) == want
                       for (name, labels), want in expected.items()) and delta(
                samples, "pycompactor_worker_targets_skipped_total",
                reason="already_completed") >= 1

        after = poll_scrape(port, reached)
        assert delta(after, "pycompactor_worker_queue_dequeued_total") >= 3
        assert delta(after, "pycompactor_worker_model_call_seconds_sum", model=MODEL) > 0
        # Only the two scripted outcomes happened: no other attempt counter moved.
        attempt_samples = {k for k in after if k[0] == "pycompactor_worker_attempts_total"}
        assert attempt_samples == {
            ("pycompactor_worker_attempts_total",
             frozenset({("outcome", "completed"), ("reason", "completed")})),
            ("pycompactor_worker_attempts_total",
             frozenset({("outcome", "failed"), ("reason", "refusal")})),
        }
        assert len(model_server.requests) == 3
        assert summaries(conn, "conv-ok") == [("conv-ok", 0, "Metrics summary.")]
    finally:
        if proc.proc.poll() is None:
            proc.proc.terminate()
        proc.wait()


def test_oldest_queued_age_gauge(conn: Conn, dsn: str) -> None:
    """The gauge holds the age of the oldest entry the last dequeue leased (server clock),
    and drops to 0 once a dequeue finds the scope's queue empty."""
    seed(conn, "conv-old", 30)
    seed(conn, "conv-new", 30)
    conn.execute("UPDATE compaction.queue SET enqueued_at = now() - interval '1 hour'"
                 " WHERE conversation_id = 'conv-old'")
    with ModelServer([hang(stop("Old.")), stop("New.")]) as server:
        # One slot: the worker leases conv-old, its call hangs, and no dequeue happens
        # until the call is released; the gauge shows the age seen by that dequeue.
        proc = WorkerProcess("--model", MODEL, "--metrics-port", "0", "--poll-seconds", "0.2",
                             "--concurrency", "1", env=worker_env(dsn, server.base_url))
        try:
            port = int(proc.wait_event("metrics_listening")["port"])
            assert server.hanging.wait(30)
            age = value(poll_scrape(port, lambda s: value(
                s, "pycompactor_worker_queue_oldest_age_seconds") > 0),
                "pycompactor_worker_queue_oldest_age_seconds")
            assert 3600 <= age < 3600 + 120
            server.release()
            wait_for(lambda: len(summaries(conn)) == 2, what="both summaries")
            poll_scrape(port, lambda s: value(
                s, "pycompactor_worker_queue_oldest_age_seconds") == 0 and value(
                s, "pycompactor_worker_queue_last_dequeue") == 0)
        finally:
            if proc.proc.poll() is None:
                proc.proc.terminate()
            proc.wait()
        assert server.errors == []


def test_projection_rejections_are_counted_in_the_agents_process(conn: Conn) -> None:
    """project_history runs in the agent's process: its counters are in the default
    registry, which any endpoint of that process (here metrics.serve) exposes."""
    pairs = History(conn).pairs("conv-p", 30)
    import_range_0(conn, "conv-p")
    before_stale = REGISTRY.get_sample_value(
        "pycompactor_projection_summaries_rejected_total", {"reason": "stale_source"}) or 0.0
    before_calls = REGISTRY.get_sample_value("pycompactor_projections_total") or 0.0

    assert not project_history(conn, "conv-p", budget_bytes=100_000).rejected_summaries
    conn.execute("UPDATE compaction_source.messages SET content = 'edited' "
                 "WHERE message_id = %s", (pairs[3].user_message_id,))
    projection = project_history(conn, "conv-p", budget_bytes=100_000)
    assert [r.reason for r in projection.rejected_summaries] == ["stale_source"]

    server = metrics.serve(0)
    try:
        samples = scrape(server.port)
    finally:
        server.close()
    assert value(samples, "pycompactor_projection_summaries_rejected_total",
                 reason="stale_source") == before_stale + 1
    assert value(samples, "pycompactor_projections_total") == before_calls + 2
