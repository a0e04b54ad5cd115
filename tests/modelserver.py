"""A scripted OpenAI-compatible server on loopback (Chat Completions and Responses), for tests.

A real HTTP server (stdlib `ThreadingHTTPServer` in a thread), so the real `openai`
client is exercised end to end: serialisation, status handling, retries and timeouts.
Every request is recorded byte for byte; each answer comes from a queue of scripted
responses or from a callable. A "hang" response blocks its handler on a
`threading.Event` until the test releases it (or the server stops), so tests
synchronise on events, never on sleeps.

Usable in-process (`ModelServer().start()` returns the base URL) and as a subprocess
for end-to-end tests: `python -m tests.modelserver --reply TEXT` prints the base URL on
its first line and serves that reply until stdin closes or it is terminated.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMPLETIONS_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as received: raw body bytes plus lower-cased headers."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class ScriptedResponse:
    """What the server answers. With `hang`, the handler first blocks until released."""

    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    hang: bool = False


Handler = Callable[[RecordedRequest], ScriptedResponse]


# --- response builders -----------------------------------------------------------------


def choice(
    content: str | None,
    *,
    finish_reason: str | None = "stop",
    tool_calls: int = 0,
    function_call: bool = False,
    refusal: str | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One chat-completion choice in the wire format."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": refusal}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "lookup_nav", "arguments": json.dumps({"fund": i})},
            }
            for i in range(tool_calls)
        ]
    if function_call:
        message["function_call"] = {"name": "lookup_nav", "arguments": "{}"}
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}


#: Token usage every scripted answer reports unless told otherwise: (input, output).
DEFAULT_USAGE = (1, 1)


def completion_body(
    choices: list[dict[str, Any]], *, response_id: str = "chatcmpl-test", model: str = "m",
    usage: tuple[int, int] | None = DEFAULT_USAGE,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                         "total_tokens": usage[0] + usage[1]}
    return body


def json_response(payload: Any, *, status: int = 200) -> ScriptedResponse:
    return ScriptedResponse(status=status, body=json.dumps(payload).encode())


def reply(
    content: str | None,
    *,
    finish_reason: str | None = "stop",
    tool_calls: int = 0,
    function_call: bool = False,
    refusal: str | None = None,
    response_id: str = "chatcmpl-test",
    usage: tuple[int, int] | None = DEFAULT_USAGE,
) -> ScriptedResponse:
    """A single-choice completion with every knob the classification looks at."""
    one = choice(
        content,
        finish_reason=finish_reason,
        tool_calls=tool_calls,
        function_call=function_call,
        refusal=refusal,
    )
    return json_response(completion_body([one], response_id=response_id, usage=usage))


def stop(content: str = "A faithful summary.", *,
         usage: tuple[int, int] | None = DEFAULT_USAGE) -> ScriptedResponse:
    return reply(content, usage=usage)


def length(content: str = "A summary cut off by max_tok") -> ScriptedResponse:
    return reply(content, finish_reason="length")


def content_filter(content: str | None = None) -> ScriptedResponse:
    return reply(content, finish_reason="content_filter")


def tool_call(content: str | None = None, *, count: int = 1) -> ScriptedResponse:
    """A tool call, with or without text (Case A of the article when text is given)."""
    return reply(content, finish_reason="tool_calls", tool_calls=count)


def refusal(message: str = "I can't help with that.") -> ScriptedResponse:
    return reply(None, refusal=message)


def multiple_choices(n: int = 2) -> ScriptedResponse:
    return json_response(completion_body([choice(f"summary {i}", index=i) for i in range(n)]))


def no_choices() -> ScriptedResponse:
    return json_response(completion_body([]))


# --- Responses API builders (the wire format of POST /responses) -------------------------


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def refusal_part(message: str = "I can't help with that.") -> dict[str, Any]:
    return {"type": "refusal", "refusal": message}


def message_item(*parts: dict[str, Any], item_id: str = "msg_test") -> dict[str, Any]:
    """One assistant `message` output item with the given content parts."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": "completed",
            "content": list(parts)}


def function_call_item(name: str = "lookup_nav", *, item_id: str = "fc_test") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": f"call_{item_id}",
            "name": name, "arguments": json.dumps({"fund": 1}), "status": "completed"}


def tool_item(kind: str, *, item_id: str = "ws_test") -> dict[str, Any]:
    """A built-in tool's output item, e.g. `web_search_call`, `file_search_call`."""
    return {"id": item_id, "type": kind, "status": "completed"}


