"""The summarizer: what the model is sent, how it is called, and how its answer is judged.

This module owns the `conversation-compaction@3` prompt (shipped as package data and
pinned by SHA-256), the request (only the ten assistant replies, each labelled with its
`assistant_message_id`; never user text; no tools), the two summarizers (the `openai`
client for any compatible server, through Chat Completions or the Responses API, and
the offline `pycompactor/extractive-1`), the figures of DESIGN.md §8, and the strict
classification of every result into a `ModelOutcome` that tells the worker which
database call to make:

* `Reply` -> `compaction.complete(...)` with the reply's own text, `finish_reason` and
  tool-call count. The database is the judge of `not_stopped`, `tool_calls`, `empty` and
  `too_long` (`compaction.reply_problem`); Python keeps no copy of those rules.
* `Failure` -> `compaction.fail(..., reason)` for what only Python can see. The reasons
  are stable strings (see `FAILURE_REASONS`): `refusal`, `multiple_choices`,
  `multiple_messages`, `malformed_response`, `invalid_text`, `timeout`,
  `connection_error`, `http_<status>`.

It holds no database connection and opens no transaction: the worker calls the model
outside any transaction (DESIGN.md §11).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeAlias

from pycompactor.errors import PycompactorError, UsageError

if TYPE_CHECKING:
    # Imported lazily at run time: `openai` takes about a second to import, and the
    # offline summarizer (demo, tests, air-gapped workers) never needs it.
    import openai

PROMPT_VERSION: Final = "conversation-compaction@3"
#: SHA-256 of the prompt file's bytes. A test fails when the text changes: a changed
#: prompt is a new prompt version (DESIGN.md §7), never a silent edit of @3.
PROMPT_SHA256: Final = "2fb544ae95831184434c53a045d61803cd4dfda598c8bb260efd3b6ce048487f"
OFFLINE_MODEL: Final = "pycompactor/extractive-1"
MAX_SUMMARY_CHARS: Final = 6000
PAIRS_PER_RANGE: Final = 10
DEFAULT_TIMEOUT_SECONDS: Final = 120.0
#: HTTP requests per model call at most (one transport retry). Together with the
#: call-wide deadline below, a call ends within `timeout_seconds` plus one backoff.
TRANSPORT_ATTEMPTS: Final = 2
DEFAULT_RETRY_BACKOFF_SECONDS: Final = 0.5

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

#: The two OpenAI APIs the worker can call (`worker --api`).
Api: TypeAlias = Literal["chat", "responses"]
APIS: Final = ("chat", "responses")

# Statuses a transport retry may help with (as the openai client itself retries).
_RETRYABLE_STATUSES: Final = frozenset({408, 409, 429})
# The six ASCII whitespace characters of DESIGN.md §3; NBSP, U+3000 etc. count as content.
_ASCII_WS: Final = " \t\n\r\f\v"


def http_reason(status: int) -> str:
    """The failure reason of an HTTP error status, e.g. `http_429`."""
    return f"http_{status}"


# --- the prompt ----------------------------------------------------------------------


def prompt_bytes(version: str = PROMPT_VERSION) -> bytes:
    """The raw bytes of a shipped prompt file (`pycompactor/prompts/<version>.txt`)."""
    return resources.files("pycompactor").joinpath("prompts", f"{version}.txt").read_bytes()


def load_prompt() -> str:
    """The @3 prompt text, refused if its bytes differ from the pinned hash.

    A mismatch means an edited installation: summaries made with another text must not
    be recorded under `conversation-compaction@3`.
    """
    data = prompt_bytes(PROMPT_VERSION)
    digest = hashlib.sha256(data).hexdigest()
    if digest != PROMPT_SHA256:
        raise PycompactorError(
            f"prompt {PROMPT_VERSION} does not match its pinned SHA-256 ({digest}); "
            "a changed prompt needs a new prompt version"
        )
    return data.decode("utf-8")


# --- the request ---------------------------------------------------------------------


class AssistantReply(Protocol):
    """What the request reads from a pair (pycompactor.models.Pair has it).

    Only these two attributes are read: user text cannot reach the model through here.
    """

    @property
    def assistant_message_id(self) -> str: ...
    @property
    def assistant_content(self) -> str: ...


def replies_document(pairs: Sequence[AssistantReply]) -> str:
    """The model's input: the ten assistant replies as JSON, each labelled with its id.

    JSON rather than ad-hoc delimiters, so no reply text can forge another reply's label.
    Raises ValueError unless there are exactly ten pairs.
    """
    if len(pairs) != PAIRS_PER_RANGE:
        raise ValueError(f"a summary covers exactly {PAIRS_PER_RANGE} pairs, got {len(pairs)}")
    replies = [
        {"assistant_message_id": p.assistant_message_id, "content": p.assistant_content}
        for p in pairs
    ]
    return json.dumps({"assistant_replies": replies}, ensure_ascii=False, indent=1)


def build_messages(pairs: Sequence[AssistantReply]) -> list[dict[str, str]]:
    """System prompt plus one message carrying the replies document."""
    return [
        {"role": "system", "content": load_prompt()},
        {"role": "user", "content": replies_document(pairs)},
    ]


def build_request(pairs: Sequence[AssistantReply], model: str) -> dict[str, Any]:
    """Keyword arguments of `chat.completions.create`: the model and messages, nothing else.

    Deliberately no `tools`, `functions` or `tool_choice` (the summary must be plain
    text), and no sampling or length knobs that some compatible servers reject.
    """
    return {"model": model, "messages": build_messages(pairs)}


def build_responses_request(pairs: Sequence[AssistantReply], model: str) -> dict[str, Any]:
    """Keyword arguments of `responses.create`: the same pinned prompt as `instructions`,
    the same replies document as `input`, and `store: false` (the provider keeps no copy
    of the replies). No tools, no sampling or length knobs, as for Chat Completions.
    """
    return {"model": model, "instructions": load_prompt(), "input": replies_document(pairs),
            "store": False}


# --- figures -------------------------------------------------------------------------

#: A figure (DESIGN.md §8): a maximal run of ASCII digits, possibly joined by single
#: `.`, `,`, `:`, `/` or `-` characters to further digits: `10.37`, `2026-10-09`,
#: `1,200`, `14:30` and `0.36` are one figure each.
FIGURE: Final = re.compile(r"[0-9]+(?:[.,:/-][0-9]+)*")


def figures(text: str) -> set[str]:
    """The distinct figures of a text."""
    return set(FIGURE.findall(text))


@dataclass(frozen=True, slots=True)
class FigureStats:
    """How many distinct figures the ten replies hold, and how many the summary kept.

    A figure is kept when the summary holds it verbatim as a whole figure (a maximal
    match of FIGURE): `2010` does not keep `10`, and `1,200,000` does not keep `1,200`.
    """

    total: int
    kept: int

    @property
    def retention(self) -> float | None:
        """kept / total, or None for a range without figures."""
        return self.kept / self.total if self.total else None

    def below(self, min_retention: float) -> bool:
        """True if fewer than min_retention x total figures were kept (exact arithmetic:
        0.7 means 7/10, so 7 of 10 figures pass). A range without figures never is."""
        if self.total == 0 or min_retention <= 0:
            return False
        return self.kept < Fraction(repr(min_retention)) * self.total


def figure_stats(pairs: Sequence[AssistantReply], summary: str) -> FigureStats:
    """DESIGN.md §8's figures_total and figures_kept of a summary of these replies."""
    source: set[str] = set()
    for pair in pairs:
        source |= figures(pair.assistant_content)
    return FigureStats(len(source), len(source & figures(summary)))


