"""`pycompactor import`: one's own history into the reference tables (`compaction_source`).

A file of JSON lines, one conversation a line, in either of two forms (docs/import.md):

* the `evaluate --jsonl` form: `{"conversation_id", "language", "pairs": [{"user",
  "assistant"}, ...]}` oldest first, each pair a completed Run; a pair may name its own
  `run_id`, `user_message_id` and `assistant_message_id`, else they are derived from the
  conversation id and the pair's position;
* the OpenAI Agents SDK's session items: `{"conversation_id" (or "session_id"), "items":
  [...]}`, the items as `Session.get_items()` returns them, stored as
  `pycompactor.integrations.openai_agents.PycompactorSession` stores them (a user
  message opens a Run, the Run's last assistant message is its answer, other items are
  kept but never paired); an item's own `id` is its message id.

The whole file is read and checked first: a malformed line stops the import before
anything is written, with an error naming the line. Then each conversation is written in
a transaction of its own, `batch_size` rows a statement, skipping ids already there (so a
re-import writes nothing twice), and queued for the worker (`compaction.enqueue`); the
reference tables are analyzed at the end.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pycompactor import db, store
from pycompactor.errors import UsageError, wrap_exceptions
from pycompactor.integrations.openai_agents import COMPLETED, IN_PROGRESS, INTERIM_ROLE, ITEM_ROLE

#: Rows per INSERT statement.
DEFAULT_BATCH_SIZE: Final = 1000
_PAIRS_FORM: Final = ('{"conversation_id", "pairs": [{"user", "assistant"}, ...]} or '
                      '{"conversation_id", "items": [Agents SDK items]}')


@dataclass(frozen=True, slots=True)
class Conversation:
    """One line's conversation as it will be written."""

    line: int
    conversation_id: str
    runs: tuple[store.RunRow, ...]
    messages: tuple[store.MessageRow, ...]


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What an import did: conversations read, rows written and rows already there."""

    conversations: int
    runs_written: int
    messages_written: int
    runs_present: int
    messages_present: int
    scope: str

    def to_dict(self) -> dict[str, object]:
        return {"conversations": self.conversations, "runs_written": self.runs_written,
                "messages_written": self.messages_written, "runs_present": self.runs_present,
                "messages_present": self.messages_present, "scope": self.scope}


class MalformedRecord(ValueError):
    """A line that is not one conversation in either form."""


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise MalformedRecord(f"{what} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise MalformedRecord(f"{what} holds a NUL character, which PostgreSQL text cannot")
    return value


def _id(value: Any, what: str) -> str:
    text = _text(value, what)
    if not text.strip():
        raise MalformedRecord(f"{what} must not be blank")
    return text


def _from_pairs(conversation_id: str, pairs: Any) -> tuple[list[store.RunRow],
                                                          list[store.MessageRow]]:
    if not isinstance(pairs, list):
        raise MalformedRecord("pairs must be a list")
    runs: list[store.RunRow] = []
    messages: list[store.MessageRow] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, dict):
            raise MalformedRecord(f"pairs[{i}] must be an object")
        for key in ("user", "assistant"):
            if key not in pair:
                raise MalformedRecord(f"pairs[{i}] has no {key!r}")
        run_id = _id(pair.get("run_id", f"{conversation_id}/run-{i:06d}"), f"pairs[{i}].run_id")
        user_id = _id(pair.get("user_message_id", f"{run_id}/user"),
                      f"pairs[{i}].user_message_id")
        assistant_id = _id(pair.get("assistant_message_id", f"{run_id}/assistant"),
                           f"pairs[{i}].assistant_message_id")
        runs.append(store.RunRow(run_id, COMPLETED))
        messages.append(store.MessageRow(user_id, conversation_id, run_id, "user", COMPLETED,
                                         _text(pair["user"], f"pairs[{i}].user"), 2 * i + 1))
        messages.append(store.MessageRow(assistant_id, conversation_id, run_id, "assistant",
                                         COMPLETED,
                                         _text(pair["assistant"], f"pairs[{i}].assistant"),
                                         2 * i + 2))
    return runs, messages


def _content_text(content: Any, what: str) -> str:
    """A message item's text: a string, or the text of its text parts (images and files
    are not kept, as PycompactorSession keeps them)."""
    if isinstance(content, str):
        return _text(content, what)
    if not isinstance(content, list):
        raise MalformedRecord(f"{what} must be a string or a list of parts")
    parts = [part.get("text", part.get("refusal")) for part in content
             if isinstance(part, dict)]
    return "\n".join(_text(p, what) for p in parts if p is not None)


def _from_items(conversation_id: str, items: Any) -> tuple[list[store.RunRow],
                                                          list[store.MessageRow]]:
    if not isinstance(items, list):
        raise MalformedRecord("items must be a list")
    runs: list[store.RunRow] = []
    messages: list[store.MessageRow] = []
    run_id: str | None = None
    # Per run: the index in `messages` of its newest assistant message (its answer).
    answers: dict[str, int] = {}
    for position, item in enumerate(items):
        what = f"items[{position}]"
        if not isinstance(item, dict):
            raise MalformedRecord(f"{what} must be an object")
        message_id = _id(item.get("id", f"{conversation_id}/item-{position:06d}"), f"{what}.id")
        role = item.get("role") if item.get("type", "message") == "message" else None
        if role is not None and not isinstance(role, str):
            raise MalformedRecord(f"{what}.role must be a string")
        seq = position + 1
        if role == "user":
            run_id = f"{conversation_id}/run-{len(runs):06d}"
            runs.append(store.RunRow(run_id, IN_PROGRESS))
            messages.append(store.MessageRow(message_id, conversation_id, run_id, "user",
                                             COMPLETED,
                                             _content_text(item.get("content"), what), seq))
        elif role == "assistant" and run_id is not None:
            earlier = answers.get(run_id)
            if earlier is not None:  # not the run's answer after all: it went on working
                old = messages[earlier]
                messages[earlier] = store.MessageRow(
                    old.message_id, old.conversation_id, old.run_id, INTERIM_ROLE,
                    old.status, old.content, old.seq)
            answers[run_id] = len(messages)
            status = item.get("status") or COMPLETED
            messages.append(store.MessageRow(message_id, conversation_id, run_id, "assistant",
                                             _id(status, f"{what}.status"),
                                             _content_text(item.get("content"), what), seq))
        else:
            # An answer with no question, another role, or a non-message item: kept, never
            # paired (docs/contract.md §3 ignores other roles).
            content = (_content_text(item.get("content"), what) if role is not None
                       else json.dumps(item, ensure_ascii=False))
            stored_role = (ITEM_ROLE if role is None
                           else INTERIM_ROLE if role == "assistant" else role)
            messages.append(store.MessageRow(message_id, conversation_id, run_id, stored_role,
                                             COMPLETED, _text(content, what), seq))
    # A run is settled when its newest item is its completed answer (a turn that went
    # on past its last answer, or never answered, stays in progress: no pair).
    last_of_run: dict[str, int] = {}
    for index, message in enumerate(messages):
        if message.run_id is not None:
            last_of_run[message.run_id] = index
    settled = {run for run, index in answers.items()
               if last_of_run[run] == index and messages[index].status == COMPLETED}
    return ([store.RunRow(r.run_id, COMPLETED if r.run_id in settled else IN_PROGRESS)
             for r in runs], messages)


def parse_record(line: int, data: Any) -> Conversation:
    """One line's conversation, or MalformedRecord saying what is wrong with it."""
    if not isinstance(data, dict):
        raise MalformedRecord("not a JSON object")
    raw_id = data.get("conversation_id", data.get("session_id"))
    if raw_id is None:
        raise MalformedRecord("no conversation_id")
    conversation_id = _id(raw_id, "conversation_id")
    if "pairs" in data:
        runs, messages = _from_pairs(conversation_id, data["pairs"])
    elif "items" in data:
        runs, messages = _from_items(conversation_id, data["items"])
    else:
        raise MalformedRecord("neither pairs nor items")
    for kind, ids in (("run id", [r.run_id for r in runs]),
                      ("message id", [m.message_id for m in messages])):
        if len(set(ids)) != len(ids):
            raise MalformedRecord(f"a {kind} repeats within the conversation")
    return Conversation(line, conversation_id, tuple(runs), tuple(messages))


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None


