"""Helpers shared by the worker tests: seeding, reading engine state, running workers."""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import psycopg

from tests.history import History, SeededPair

Conn = psycopg.Connection[Any]

MODEL = "test-model-7"


def user_text(conversation_id: str, i: int) -> str:
    """A user message the model must never see (its marker is searched in request bytes)."""
    return f"USER-SECRET-{conversation_id}-{i:03d} my account number is 4711-{i}"


def assistant_text(conversation_id: str, i: int) -> str:
    return (f"Reply {i} of {conversation_id}: fund F{i} had a NAV of {10 + i}.25 USD "
            f"on 2026-03-{i % 28 + 1:02d}. Morningstar rated it {i % 5 + 1} stars.")


def seed(conn: Conn, conversation_id: str, n: int) -> list[SeededPair]:
    """n pairs with distinct, recognisable user and assistant texts (plain ASCII, no quotes,
    so they appear verbatim in a JSON request body)."""
    h = History(conn)
    seeded = []
    for i in range(n):
        # Fixed-width ids: no id is a substring of another in a request body.
        run_id = h.run(conversation_id, run_id=f"{conversation_id}-r{i:03d}")
        user, assistant = user_text(conversation_id, i), assistant_text(conversation_id, i)
        uid = h.message(conversation_id, run_id, "user", user,
                        message_id=f"{conversation_id}-u{i:03d}")
        aid = h.message(conversation_id, run_id, "assistant", assistant,
                        message_id=f"{conversation_id}-a{i:03d}")
        seeded.append(SeededPair(run_id, uid, aid, user, assistant))
    return seeded


@dataclass(frozen=True, slots=True)
class AttemptRow:
    from_pair: int
    job_id: int
    attempt: int
    state: str
    reason: str | None
    model: str
    scope: str


def attempts(conn: Conn, conversation_id: str | None = None) -> list[AttemptRow]:
    rows = conn.execute(
        "SELECT j.from_pair, a.job_id, a.attempt, a.state, a.reason, j.model, j.scope"
        " FROM compaction.attempts a JOIN compaction.jobs j USING (conversation_id, job_id)"
        " WHERE %(c)s::text IS NULL OR a.conversation_id = %(c)s::text"
        " ORDER BY a.conversation_id, j.from_pair, a.attempt",
        {"c": conversation_id},
    ).fetchall()
    return [AttemptRow(*row) for row in rows]


def summaries(conn: Conn, conversation_id: str | None = None) -> list[tuple[str, int, str]]:
    """(conversation_id, from_pair, summary) of every completed summary."""
    return [
        (str(c), int(f), str(s))
        for c, f, s in conn.execute(
            "SELECT conversation_id, from_pair, summary FROM compaction.summaries"
            " WHERE %(c)s::text IS NULL OR conversation_id = %(c)s::text"
            " ORDER BY conversation_id, from_pair",
            {"c": conversation_id},
        ).fetchall()
    ]


def source_digest(conn: Conn) -> str:
    """A fingerprint of every source row: equal before and after means untouched."""
    row = conn.execute(
        "SELECT md5(coalesce(string_agg(x, '|' ORDER BY x), '')) FROM ("
        " SELECT concat_ws(',', run_id, conversation_id, status, created_at) AS x"
        " FROM compaction_source.runs"
        " UNION ALL SELECT concat_ws(',', message_id, conversation_id, run_id, role, status,"
        " content, seq, created_at) FROM compaction_source.messages) s"
    ).fetchone()
    assert row is not None
    return str(row[0])


def wait_for(predicate: Callable[[], bool], *, timeout: float = 30.0,
             what: str = "condition") -> None:
    """Poll a state (the database, a log) until it holds, failing after a deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def parse_json_log(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class StringLog(io.StringIO):
    """A thread-safe-enough capture stream for in-process workers (EventLog locks writes)."""

    def events(self) -> list[dict[str, Any]]:
        return parse_json_log(self.getvalue())


# --- subprocess workers ------------------------------------------------------------------


def worker_env(dsn: str, base_url: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"OPENAI_BASE_URL", "OPENAI_API_KEY", "PYCOMPACTOR_MODEL"}}
    env["PYCOMPACTOR_DSN"] = dsn
    if base_url is not None:
        env["OPENAI_BASE_URL"] = base_url
        env["OPENAI_API_KEY"] = "sk-test-key-never-logged"
    env.update(extra)
    return env


class WorkerProcess:
    """`python -m pycompactor worker ...` with its JSON log read line by line in a thread."""

    def __init__(self, *args: str, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pycompactor", "worker", "--log-format", "json", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(env),
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stderr,),
                                        daemon=True)
        self._reader.start()

    def _read(self, stream: TextIO | None) -> None:
        assert stream is not None
        with stream:
            for line in stream:
                self.lines.append(line)
                self._new.put(line)
        self._new.put(None)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in list(self.lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"event": "unparsed", "line": line})
        return out

    def wait_event(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """Block until the worker logs `event` (reading its stderr, never sleeping)."""
        deadline = time.monotonic() + timeout
        for seen in self.events():
            if seen.get("event") == event:
                return seen
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {event!r} event; log so far:\n{''.join(self.lines)}")
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"worker exited before {event!r}:\n{''.join(self.lines)}")
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                return dict(record)

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Never leave a worker behind, whatever the test did."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def run_worker_cli(*args: str, env: Mapping[str, str],
                   timeout: float = 60.0) -> tuple[int, list[dict[str, Any]], str]:
    """Run a worker to exit; (exit code, JSON events, raw stderr)."""
    with WorkerProcess(*args, env=env) as proc:
        code = proc.wait(timeout)
    return code, proc.events(), proc.stderr


def events_named(events: list[dict[str, Any]], name: str) -> Iterator[dict[str, Any]]:
    return (e for e in events if e.get("event") == name)


def stop_when(worker: WorkerProcess, done: Callable[[], bool], *, timeout: float,
              what: str) -> None:
    """Wait for `done` while `worker` runs, then stop it with SIGTERM (it must exit 0).
    A timeout says what the worker logged; a worker still alive at the end is killed."""
    try:
        try:
            wait_for(done, timeout=timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the worker said:\n{''.join(worker.lines)}") from None
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()


def complete_verdict(conn: psycopg.Connection[Any], reply: Any) -> str:
    """What `compaction.complete` would answer for a Reply: the database's rule, asked."""
    from pycompactor import db

    return db.reply_problem(conn, reply.text, reply.finish_reason,
                            reply.tool_call_count) or "completed"