# --- outcomes ------------------------------------------------------------------------


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


def _json_object(body: bytes) -> dict[str, Any] | Failure:
    """A response body as a JSON object, or the malformed_response failure saying why not."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return _malformed(f"body is not JSON: {exc}")
    if not isinstance(data, dict):
        return _malformed("body is not a JSON object")
    return data


class _Malformed(Exception):
    """A response field of the wrong type; the parse answers malformed_response."""


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
    if isinstance(data, Failure):
        return data
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
    return Reply(text, finish_reason, tool_call_count, response_id,
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
    """Classify a 200 Responses API body strictly (DESIGN.md §8), reading the JSON ourselves.

    Success is `status == "completed"`, exactly one `message` output item whose content
    is `output_text` parts only, no other item but `reasoning`, no refusal, and the text
    rules. Mapped onto what `complete` judges: `finish_reason` is `stop` for a completed
    response, else the status (`incomplete:<reason>` with its incomplete_details), so the
    database answers not_stopped; every other output item counts as a tool call
    (tool_calls); no text is empty. A refusal part, two messages or an unexpected shape
    are failures judged here (refusal, multiple_messages, malformed_response).
    """
    data = _json_object(body)
    if isinstance(data, Failure):
        return data
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
    return Reply(text, finish_reason, tool_items, response_id,
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


# --- summarizers ---------------------------------------------------------------------


class Summarizer(Protocol):
    """Turns one range's ten pairs into a ModelOutcome; never raises for model trouble."""

    @property
    def model(self) -> str:
        """The job's `model`, exactly as configured."""
        ...

    def summarize(self, pairs: Sequence[AssistantReply]) -> ModelOutcome: ...

    def close(self) -> None: ...