def reasoning_item() -> dict[str, Any]:
    return {"id": "rs_test", "type": "reasoning", "summary": []}


def response_body(
    output: list[dict[str, Any]], *, status: str = "completed",
    response_id: str = "resp_test", model: str = "m", incomplete_reason: str | None = None,
    usage: tuple[int, int] | None = DEFAULT_USAGE,
) -> dict[str, Any]:
    """A Responses API response object."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": 1_700_000_000,
        "status": status,
        "error": None,
        "incomplete_details": (None if incomplete_reason is None
                               else {"reason": incomplete_reason}),
        "instructions": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    if usage is not None:
        body["usage"] = {
            "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage[0] + usage[1],
        }
    return body


def response(
    text: str | None = "A faithful summary.", *, status: str = "completed",
    incomplete_reason: str | None = None, extra_items: tuple[dict[str, Any], ...] = (),
    response_id: str = "resp_test", usage: tuple[int, int] | None = DEFAULT_USAGE,
) -> ScriptedResponse:
    """A Responses API answer: one message with one output_text part (none if text is
    None), followed by `extra_items`."""
    output = [] if text is None else [message_item(output_text(text))]
    return json_response(response_body(
        [*output, *extra_items], status=status, incomplete_reason=incomplete_reason,
        response_id=response_id, usage=usage))


def http_error(status: int, *, retry_after: str | None = None) -> ScriptedResponse:
    """An API error. 408/409/429/5xx are retryable: the client's retry bound applies."""
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    if retry_after is not None:
        headers += (("Retry-After", retry_after),)
    body = json.dumps({"error": {"message": f"scripted {status}", "type": "test", "code": None}})
    return ScriptedResponse(status=status, body=body.encode(), headers=headers)


def malformed_json() -> ScriptedResponse:
    return ScriptedResponse(status=200, body=b'{"id": "chatcmpl-x", "choices": [{"index": 0,')


def raw(body: bytes, *, status: int = 200) -> ScriptedResponse:
    return ScriptedResponse(status=status, body=body)


def hang(then: ScriptedResponse | None = None) -> ScriptedResponse:
    """Block until `ModelServer.release()`, then answer `then` (default: a normal stop)."""
    return dataclasses.replace(then or stop(), hang=True)


def too_long(chars: int = 6001) -> ScriptedResponse:
    return stop("x" * chars)


# --- local OpenAI-compatible servers, as each answers (docs/models.md) -------------------

#: How each local server is reached and what it says, as docs/models.md gives it: the
#: base URL's port, the model name it serves (None: any name is taken, the loaded model
#: answers), what its answers carry beyond OpenAI's fields, and the error body for a
#: model it does not serve.
LOCAL_SERVERS: dict[str, dict[str, Any]] = {
    "llama.cpp": {"port": 8080, "model": None,
                  "extra": {"system_fingerprint": "b4600-0123abcd",
                            "timings": {"prompt_n": 1, "predicted_n": 1}}},
    "vllm": {"port": 8000, "model": "Qwen/Qwen2.5-7B-Instruct",
             "extra": {"prompt_logprobs": None}, "choice_extra": {"stop_reason": None},
             "unknown": {"object": "error", "message": "The model `{model}` does not exist.",
                         "type": "NotFoundError", "param": None, "code": 404}},
    "ollama": {"port": 11434, "model": "llama3.1:8b",
               "extra": {"system_fingerprint": "fp_ollama"},
               "unknown": {"error": {"message": "model \"{model}\" not found, try pulling it first",
                                     "type": "api_error", "param": None, "code": None}}},
}
#: The scripted model's characters per token: an answer longer than max_tokens x this is
#: cut there with finish_reason "length", as each of the three servers does.
CHARS_PER_TOKEN = 4


