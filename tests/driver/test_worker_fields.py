"""The fields a model's answer gives the worker are shaped before `complete` sees them:
a finish reason is a code, a response id an id of at most 200 bytes, so neither free text
nor megabytes reach the auditor, and a server's odd value never turns a summary into an
error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pycompactor.summarizers.outcomes import (
    FINISH_REASON_SHAPE,
    RESPONSE_ID_SHAPE,
    Reply,
    parse_completion,
    parse_response,
)


def chat(finish_reason: object, response_id: object) -> bytes:
    return json.dumps({"id": response_id, "choices": [{
        "message": {"role": "assistant", "content": "A summary."},
        "finish_reason": finish_reason}]}).encode()


@pytest.mark.parametrize(("given", "sent"), [
    ("stop", "stop"), ("length", "length"), ("STOP", "unrecognized"),
    ("the user said: 078-05-1120", "unrecognized"), ("x" * 65, "unrecognized"),
    (None, None),
])
def test_a_finish_reason_is_sent_as_a_code(given: str | None, sent: str | None) -> None:
    reply = parse_completion(chat(given, "chatcmpl-1"))
    assert isinstance(reply, Reply)
    assert reply.finish_reason == sent


@pytest.mark.parametrize(("given", "sent"), [
    ("chatcmpl-AbC_1.2:3", "chatcmpl-AbC_1.2:3"), ("r" * 200, "r" * 200),
    ("r" * 201, None), ("r" * 10_000_000, None), ("", None), ("id with spaces", None),
    ("ид", None), (None, None),
])
def test_a_response_id_is_sent_only_with_an_ids_shape(given: str | None,
                                                       sent: str | None) -> None:
    reply = parse_completion(chat("stop", given))
    assert isinstance(reply, Reply)
    assert reply.response_id == sent


def test_an_incomplete_responses_answer_keeps_its_code() -> None:
    def body(reason: str) -> bytes:
        return json.dumps({"id": "resp_1", "status": "incomplete",
                           "incomplete_details": {"reason": reason},
                           "output": [{"type": "message", "content": [
                               {"type": "output_text", "text": "A summary."}]}]}).encode()

    for reason, sent in [("max_output_tokens", "incomplete:max_output_tokens"),
                         ("the model said: no", "incomplete")]:
        reply = parse_response(body(reason))
        assert isinstance(reply, Reply)
        assert reply.finish_reason == sent
        assert FINISH_REASON_SHAPE.fullmatch(sent)


def test_the_shapes_are_the_databases() -> None:
    """The same rules as compaction.complete (sql/30_completion.sql): ASCII only."""
    assert not RESPONSE_ID_SHAPE.fullmatch("ｒｅｓｐ")
    assert not FINISH_REASON_SHAPE.fullmatch("ｓｔｏｐ")


# --- ids in the worker's log ------------------------------------------------------------

HOSTILE_ID = "conv\x1b]0;owned\x07\x1b[2J\u009b31m\u202egpj.exe"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_control_characters_in_ids_are_escaped_in_the_log(log_format: str) -> None:
    """A conversation id is the host's: ESC, BEL, C1 controls and bidirectional overrides
    in it reach the log as escapes, never as characters a terminal would act on."""
    import io

    from pycompactor.worker.eventlog import EventLog

    stream = io.StringIO()
    log = EventLog("json" if log_format == "json" else "text", stream=stream)
    log.emit("claimed", conversation_id=HOSTILE_ID, job_id=7, note="中文 ok")
    line = stream.getvalue()
    assert line.endswith("\n")
    assert line[:-1].isprintable(), repr(line)
    for escape in ("\\u001b", "\\u0007", "\\u009b", "\\u202e"):
        assert escape in line
    assert "中文 ok" in line
    if log_format == "json":
        assert json.loads(line)["conversation_id"] == HOSTILE_ID
    else:
        value = line.split(" conversation_id=", 1)[1].split(" job_id=", 1)[0]
        assert json.loads(value) == HOSTILE_ID


def test_worker_config_bounds_concurrency() -> None:
    from pycompactor.worker.process import WorkerConfig

    with pytest.raises(ValueError, match="at most 10000"):
        WorkerConfig(model="m", concurrency=10_001)
    assert WorkerConfig(model="m", concurrency=10_000).concurrency == 10_000


# --- a worker whose retries give up ends what it holds ----------------------------------


def conflict() -> Exception:
    from pycompactor.errors import TransactionConflict

    return TransactionConflict("could not serialize access due to concurrent update"
                               " (SQLSTATE 40001)")


def run_once(dsn: str, summarizer: Any, **options: Any) -> list[dict[str, Any]]:
    import io

    from pycompactor.worker.eventlog import EventLog
    from pycompactor.worker.process import Worker, WorkerConfig

    stream = io.StringIO()
    config = WorkerConfig(model=summarizer.model, dsn=dsn, once=True, log_format="json",
                          **options)
    Worker(config, summarizer, log=EventLog("json", stream=stream)).run()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


class Scripted:
    """A summarizer answering one fixed text, as a model would."""

    model = "scripted-model"

    def __init__(self, text: str) -> None:
        self.text = text

    def summarize(self, pairs: Any) -> Reply:
        return Reply(self.text, "stop", 0)

    def close(self) -> None:
        pass


def test_a_gate_whose_database_question_gives_up_still_ends_the_attempt(
        conn: Any, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """reply_problem keeps failing with serialization failures past every retry: the
    attempt is not left running (job_error) until its lease runs out, it fails with the
    gate's reason."""
    from pycompactor import db
    from tests.workerkit import attempts, seed

    seed(conn, "conv-1", 30)

    def always_conflicts(*_args: Any, **_kwargs: Any) -> Any:
        raise conflict()

    monkeypatch.setattr(db, "reply_problem", always_conflicts)
    monkeypatch.setattr("pycompactor.worker.process._CONFLICT_PAUSE", 0.0001)
    run_once(dsn, Scripted("An invented 99.99 and 42.42."))
    assert [(a.state, a.reason) for a in attempts(conn)] == [("failed", "figures_invented")]


def test_a_job_whose_thread_raises_is_failed_not_left_running(
        conn: Any, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception after the claim (here the figures' count, a bug) ends the attempt
    as worker_error instead of leaving it running for its lease."""
    from pycompactor.worker import process as worker
    from tests.workerkit import attempts, seed

    seed(conn, "conv-1", 30)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug in the figures")

    monkeypatch.setattr(worker, "figure_stats", broken)
    events = run_once(dsn, Scripted("A summary."))
    assert [(a.state, a.reason) for a in attempts(conn)] == [("failed", "worker_error")]
    assert [e["event"] for e in events if e["event"] in ("job_error", "failed")] == [
        "job_error", "failed"]


def test_recording_retries_conflicts_until_it_is_recorded(
        conn: Any, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """complete refused by conflicts is transient trouble, not a lost result with the
    attempt left running for its lease: the result is retried and recorded (a conflict
    changed nothing)."""
    from pycompactor import db
    from tests.workerkit import attempts, seed

    seed(conn, "conv-1", 30)
    real = db.complete
    failures = {"left": 3}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise conflict()
        return real(*args, **kwargs)

    monkeypatch.setattr(db, "complete", flaky)
    run_once(dsn, Scripted("A summary."))
    assert [(a.state, a.reason) for a in attempts(conn)] == [("completed", "completed")]
    assert failures["left"] == 0
