"""What a model call came to: a `Reply` for the database to judge, or a `Failure` only
Python can see, and the strict reading of both APIs' response bodies that decides which.

* `Reply` -> `compaction.complete(...)` with the reply's own text, `finish_reason` and
  tool-call count. The database is the judge of `not_stopped`, `tool_calls`, `empty` and
  `too_long` (`compaction.reply_problem`); Python keeps no copy of those rules.
* `Failure` -> `compaction.fail(..., reason)`. The reasons are stable codes (see
  `FAILURE_REASONS`): `refusal`, `multiple_choices`, `multiple_messages`,
  `malformed_response`, `invalid_text`, `timeout`, `connection_error`, `http_<status>`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

if TYPE_CHECKING:
    import openai

# Stable failure reasons (the `p_reason` of compaction.fail). HTTP errors use http_<status>.
REFUSAL: Final = "refusal"
MULTIPLE_CHOICES: Final = "multiple_choices"
#: Responses API: more than one `message` output item (the twin of multiple_choices).
MULTIPLE_MESSAGES: Final = "multiple_messages"
MALFORMED_RESPONSE: Final = "malformed_response"
#: The reply text cannot be stored in PostgreSQL (a NUL character, or a lone surrogate
#: that has no UTF-8 encoding). Separate from malformed_response because the response
#: itself was well-formed JSON; the text is what the database could not accept.
INVALID_TEXT: Final = "invalid_text"
TIMEOUT: Final = "timeout"
CONNECTION_ERROR: Final = "connection_error"
FAILURE_REASONS: Final = frozenset(
    {REFUSAL, MULTIPLE_CHOICES, MULTIPLE_MESSAGES, MALFORMED_RESPONSE, INVALID_TEXT, TIMEOUT,
     CONNECTION_ERROR}
)


#: What `complete` takes as a finish reason: a code, as the
#: APIs send (`stop`, `length`, `content_filter`, `incomplete:max_output_tokens`). Fields
#: the worker chooses reach the auditor, who never sees content.
FINISH_REASON_SHAPE: Final = re.compile(r"[a-z][a-z0-9_.:-]{0,63}")
#: A finish reason of another shape is sent as this (still not `stop`: not_stopped).
UNRECOGNIZED_FINISH: Final = "unrecognized"
#: What `complete` takes as a response id: 1 to 200 ASCII letters, digits, `_ . : -`.
RESPONSE_ID_SHAPE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


def shaped_finish_reason(value: str | None) -> str | None:
    """The API's finish reason as `complete` takes it: itself when it is a code, else
    its part before the first `:` when that is one (`incomplete:<free text>`), else
    `unrecognized`. None stays None (not_stopped either way)."""
    if value is None or FINISH_REASON_SHAPE.fullmatch(value):
        return value
    head = value.split(":", 1)[0]
    return head if FINISH_REASON_SHAPE.fullmatch(head) else UNRECOGNIZED_FINISH


def shaped_response_id(value: str | None) -> str | None:
    """The API's response id when it has an id's shape, else None (not recorded)."""
    return value if value is not None and RESPONSE_ID_SHAPE.fullmatch(value) else None


def http_reason(status: int) -> str:
    """The failure reason of an HTTP error status, e.g. `http_429`."""
    return f"http_{status}"


@dataclass(frozen=True, slots=True)
class Reply:
    """The model's message: send it to `compaction.complete`, which judges it.

    `input_tokens`/`output_tokens` are the usage the API reported (Chat Completions'
    prompt_tokens/completion_tokens, the Responses API's input_tokens/output_tokens), or
    None when it reported none (the offline summarizer, a server without usage).
    """

    text: str
    finish_reason: str | None
    tool_call_count: int
    response_id: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """No judgeable reply: send `reason` to `compaction.fail`; `detail` is for logs only."""

    reason: str
    detail: str = ""
    #: Token usage of a reply that was answered but failed in Python (figures_lost):
    #: `fail` cannot store it, the worker's log shows it.
    input_tokens: int | None = None
    output_tokens: int | None = None


ModelOutcome: TypeAlias = Reply | Failure

def storable(text: str) -> bool:
    """True if PostgreSQL can store the text: no NUL and valid UTF-8 (no lone surrogates)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _malformed(detail: str) -> Failure:
    return Failure(MALFORMED_RESPONSE, detail)


class _Malformed(Exception):
    """A response body or field of an unexpected shape; the parse answers
    malformed_response."""


def _json_object(body: bytes) -> dict[str, Any]:
    """A response body as a JSON object, else _Malformed saying why not."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Malformed(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _Malformed("body is not a JSON object")
    return data


def _optional(obj: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    """obj[key] if absent, null or of `kind`; else _Malformed("<key> is not <what>")."""
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise _Malformed(f"{key} is not {what}")
    return value


def _strict(parse: Callable[[bytes], ModelOutcome]) -> Callable[[bytes], ModelOutcome]:
    @functools.wraps(parse)
    def checked(body: bytes) -> ModelOutcome:
        try:
            return parse(body)
        except _Malformed as exc:
            return _malformed(str(exc))
    return checked


@_strict
def parse_completion(body: bytes) -> ModelOutcome:
    """Classify a 200 response body strictly, reading the JSON ourselves.

    The openai client's models are lenient (missing fields become absent attributes), so
    the wire format is checked here: exactly one choice, a message object, string or null
    content, a list of tool calls, and so on. Anything unexpected is malformed_response.
    """
    data = _json_object(body)
    choices = data.get("choices")
    if not isinstance(choices, list):
        return _malformed("no choices list")
    if not choices:
        return _malformed("zero choices")
    if len(choices) != 1:
        return Failure(MULTIPLE_CHOICES, f"{len(choices)} choices")
    first = choices[0]
    if not isinstance(first, dict) or not isinstance(first.get("message"), dict):
        return _malformed("choice without a message object")
    message: dict[str, Any] = first["message"]
    finish_reason = _optional(first, "finish_reason", str, "a string")
    response_id = _optional(data, "id", str, "a string")

    refusal = _optional(message, "refusal", str, "a string")
    if refusal:
        return Failure(REFUSAL, refusal[:200])

    # Content-part arrays are not plain text; we never ask for them.
    content = _optional(message, "content", str, "a string")
    tool_calls = _optional(message, "tool_calls", list, "a list")
    # The legacy single `function_call` is a tool call too.
    tool_call_count = len(tool_calls or ()) + (message.get("function_call") is not None)

    text = content or ""
    if not storable(text):
        return Failure(INVALID_TEXT, "reply holds NUL or a lone surrogate")
    usage = data.get("usage")
    return Reply(text, shaped_finish_reason(finish_reason), tool_call_count,
                 shaped_response_id(response_id),
                 input_tokens=_count(usage, "prompt_tokens"),
                 output_tokens=_count(usage, "completion_tokens"))


def _count(usage: object, key: str) -> int | None:
    """A token count of a usage object, or None if absent or not a non-negative integer.

    Usage is reported, not judged: a server that omits or garbles it still gets its
    summary recorded, only without token figures.
    """
    if not isinstance(usage, dict):
        return None
    value = usage.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        return None
    return value


#: Responses API output items that are neither the answer nor the model's own reasoning:
#: every other type (function_call, web_search_call, mcp_call, computer_call, ...) is
#: a tool at work, counted as a tool call.
_NOT_TOOL_ITEMS: Final = frozenset({"message", "reasoning"})


@_strict
def parse_response(body: bytes) -> ModelOutcome:
    """Classify a 200 Responses API body strictly (contract §8), reading the JSON ourselves.

    Success is `status == "completed"`, exactly one `message` output item whose content
    is `output_text` parts only, no other item but `reasoning`, no refusal, and the text
    rules. Mapped onto what `complete` judges: `finish_reason` is `stop` for a completed
    response, else the status (`incomplete:<reason>` with its incomplete_details), so the
    database answers not_stopped; every other output item counts as a tool call
    (tool_calls); no text is empty. A refusal part, two messages or an unexpected shape
    are failures judged here (refusal, multiple_messages, malformed_response).
    """
    data = _json_object(body)
    status = data.get("status")
    if not isinstance(status, str):
        return _malformed("no status string")
    response_id = _optional(data, "id", str, "a string")
    output = data.get("output")
    if not isinstance(output, list):
        return _malformed("no output list")
    messages: list[dict[str, Any]] = []
    tool_items = 0
    for item in output:
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            return _malformed("output item without a type")
        if item["type"] == "message":
            messages.append(item)
        elif item["type"] not in _NOT_TOOL_ITEMS:
            tool_items += 1
    if len(messages) > 1:
        return Failure(MULTIPLE_MESSAGES, f"{len(messages)} message items")
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            return _malformed("message without a content list")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal":
                refusal = part.get("refusal")
                if not isinstance(refusal, str):
                    return _malformed("refusal is not a string")
                return Failure(REFUSAL, refusal[:200])
            if kind != "output_text" or not isinstance(part.get("text"), str):
                return _malformed(f"message part of type {kind!r}, not output_text")
            parts.append(part["text"])

    finish_reason = "stop" if status == "completed" else status
    details = data.get("incomplete_details")
    if status == "incomplete" and isinstance(details, dict) \
            and isinstance(details.get("reason"), str):
        finish_reason = f"incomplete:{details['reason']}"
    text = "".join(parts)  # as the SDK's output_text joins them
    if not storable(text) or not storable(finish_reason):
        return Failure(INVALID_TEXT, "reply holds NUL or a lone surrogate")
    usage = data.get("usage")
    return Reply(text, shaped_finish_reason(finish_reason), tool_items,
                 shaped_response_id(response_id),
                 input_tokens=_count(usage, "input_tokens"),
                 output_tokens=_count(usage, "output_tokens"))


def failure_from_exception(exc: openai.OpenAIError) -> Failure:
    """Map a transport-level error of the openai client to its stable reason."""
    import openai

    # APITimeoutError subclasses APIConnectionError: test it first.
    if isinstance(exc, openai.APITimeoutError):
        return Failure(TIMEOUT, str(exc))
    if isinstance(exc, openai.APIConnectionError):
        return Failure(CONNECTION_ERROR, str(exc))
    if isinstance(exc, openai.APIStatusError):
        return Failure(http_reason(exc.status_code), str(exc)[:200])
    return _malformed(f"{type(exc).__name__}: {exc}")