def read_file(path: Path) -> Iterator[Conversation]:
    """The file's conversations in order; a malformed line is a UsageError naming it."""
    seen: dict[str, int] = {}
    for number, line in _lines(path):
        try:
            conversation = parse_record(number, json.loads(line))
        except (ValueError, RecursionError) as exc:  # MalformedRecord and bad JSON alike
            raise UsageError(f"{path}:{number}: {exc}; expected {_PAIRS_FORM}") from None
        first = seen.setdefault(conversation.conversation_id, number)
        if first != number:
            raise UsageError(f"{path}:{number}: conversation "
                             f"{conversation.conversation_id!r} is also on line {first};"
                             " one line a conversation")
        yield conversation


def check_file(path: Path) -> int:
    """Read and check every line before anything is written; how many conversations."""
    return sum(1 for _ in read_file(path))


def import_file(conn: db.Connection, path: Path, *, scope: str = "default",
                batch_size: int = DEFAULT_BATCH_SIZE,
                progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Check the whole file, then write each conversation in a transaction of its own and
    queue it for the worker in `scope`; analyze the reference tables at the end."""
    total = check_file(path)
    runs_written = messages_written = runs_present = messages_present = 0
    done = 0
    for conversation in read_file(path):
        with wrap_exceptions(), conn.transaction():
            runs, messages = store.insert_history(
                conn, conversation.conversation_id, conversation.runs, conversation.messages,
                batch_size=batch_size)
            # The reference tables' triggers queue the default scope; this also covers
            # another scope, and a source whose triggers are detached (Citus).
            db.enqueue(conn, conversation.conversation_id, scope)
        runs_written += runs
        messages_written += messages
        runs_present += len(conversation.runs) - runs
        messages_present += len(conversation.messages) - messages
        done += 1
        if progress is not None:
            progress(done, total)
    with wrap_exceptions():
        store.analyze_reference_tables(conn)
    return ImportReport(done, runs_written, messages_written, runs_present, messages_present,
                        scope)


def terminal_progress(done: int, total: int) -> None:
    """A one-line progress bar on stderr (only shown on a terminal)."""
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done == total else ""
    print(f"\rimporting [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
          " conversations\x1b[K", end=end, file=sys.stderr, flush=True)


def render(report: ImportReport) -> str:
    return (f"imported {report.conversations} conversations: {report.runs_written} runs and"
            f" {report.messages_written} messages written, {report.runs_present} runs and"
            f" {report.messages_present} messages already there; queued for the worker"
            f" (scope {report.scope}); the reference tables analyzed")