def local_server(kind: str, text: str) -> Handler:
    """A Chat Completions handler answering as `kind` (a key of LOCAL_SERVERS) would with
    a model whose answer is `text`: the model name checked as that server checks it, the
    answer cut at the request's max_tokens (or max_completion_tokens) with
    finish_reason "length", else "stop", with the server's own extra fields."""
    server = LOCAL_SERVERS[kind]

    def answer(request: RecordedRequest) -> ScriptedResponse:
        body = request.json
        served = server["model"]
        if served is not None and body["model"] != served:
            error = json.loads(json.dumps(server["unknown"]).replace("{model}", body["model"]))
            return json_response(error, status=404)
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        content, finish = text, "stop"
        if limit is not None and len(text) > limit * CHARS_PER_TOKEN:
            content, finish = text[: limit * CHARS_PER_TOKEN], "length"
        one = {**choice(content, finish_reason=finish), **server.get("choice_extra", {})}
        tokens = -(-len(content) // CHARS_PER_TOKEN)
        payload = {**completion_body([one], model=served or "local-model",
                                     usage=(1200, tokens)), **server["extra"]}
        return json_response(payload)

    return answer


# --- the server --------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    # Handler threads are joined on close (block_on_close), so none outlives the server.
    daemon_threads = False
    owner: ModelServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and went away is an expected event in these tests,
        # not something to print a traceback for.
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            return
        self.owner._note_error(f"handler crashed: {exc!r}")


class _RequestHandler(BaseHTTPRequestHandler):
    server: _Server
    # One request per connection (HTTP/1.0): no keep-alive thread lingers after a test.
    protocol_version = "HTTP/1.0"
    # A stalled client must not block server shutdown forever.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        recorded = RecordedRequest(
            method="POST",
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
        )
        owner = self.server.owner
        if self.path.split("?", 1)[0] not in COMPLETIONS_PATHS | RESPONSES_PATHS:
            owner._record(recorded)
            self._send(http_error(404))
            return
        response = owner._next(recorded)
        if response.hang:
            owner.hanging.set()
            owner._released.wait()
            if owner._stopping.is_set():
                return  # drop the connection: the test is over
        self._send(response)

    def _send(self, response: ScriptedResponse) -> None:
        self.send_response(response.status)
        for name, value in response.headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        self.wfile.write(response.body)


class ModelServer:
    """Scripted chat-completions server; `start()` returns the base URL (ends in /v1).

    Answers come from `enqueue(...)`d responses in order, else from `handler`, else a
    500 marked `x-should-retry: false` that also lands in `errors` so the test fails.
    """

    def __init__(
        self,
        responses: Iterable[ScriptedResponse] = (),
        *,
        handler: Handler | None = None,
    ) -> None:
        self._queue: collections.deque[ScriptedResponse] = collections.deque(responses)
        self.handler = handler
        self._requests: list[RecordedRequest] = []
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._stopping = threading.Event()
        #: Set when a handler starts hanging: wait on it instead of sleeping.
        self.hanging = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle

    def start(self) -> str:
        server = _Server(("127.0.0.1", 0), _RequestHandler)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="modelserver", kwargs={"poll_interval": 0.05}
        )
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Stop serving; hanging handlers are released and their connections dropped."""
        if self._server is None:
            return
        self._stopping.set()
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server = None

    def __enter__(self) -> ModelServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # scripting

    def enqueue(self, *responses: ScriptedResponse) -> None:
        with self._lock:
            self._queue.extend(responses)

    def release(self) -> None:
        """Let every current and future hanging handler answer."""
        self._released.set()

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def errors(self) -> list[str]:
        """Unscripted requests and handler crashes; a clean test leaves this empty."""
        with self._lock:
            return list(self._errors)

    def _note_error(self, message: str) -> None:
        with self._lock:
            self._errors.append(message)

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def _next(self, request: RecordedRequest) -> ScriptedResponse:
        with self._lock:
            self._requests.append(request)
            if self._queue:
                return self._queue.popleft()
            handler = self.handler
            if handler is None:
                self._errors.append(f"unscripted request #{len(self._requests)}")
        if handler is not None:
            return handler(request)
        return dataclasses.replace(
            http_error(500), headers=(*http_error(500).headers, ("x-should-retry", "false"))
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.modelserver")
    parser.add_argument("--reply", default="A faithful summary.", help="text of every answer")
    args = parser.parse_args(argv)
    text: str = args.reply

    def answer(request: RecordedRequest) -> ScriptedResponse:
        # Whichever API the client speaks.
        if request.path.split("?", 1)[0] in RESPONSES_PATHS:
            return response(text)
        return stop(text)

    with ModelServer(handler=answer) as server:
        print(server.base_url, flush=True)
        # Serve until the parent closes our stdin (or terminates us).
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def serving(handler: Callable[[RecordedRequest], ScriptedResponse]) -> Iterator[ModelServer]:
    """A fixture's body: a server answering with `handler`; the teardown fails the test on
    a request the handler could not answer."""
    with ModelServer(handler=handler) as server:
        yield server
    assert server.errors == [], server.errors
