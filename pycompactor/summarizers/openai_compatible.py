"""The summarizers: what the model is sent and how it is called.

This module owns the `conversation-compaction@3` prompt (shipped as package data and
pinned by SHA-256), the request (only the ten assistant replies, each labelled with its
`assistant_message_id`; never user text; no tools), the `openai` client summarizer for
any compatible server (Chat Completions or the Responses API, with its deadline and
transport retry), and `make_summarizer`, which picks it or the offline
`pycompactor/extractive-1` (`extractive`), `pycompactor/extractive-2` (`extractive2`) or
`pycompactor/extractive-3` (`extractive3`, the default offline model).
What a call came to is an `outcomes`
`ModelOutcome`; the figures a summary kept are `figures`.

It holds no database connection and opens no transaction: the worker calls the model
outside any transaction (contract §11).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final, Literal, Protocol, TypeAlias

from pycompactor.errors import ModelUnreachable, PycompactorError, UsageError
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.models import AssistantReply
from pycompactor.summarizers.extractive import OFFLINE_MODEL, ExtractiveSummarizer
from pycompactor.summarizers.extractive2 import (
    DEFAULT_TARGET,
    EXTRACTIVE2_MODEL,
    Extractive2Summarizer,
)
from pycompactor.summarizers.extractive3 import DEFAULT_TARGET as EXTRACTIVE3_TARGET
from pycompactor.summarizers.extractive3 import EXTRACTIVE3_MODEL, Extractive3Summarizer
from pycompactor.summarizers.outcomes import (
    CONNECTION_ERROR,
    TIMEOUT,
    Failure,
    ModelOutcome,
    failure_from_exception,
    parse_completion,
    parse_response,
)

# `openai` is imported where it is used: it takes about a second to import, and the
# offline summarizer (demo, tests, air-gapped workers) never needs it.

PROMPT_VERSION: Final = "conversation-compaction@3"
#: SHA-256 of the prompt file's bytes. A test fails when the text changes: a changed
#: prompt is a new prompt version (contract §7), never a silent edit of @3.
PROMPT_SHA256: Final = "2fb544ae95831184434c53a045d61803cd4dfda598c8bb260efd3b6ce048487f"
DEFAULT_TIMEOUT_SECONDS: Final = 120.0
#: HTTP requests per model call at most (one transport retry). Together with the
#: call-wide deadline below, a call ends within `timeout_seconds` plus one backoff.
TRANSPORT_ATTEMPTS: Final = 2
DEFAULT_RETRY_BACKOFF_SECONDS: Final = 0.5

#: The two OpenAI APIs the worker can call (`worker --api`).
Api: TypeAlias = Literal["chat", "responses"]
APIS: Final = ("chat", "responses")

# Statuses a transport retry may help with (as the openai client itself retries).
_RETRYABLE_STATUSES: Final = frozenset({408, 409, 429})

#: The output limit sent with each request by default (`--max-output-tokens`). A summary
#: may hold 6,000 characters (contract §6): about 1,500 tokens of English at four
#: characters a token, more in scripts with fewer characters per token. 2,000 lets every
#: summary the engine can accept finish, and stops a runaway local model soon after the
#: point where `complete` would refuse its answer as too_long anyway: it bounds the
#: time and cost of a wordy model, it does not make it brief (a cut-off answer ends with
#: finish_reason "length" and fails as not_stopped; docs/models.md).
DEFAULT_MAX_OUTPUT_TOKENS: Final = 2000
#: Sampling temperature sent by default (`--temperature`): the same replies should give
#: the same summary as far as the server allows. Dropped for a model that refuses it.
DEFAULT_TEMPERATURE: Final = 0.0
#: The Chat Completions output limit under its older name, which llama.cpp's server,
#: vLLM and Ollama document (and OpenAI's non-reasoning models accept), and under the
#: newer one, which OpenAI's reasoning models require (they refuse the older with a 400
#: naming it).
_CHAT_LIMIT: Final = "max_tokens"
_CHAT_LIMIT_NEW: Final = "max_completion_tokens"


#: The offline model ids this package knows, oldest first: `make_summarizer` builds
#: them, and an unknown `pycompactor/...` id is refused with the nearest of them.
OFFLINE_MODELS: Final = (OFFLINE_MODEL, EXTRACTIVE2_MODEL, EXTRACTIVE3_MODEL)
#: The offline model suggested to a user without an API key (the default of `evaluate`).
DEFAULT_OFFLINE_MODEL: Final = EXTRACTIVE3_MODEL
#: The prefix of this package's own model ids: no server serves such a model.
OFFLINE_PREFIX: Final = "pycompactor/"


def check_offline_model(model: str) -> None:
    """Refuse an unknown `pycompactor/...` id with the nearest known one (a typo must
    not reach a server as a model name, or ask for an API key)."""
    if not model.startswith(OFFLINE_PREFIX) or model in OFFLINE_MODELS:
        return
    nearest = difflib.get_close_matches(model, OFFLINE_MODELS, n=1, cutoff=0.0)
    raise UsageError(f"unknown model {model!r}; did you mean {nearest[0]}? "
                     f"(offline models: {', '.join(OFFLINE_MODELS)})")


# --- the prompt ----------------------------------------------------------------------


def prompt_bytes(version: str = PROMPT_VERSION) -> bytes:
    """The raw bytes of a shipped prompt file (`prompts/<version>.txt` beside this module)."""
    shipped = resources.files("pycompactor.summarizers").joinpath("prompts", f"{version}.txt")
    return shipped.read_bytes()


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
    """Keyword arguments of `chat.completions.create`: the model and messages.

    Deliberately no `tools`, `functions` or `tool_choice` (the summary must be plain
    text). The output limit and the temperature are `OpenAISummarizer`'s to add: it
    drops or renames one a server refuses.
    """
    return {"model": model, "messages": build_messages(pairs)}


def build_responses_request(pairs: Sequence[AssistantReply], model: str) -> dict[str, Any]:
    """Keyword arguments of `responses.create`: the same pinned prompt as `instructions`,
    the same replies document as `input`, and `store: false` (the provider keeps no copy
    of the replies). No tools; the output limit and temperature as for Chat Completions.
    """
    return {"model": model, "instructions": load_prompt(), "input": replies_document(pairs),
            "store": False}


def _refused_parameter(exc: Exception, names: Sequence[str]) -> str | None:
    """Which of `names` a 400 answer refuses: its `param`, else the first named in its
    message (OpenAI: "Unsupported parameter: 'max_tokens' ...", "Unsupported value:
    'temperature' does not support 0 ..."; compatible servers word it their own way)."""
    body = getattr(exc, "body", None)
    param = body.get("param") if isinstance(body, dict) else None
    if isinstance(param, str) and param in names:
        return param
    message = str(exc)
    return next((n for n in names if f"'{n}'" in message or f'"{n}"' in message), None)


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
        max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS,
        temperature: float | None = DEFAULT_TEMPERATURE,
    ) -> None:
        if api not in APIS:
            raise UsageError(f"--api must be one of {', '.join(APIS)}, got {api!r}")
        if not model:
            raise UsageError("no model given; pass --model or set PYCOMPACTOR_MODEL")
        if not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
            raise UsageError(f"--timeout-seconds must be positive, got {timeout_seconds}")
        if transport_attempts < 1:
            raise ValueError("transport_attempts must be at least 1")
        if max_output_tokens is not None and (isinstance(max_output_tokens, bool)
                                              or max_output_tokens < 1):
            raise UsageError(f"--max-output-tokens must be 1 or more (0 sends none), "
                             f"got {max_output_tokens}")
        if temperature is not None and not 0.0 <= temperature <= 2.0:
            raise UsageError(f"--temperature must lie between 0 and 2, got {temperature}")
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if not api_key:
            raise UsageError(
                f"model {model!r} needs OPENAI_API_KEY (any value for servers without "
                f"auth), or use the offline --model {DEFAULT_OFFLINE_MODEL}"
            )
        self._model = model
        self._api: Api = api
        self._timeout_seconds = float(timeout_seconds)
        self._attempts = transport_attempts
        self._backoff = retry_backoff_seconds
        # The knobs each request carries; one a server refuses (a 400 naming it) is
        # dropped, or the chat limit renamed, for the rest of this summarizer's life.
        self._knobs: dict[str, Any] = {}
        if max_output_tokens is not None:
            limit = "max_output_tokens" if api == "responses" else _CHAT_LIMIT
            self._knobs[limit] = max_output_tokens
        if temperature is not None:
            self._knobs["temperature"] = temperature
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

    @property
    def knobs(self) -> dict[str, Any]:
        """The output limit and temperature the next request carries, by wire name."""
        return dict(self._knobs)

    def _create(self, pairs: Sequence[AssistantReply], timeout: float) -> ModelOutcome:
        """One HTTP request to the configured API, its 200 body classified strictly.

        A 400 that refuses one of the knobs (a reasoning model takes no temperature but
        its default and wants max_completion_tokens) drops or renames it and asks again,
        at most once per knob: "default 0 where the API accepts it".
        """
        import openai

        while True:
            try:
                if self._api == "responses":
                    raw = self._client.responses.with_raw_response.create(
                        **build_responses_request(pairs, self._model), **self._knobs,
                        timeout=timeout)
                    return parse_response(raw.content)
                completion = self._client.chat.completions.with_raw_response.create(
                    **build_request(pairs, self._model), **self._knobs, timeout=timeout)
                return parse_completion(completion.content)
            except openai.BadRequestError as exc:
                refused = _refused_parameter(exc, list(self._knobs))
                if refused is None:
                    raise
                value = self._knobs.pop(refused)
                if refused == _CHAT_LIMIT:
                    self._knobs[_CHAT_LIMIT_NEW] = value

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


