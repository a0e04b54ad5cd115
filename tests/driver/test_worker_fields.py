"""The fields a model's answer gives the worker are shaped before `complete` sees them
(issue 62 item 6): a finish reason is a code, a response id an id of at most 200 bytes,
so neither free text nor megabytes reach the auditor, and a server's odd value never
turns a summary into an error."""

from __future__ import annotations

import json

import pytest

from pycompactor.outcomes import (
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
    """The same rules as compaction.complete (sql/30_claims.sql): ASCII only."""
    assert not RESPONSE_ID_SHAPE.fullmatch("ｒｅｓｐ")
    assert not FINISH_REASON_SHAPE.fullmatch("ｓｔｏｐ")