class OpenAISummarizer:
    """The production path: the `openai` client against any compatible server.

    `timeout_seconds` bounds the whole call, transport retry included: each HTTP request
    gets what is left of that deadline, and a retry (at most one, on connection errors and
    408/409/429/5xx) only happens if time is left. The openai client's own retries are off
    because they would restart the full timeout per request (and honour Retry-After up to
    two minutes), which could outlast a five-minute lease.
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        transport_attempts: int = TRANSPORT_ATTEMPTS,
        retry_backoff_seconds: float = DEFAULT_RETRY_BACKOFF_SECONDS,
        api: Api = "chat",
    ) -> None:
        if api not in APIS:
            raise UsageError(f"--api must be one of {', '.join(APIS)}, got {api!r}")
        if not model:
            raise UsageError("no model given; pass --model or set PYCOMPACTOR_MODEL")
        if not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
            raise UsageError(f"--timeout-seconds must be positive, got {timeout_seconds}")
        if transport_attempts < 1:
            raise ValueError("transport_attempts must be at least 1")
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if not api_key:
            raise UsageError(
                f"model {model!r} needs OPENAI_API_KEY (any value for servers without "
                f"auth), or use --model {OFFLINE_MODEL}"
            )
        self._model = model
        self._api: Api = api
        self._timeout_seconds = float(timeout_seconds)
        self._attempts = transport_attempts
        self._backoff = retry_backoff_seconds
        import openai

        self._client = openai.OpenAI(
            base_url=base_url if base_url is not None else os.environ.get("OPENAI_BASE_URL"),
            api_key=api_key,
            timeout=self._timeout_seconds,
            max_retries=0,  # retries are ours, under one deadline (see class docstring)
        )

    @property
    def model(self) -> str:
        return self._model

    @property
    def base_url(self) -> str:
        return str(self._client.base_url)

    @property
    def api(self) -> Api:
        return self._api

    def _create(self, pairs: Sequence[AssistantReply], timeout: float) -> ModelOutcome:
        """One HTTP request to the configured API, its 200 body classified strictly."""
        if self._api == "responses":
            raw = self._client.responses.with_raw_response.create(
                **build_responses_request(pairs, self._model), timeout=timeout)
            return parse_response(raw.content)
        completion = self._client.chat.completions.with_raw_response.create(
            **build_request(pairs, self._model), timeout=timeout)
        return parse_completion(completion.content)

    def summarize(self, pairs: Sequence[AssistantReply]) -> ModelOutcome:
        import openai

        if len(pairs) != PAIRS_PER_RANGE:
            raise ValueError(f"a summary covers exactly {PAIRS_PER_RANGE} pairs, "
                             f"got {len(pairs)}")
        deadline = time.monotonic() + self._timeout_seconds
        for attempt in range(1, self._attempts + 1):
            retry_after: float | None = None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Failure(TIMEOUT, "deadline reached before the request")
            try:
                outcome = self._create(pairs, remaining)
            except openai.APIStatusError as exc:
                failure = failure_from_exception(exc)
                retry_after = _retry_after_seconds(exc.response.headers.get("retry-after"))
                if not _retryable_status(exc.status_code):
                    return failure
            except openai.APITimeoutError as exc:
                # The request used up the remaining deadline: nothing left to retry with.
                return failure_from_exception(exc)
            except openai.APIConnectionError as exc:
                failure = failure_from_exception(exc)
            except openai.OpenAIError as exc:
                return failure_from_exception(exc)
            else:
                return outcome
            if attempt == self._attempts:
                return failure
            delay = self._backoff if retry_after is None else retry_after
            if time.monotonic() + delay >= deadline:
                return failure  # a retry could not finish inside the deadline
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> OpenAISummarizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _retryable_status(status: int) -> bool:
    return status in _RETRYABLE_STATUSES or status >= 500


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After in seconds (the numeric form only; HTTP dates fall back to the backoff)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


# --- the offline extractive summarizer -----------------------------------------------

# Sentence ends: ASCII .!? followed by whitespace, and the Chinese 。！？ (no space
# needed), each possibly followed by a closing quote or bracket that stays with it.
# Newlines always end a sentence (list items, headings).
_SENTENCE_SPLIT = re.compile(
    r"(?<=[.!?])[ \t\r\f\v]+"
    r"|(?<=[.!?][\"')\]”’])[ \t\r\f\v]+"
    r"|(?<=[。！？])(?![。！？”’」』）)\]\"'])[ \t\r\f\v]*"
    r"|(?<=[。！？][”’」』）)\]\"'])[ \t\r\f\v]*"
)
_LINE_BREAKS = re.compile(r"[\n\r]+")
_ASCII_WS_RUN = re.compile(r"[ \t\n\r\f\v]+")
_DIGIT = re.compile(r"\d")
# Named entities, heuristically: a capitalised word that does not open the sentence,
# an acronym, or a CJK title or quotation (《基金》, 「…」).
_ENTITY = re.compile(
    r"(?<=[^\s.!?。！？])\s+[A-Z][\w&'-]*|\b[A-Z]{2,}\b|[《「『][^》」』]+[》」』]"
)
_ELLIPSIS = "…"
_CJK_ENDS = frozenset("。！？”’」』）")


def split_sentences(text: str) -> list[str]:
    """Sentences of a reply, with runs of ASCII whitespace collapsed to one space."""
    sentences: list[str] = []
    # Only \n and \r end lines: str.splitlines() would also split on U+0085, U+2028 and
    # others, which §3 counts as content.
    for line in _LINE_BREAKS.split(text):
        for piece in _SENTENCE_SPLIT.split(line):
            sentence = _ASCII_WS_RUN.sub(" ", piece).strip(_ASCII_WS)
            if sentence:
                sentences.append(sentence)
    return sentences


def _tier(sentence: str) -> int:
    """2: figures or dates; 1: named entities; 0: the rest."""
    if _DIGIT.search(sentence):
        return 2
    if _ENTITY.search(sentence):
        return 1
    return 0


def _label(message_id: str) -> str:
    return f"[{message_id}]"


def extractive_summary(pairs: Sequence[AssistantReply], limit: int = MAX_SUMMARY_CHARS) -> str:
    """Deterministic extract of the replies, one labelled line per reply, <= limit chars.

    Sentences are chosen greedily by tier (figures and dates, then named entities, then
    the rest) and, within a tier, round-robin across replies so that no long reply
    starves the others; a sentence that does not fit is skipped, not cut. So if all the
    sentences holding digits fit together, every number and date is kept, and if
    everything fits, everything is kept. Replies left without a sentence then get a
    truncated prefix of their best one, if room is left. Output keeps reply order and
    each reply's sentence order.
    """
    sentences = [split_sentences(p.assistant_content) for p in pairs]
    labels = [_label(p.assistant_message_id) for p in pairs]

    candidates: list[tuple[int, int, int, int]] = []  # (-tier, rank, reply, sentence)
    for r, reply_sentences in enumerate(sentences):
        rank_in_tier = [0, 0, 0]
        for s, sentence in enumerate(reply_sentences):
            tier = _tier(sentence)
            candidates.append((-tier, rank_in_tier[tier], r, s))
            rank_in_tier[tier] += 1
    candidates.sort()

    chosen: list[dict[int, str]] = [{} for _ in pairs]
    used = 0
    lines = 0

    def cost(r: int, text: str) -> int:
        if chosen[r]:
            return 1 + len(text)  # a space before it on the reply's line
        return len(labels[r]) + 1 + len(text) + (1 if lines else 0)  # label, newline

    def take(r: int, s: int, text: str) -> None:
        nonlocal used, lines
        used += cost(r, text)
        if not chosen[r]:
            lines += 1
        chosen[r][s] = text

    for _neg_tier, _rank, r, s in candidates:
        if used >= limit - 1:
            break  # the smallest addition costs two characters
        text = sentences[r][s]
        if used + cost(r, text) <= limit:
            take(r, s, text)

    # Replies with nothing chosen (their sentences were all too long): share what is
    # left and give each a cut prefix of its most informative sentence.
    starved = [r for r in range(len(pairs)) if not chosen[r] and sentences[r]]
    for i, r in enumerate(starved):
        share = (limit - used) // (len(starved) - i)
        best = min(c for c in candidates if c[2] == r)[3]
        room = share - cost(r, "")
        if room >= 2:
            text = sentences[r][best]
            take(r, best, _excerpt(text, room))

    out = "\n".join(
        labels[r] + " " + _join([chosen[r][s] for s in sorted(chosen[r])])
        for r in range(len(pairs))
        if chosen[r]
    )
    if not out:
        # Only labels longer than the limit can get here; keep the text, drop the label.
        first = next((" ".join(s) for s in sentences if s), "")
        out = _excerpt(first, limit)
    return out


def _join(sentences: list[str]) -> str:
    """Join with a space, except after CJK sentence ends (no space in Chinese text).

    Budgeting counts a space everywhere, so leaving one out only makes the text shorter.
    """
    parts = [sentences[0]]
    for previous, sentence in itertools.pairwise(sentences):
        parts.append(sentence if previous[-1] in _CJK_ENDS else " " + sentence)
    return "".join(parts)


def _excerpt(text: str, room: int) -> str:
    """At most `room` characters of a sentence, around its first digit if it has one.

    A cut sentence still carries its first figure or date when the figure lies deep in
    a long run of text.
    """
    if len(text) <= room:
        return text
    digit = _DIGIT.search(text)
    start = 0
    if digit is not None and digit.start() > room // 4:
        start = min(digit.start() - room // 4, len(text) - (room - 1))
    lead = _ELLIPSIS if start > 0 else ""
    body_len = room - len(lead) - (1 if start + room - len(lead) < len(text) else 0)
    end = start + body_len
    # Never cut a figure in two: `2026-10` of `2026-10-09` would be a different figure.
    # (No figure is cut at the start: it lies before the first digit.)
    for match in FIGURE.finditer(text, start, len(text)):
        if match.start() >= end:
            break
        if match.end() > end and match.start() > start:
            end = match.start()
            break
    body = text[start:end]
    body_len = len(body)
    tail = _ELLIPSIS if start + body_len < len(text) else ""
    return lead + body + tail


class ExtractiveSummarizer:
    """`pycompactor/extractive-1`: deterministic, offline, no model at all.

    Its output is the same for the same replies on every machine and run, and always a
    normal stop, so it exercises the whole pipeline without a network.
    """

    @property
    def model(self) -> str:
        return OFFLINE_MODEL

    def summarize(self, pairs: Sequence[AssistantReply]) -> ModelOutcome:
        if len(pairs) != PAIRS_PER_RANGE:
            raise ValueError(f"a summary covers exactly {PAIRS_PER_RANGE} pairs, got {len(pairs)}")
        text = extractive_summary(pairs)
        if not storable(text):
            return Failure(INVALID_TEXT, "reply holds NUL or a lone surrogate")
        return Reply(text, "stop", 0, None)

    def close(self) -> None:
        pass

    def __enter__(self) -> ExtractiveSummarizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_summarizer(
    model: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    api: Api = "chat",
) -> Summarizer:
    """The summarizer for a configured model id: offline for `pycompactor/extractive-1`
    (which calls no API, so `api` does not apply)."""
    if model == OFFLINE_MODEL:
        return ExtractiveSummarizer()
    return OpenAISummarizer(
        model, base_url=base_url, api_key=api_key, timeout_seconds=timeout_seconds, api=api
    )