def make_summarizer(
    model: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    api: Api = "chat",
    extractive_target: float | None = None,
    max_output_tokens: int | None = DEFAULT_MAX_OUTPUT_TOKENS,
    temperature: float | None = DEFAULT_TEMPERATURE,
) -> Summarizer:
    """The summarizer for a configured model id: offline for `pycompactor/extractive-1`,
    `-2` and `-3` (which call no API, so `api` does not apply; `extractive_target` is
    extractive-2's and extractive-3's share of the replies' bytes, None for the model's
    own default). Any other `pycompactor/...` id is a usage error naming the nearest
    known one."""
    check_offline_model(model)
    if model == OFFLINE_MODEL:
        return ExtractiveSummarizer()
    if model in (EXTRACTIVE2_MODEL, EXTRACTIVE3_MODEL):
        if extractive_target is None:
            extractive_target = (EXTRACTIVE3_TARGET if model == EXTRACTIVE3_MODEL
                                 else DEFAULT_TARGET)
        if not 0.0 < extractive_target <= 1.0:
            raise UsageError("--extractive-target must be a share above 0 and at most 1, "
                             f"got {extractive_target}")
        if model == EXTRACTIVE3_MODEL:
            return Extractive3Summarizer(extractive_target)
        return Extractive2Summarizer(extractive_target)
    return OpenAISummarizer(
        model, base_url=base_url, api_key=api_key, timeout_seconds=timeout_seconds, api=api,
        max_output_tokens=max_output_tokens, temperature=temperature,
    )


def unreachable(summarizer: Summarizer, outcome: ModelOutcome) -> ModelUnreachable | None:
    """The error to stop with when `outcome`, a remote summarizer's first, could not
    connect: nothing will work until the server is up or the URL fixed, and every range
    failing `connection_error` one by one says so less clearly. A later call's
    connection error is an ordinary failed attempt (a server restarting)."""
    if not (isinstance(outcome, Failure) and outcome.reason == CONNECTION_ERROR):
        return None
    url = getattr(summarizer, "base_url", None)
    if url is None:
        return None
    return ModelUnreachable(
        f"cannot connect to the model server at {url} ({outcome.detail or CONNECTION_ERROR});"
        " start the server or fix --base-url (OPENAI_BASE_URL)")


class FirstCallGuard:
    """A summarizer that raises `unreachable`'s error when its first call cannot connect
    (what `evaluate` runs: it measures, so a dead server is an error, not a result)."""

    def __init__(self, inner: Summarizer) -> None:
        self._inner = inner
        self._called = False

    @property
    def model(self) -> str:
        return self._inner.model

    def summarize(self, pairs: Sequence[AssistantReply]) -> ModelOutcome:
        outcome = self._inner.summarize(pairs)
        if not self._called:
            self._called = True
            error = unreachable(self._inner, outcome)
            if error is not None:
                raise error
        return outcome

    def close(self) -> None:
        self._inner.close()
