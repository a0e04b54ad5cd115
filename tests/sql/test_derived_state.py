"""Derived state (contract §2): after any write to the source, the read functions equal a
from-scratch recomputation and compaction.verify_conversation finds nothing.

A hypothesis property: random sequences of writes (whole Runs appended, bulk inserts, old
messages edited, whitespace-only and NBSP edits, run and message status flips, a second
assistant message, deleted messages and runs, Runs inserted before others, ties on seq,
messages and runs moved to another conversation, a run id reused in another conversation,
a run created for a message that named it from elsewhere, a run deleted under its
messages, roles, seqs and message ids changed, one
UPDATE across several conversations, several writes in one transaction, rolled-back
transactions). After each write, and inside each multi-write transaction after every
write, `eligible_pairs`, `plan_targets` and `source_hash` (every multiple of 10 up to past
the end, and invalid ones) of every conversation of the example equal tests/recompute.py's
recomputation from the raw rows, `verify_conversation` is empty, and `claim` accepts the
recomputed first target and refuses a wrong hash and a non-target. The same generator
runs against the reference tables and against the documented host schema
(docs/integrating.md's worked example) with the tracking triggers attached, and without
them (judged from the views on each call: exact too; nothing to verify).

Each example uses conversations of its own, so one cloned database serves every example.
PYCOMPACTOR_PROPERTY_EXAMPLES raises the number of examples for a longer search.
"""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pycompactor import project_history
from tests.recompute import (
    PairRow,
    Raw,
    RawMessage,
    RawRun,
    assert_c_collation,
    assert_matches,
    derived_state_in_use,
    pairs_of,
    ranges_of,
    read_reference,
    targets_of,
)

Conn = psycopg.Connection[Any]
DOC = Path(__file__).resolve().parents[2] / "docs" / "integrating.md"
EXAMPLES = int(os.environ.get("PYCOMPACTOR_PROPERTY_EXAMPLES", "0"))

RUN_STATUSES = ["completed", "partial", "clarify_pending", "running", "failed"]
MESSAGE_STATUSES = ["completed", "streaming", "failed"]
ROLES = ["user", "assistant", "tool", "system"]
MAX_INITIAL_PAIRS = 45


# ---------------------------------------------------------------------------------------
# Sources: the same writes, in the reference tables' or the host's vocabulary
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NewMessage:
    conversation_id: str
    run_id: str | None
    role: str
    status: str
    content: str
    seq: int


class Source(Protocol):
    """Writes and raw reads of one source schema, in the contract's vocabulary."""

    def conversation_ids(self, example: int, count: int) -> list[str]: ...
    def create_conversations(self, conn: Conn, ids: Sequence[str]) -> None: ...
    def new_run_id(self) -> str: ...
    def insert_runs(self, conn: Conn, rows: Sequence[tuple[str, str, str]]) -> None: ...
    def insert_messages(self, conn: Conn, rows: Sequence[NewMessage]) -> list[str]: ...
    def update_run(self, conn: Conn, run_id: str, column: str, value: Any) -> None: ...
    def update_message(self, conn: Conn, message_id: str, column: str, value: Any) -> None: ...
    def move_run_messages(self, conn: Conn, run_id: str, conversation_id: str) -> None: ...
    def rename_message(self, conn: Conn, message_id: str) -> None: ...
    def bulk_update(self, conn: Conn, conversations: Sequence[str], modulus: int,
                    column: str, value: Any) -> None: ...
    def delete_message(self, conn: Conn, message_id: str) -> None: ...
    def delete_run(self, conn: Conn, run_id: str) -> None: ...
    def add_run(self, conn: Conn, run_id: str, conversation_id: str) -> bool: ...
    def delete_run_row(self, conn: Conn, run_id: str, conversation_id: str) -> None: ...
    def read(self, conn: Conn, conversations: Sequence[str]) -> Raw: ...


_ids = itertools.count(1)


class ReferenceSource:
    """compaction_source: text ids, the contract's column names and vocabulary."""

    def __init__(self) -> None:
        self.prefix = f"d{uuid.uuid4().hex[:6]}"

    def conversation_ids(self, example: int, count: int) -> list[str]:
        return [f"{self.prefix}x{example}c{k}" for k in range(count)]

    def create_conversations(self, conn: Conn, ids: Sequence[str]) -> None:
        conn.execute("INSERT INTO compaction_source.conversations SELECT unnest(%s::text[])",
                     (list(ids),))

    def new_run_id(self) -> str:
        # ids of one length range, so creation order = (length, id) order
        return f"{self.prefix}r{next(_ids)}"

    def insert_runs(self, conn: Conn, rows: Sequence[tuple[str, str, str]]) -> None:
        conn.execute(
            "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
            " SELECT r.id, r.c, r.s, now()"
            " FROM unnest(%s::text[], %s::text[], %s::text[]) AS r (id, c, s)",
            ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))

    def insert_messages(self, conn: Conn, rows: Sequence[NewMessage]) -> list[str]:
        ids = [f"{self.prefix}m{next(_ids)}" for _ in rows]
        conn.execute(
            "INSERT INTO compaction_source.messages"
            " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
            " SELECT m.id, m.c, m.r, m.role, m.s, m.content, m.seq, now()"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[],"
            "             %s::text[], %s::bigint[]) AS m (id, c, r, role, s, content, seq)",
            (ids, [m.conversation_id for m in rows], [m.run_id for m in rows],
             [m.role for m in rows], [m.status for m in rows], [m.content for m in rows],
             [m.seq for m in rows]))
        return ids

    def update_run(self, conn: Conn, run_id: str, column: str, value: Any) -> None:
        assert column in ("status", "conversation_id")
        conn.execute(psycopg.sql.SQL(
            "UPDATE compaction_source.runs SET {} = %s WHERE run_id = %s").format(
                psycopg.sql.Identifier(column)), (value, run_id))

    def update_message(self, conn: Conn, message_id: str, column: str, value: Any) -> None:
        assert column in ("content", "status", "role", "seq", "run_id", "conversation_id")
        conn.execute(psycopg.sql.SQL(
            "UPDATE compaction_source.messages SET {} = %s WHERE message_id = %s").format(
                psycopg.sql.Identifier(column)), (value, message_id))

    def move_run_messages(self, conn: Conn, run_id: str, conversation_id: str) -> None:
        conn.execute("UPDATE compaction_source.messages SET conversation_id = %s"
                     " WHERE run_id = %s", (conversation_id, run_id))

    def rename_message(self, conn: Conn, message_id: str) -> None:
        conn.execute("UPDATE compaction_source.messages SET message_id = %s"
                     " WHERE message_id = %s", (f"{self.prefix}m{next(_ids)}", message_id))

    def bulk_update(self, conn: Conn, conversations: Sequence[str], modulus: int,
                    column: str, value: Any) -> None:
        assert column in ("content", "status")
        conn.execute(psycopg.sql.SQL(
            "UPDATE compaction_source.messages SET {} = %s"
            " WHERE conversation_id = ANY (%s) AND seq %% %s = 0").format(
                psycopg.sql.Identifier(column)), (value, list(conversations), modulus))

    def delete_message(self, conn: Conn, message_id: str) -> None:
        conn.execute("DELETE FROM compaction_source.messages WHERE message_id = %s",
                     (message_id,))

    def delete_run(self, conn: Conn, run_id: str) -> None:
        conn.execute("DELETE FROM compaction_source.messages WHERE run_id = %s", (run_id,))
        conn.execute("DELETE FROM compaction_source.runs WHERE run_id = %s", (run_id,))

    def add_run(self, conn: Conn, run_id: str, conversation_id: str) -> bool:
        """A completed run of this id in this conversation (the key is (conversation,
        run id): an id may repeat across conversations, contract §2)."""
        conn.execute(
            "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
            " VALUES (%s, %s, 'completed', now()) ON CONFLICT DO NOTHING",
            (run_id, conversation_id))
        return True

    def delete_run_row(self, conn: Conn, run_id: str, conversation_id: str) -> None:
        conn.execute("DELETE FROM compaction_source.runs"
                     " WHERE conversation_id = %s AND run_id = %s", (conversation_id, run_id))

    def read(self, conn: Conn, conversations: Sequence[str]) -> Raw:
        return read_reference(conn, conversations)


# The host's vocabulary (docs/integrating.md's worked example). Writing maps the contract's
# words to the host's; reading maps back exactly as the doc's views do (CASE ... ELSE the
# host's own word), written here again rather than read through the views.
HOST_RUN_STATUS = {"completed": "done", "clarify_pending": "needs_clarification",
                   "failed": "error"}
HOST_ROLE = {"user": "human", "assistant": "ai"}
HOST_MESSAGE_STATUS = {"completed": "final"}
VIEW_RUN_STATUS = {"done": "completed", "partial": "partial",
                   "needs_clarification": "clarify_pending"}
VIEW_ROLE = {"human": "user", "ai": "assistant"}
VIEW_MESSAGE_STATUS = {"final": "completed"}
HOST_MESSAGE_COLUMN = {"content": "body", "status": "lifecycle", "role": "author",
                       "seq": "position", "run_id": "turn", "conversation_id": "thread"}


class HostSource:
    """agent.threads/turns/chat_messages: uuid and bigint ids, other names and words."""

    def __init__(self) -> None:
        self.base = uuid.uuid4().int & ~((1 << 64) - 1)

    def _uuid(self, n: int) -> str:
        return str(uuid.UUID(int=self.base | n))

    def conversation_ids(self, example: int, count: int) -> list[str]:
        return [self._uuid((1 << 48) | (example << 8) | k) for k in range(count)]

    def create_conversations(self, conn: Conn, ids: Sequence[str]) -> None:
        conn.execute("INSERT INTO agent.threads (id, title) SELECT unnest(%s::uuid[]), 'prop'",
                     (list(ids),))

    def new_run_id(self) -> str:
        return self._uuid(next(_ids))

    def insert_runs(self, conn: Conn, rows: Sequence[tuple[str, str, str]]) -> None:
        conn.execute(
            "INSERT INTO agent.turns (turn_id, thread_id, state)"
            " SELECT * FROM unnest(%s::uuid[], %s::uuid[], %s::text[])",
            ([r[0] for r in rows], [r[1] for r in rows],
             [HOST_RUN_STATUS.get(r[2], r[2]) for r in rows]))

    def insert_messages(self, conn: Conn, rows: Sequence[NewMessage]) -> list[str]:
        ids = conn.execute(
            "INSERT INTO agent.chat_messages (thread, turn, author, lifecycle, body, position)"
            " SELECT m.thread, m.turn, m.author, m.lifecycle, m.body, m.position"
            " FROM unnest(%s::uuid[], %s::uuid[], %s::text[], %s::text[], %s::text[],"
            "             %s::int[]) WITH ORDINALITY"
            "      AS m (thread, turn, author, lifecycle, body, position, o)"
            " ORDER BY m.o RETURNING id",
            ([m.conversation_id for m in rows], [m.run_id for m in rows],
             [HOST_ROLE.get(m.role, m.role) for m in rows],
             [HOST_MESSAGE_STATUS.get(m.status, m.status) for m in rows],
             [m.content for m in rows], [m.seq for m in rows])).fetchall()
        # identity values follow the ORDER BY of the insert's source
        return [str(i) for (i,) in sorted(ids)]

    def update_run(self, conn: Conn, run_id: str, column: str, value: Any) -> None:
        if column == "status":
            conn.execute("UPDATE agent.turns SET state = %s WHERE turn_id = %s",
                         (HOST_RUN_STATUS.get(value, value), run_id))
        else:
            assert column == "conversation_id"
            conn.execute("UPDATE agent.turns SET thread_id = %s WHERE turn_id = %s",
                         (value, run_id))

    def update_message(self, conn: Conn, message_id: str, column: str, value: Any) -> None:
        if column == "role":
            value = HOST_ROLE.get(value, value)
        elif column == "status":
            value = HOST_MESSAGE_STATUS.get(value, value)
        conn.execute(psycopg.sql.SQL("UPDATE agent.chat_messages SET {} = %s WHERE id = %s")
                     .format(psycopg.sql.Identifier(HOST_MESSAGE_COLUMN[column])),
                     (value, int(message_id)))

    def move_run_messages(self, conn: Conn, run_id: str, conversation_id: str) -> None:
        conn.execute("UPDATE agent.chat_messages SET thread = %s WHERE turn = %s",
                     (conversation_id, run_id))

    def rename_message(self, conn: Conn, message_id: str) -> None:
        # an identity column takes a new value only from its sequence
        conn.execute("UPDATE agent.chat_messages SET id = DEFAULT WHERE id = %s",
                     (int(message_id),))

    def bulk_update(self, conn: Conn, conversations: Sequence[str], modulus: int,
                    column: str, value: Any) -> None:
        if column == "status":
            value = HOST_MESSAGE_STATUS.get(value, value)
        conn.execute(psycopg.sql.SQL(
            "UPDATE agent.chat_messages SET {} = %s"
            " WHERE thread = ANY (%s::uuid[]) AND position %% %s = 0").format(
                psycopg.sql.Identifier(HOST_MESSAGE_COLUMN[column])),
            (value, list(conversations), modulus))

    def delete_message(self, conn: Conn, message_id: str) -> None:
        conn.execute("DELETE FROM agent.chat_messages WHERE id = %s", (int(message_id),))

    def delete_run(self, conn: Conn, run_id: str) -> None:
        conn.execute("DELETE FROM agent.chat_messages WHERE turn = %s", (run_id,))
        conn.execute("DELETE FROM agent.turns WHERE turn_id = %s", (run_id,))

    def add_run(self, conn: Conn, run_id: str, conversation_id: str) -> bool:
        return False  # a turn id is the host's whole key: it never repeats

    def delete_run_row(self, conn: Conn, run_id: str, conversation_id: str) -> None:
        pass  # the host's messages keep their turn by a foreign key

    def read(self, conn: Conn, conversations: Sequence[str]) -> Raw:
        ids = list(conversations)
        runs = conn.execute(
            "SELECT turn_id::text, thread_id::text, state FROM agent.turns"
            " WHERE thread_id = ANY (%s::uuid[]) ORDER BY turn_id", (ids,)).fetchall()
        messages = conn.execute(
            "SELECT id, thread::text, turn::text, author, lifecycle, body, position"
            " FROM agent.chat_messages WHERE thread = ANY (%s::uuid[]) ORDER BY id",
            (ids,)).fetchall()
        return Raw(
            tuple(RawRun(r, c, VIEW_RUN_STATUS.get(s, s)) for r, c, s in runs),
            tuple(RawMessage(str(i), c, r, VIEW_ROLE.get(a, a), VIEW_MESSAGE_STATUS.get(s, s),
                             body, pos)
                  for i, c, r, a, s, body, pos in messages))


def doc_example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```sql\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/integrating.md lost its {name} example"
    return match.group(1)


def attach_host(conn: Conn, *, tracked: bool) -> None:
    """docs/integrating.md's worked example, verbatim and as psql runs it (a statement at
    a time: CREATE INDEX CONCURRENTLY refuses a transaction block): host schema, grants
    and indexes, statistics, re-pointed views, then (tracked) the tracking triggers and
    the rebuild."""
    names = ["host-schema", "grants-and-indexes", "statistics", "repoint"]
    if tracked:
        names += ["tracking", "rebuild"]
    for name in names:
        text = re.sub(r"^\s*--[^\n]*\n", "", doc_example(name), flags=re.M)
        for statement in re.split(r";\s*\n", text):
            if statement.strip():
                conn.execute(statement.encode())


# ---------------------------------------------------------------------------------------
# Writes
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Append:
    """A whole Run at the end: run, user, streaming assistant, then the status updates."""
    conversation: int
    status: str
    user: str
    assistant: str
    one_transaction: bool


@dataclass(frozen=True)
class BulkAppend:
    """Several settled Runs in one INSERT per table."""
    conversation: int
    count: int


@dataclass(frozen=True)
class InsertBefore:
    """A Run whose user message has a lower seq than an existing message (or ties it)."""
    conversation: int
    pick: int
    tie: bool
    status: str
    user: str
    assistant: str


@dataclass(frozen=True)
class SetMessage:
    """Change one column of an existing message (content, status, role, seq)."""
    pick: int
    column: str
    value: Any


@dataclass(frozen=True)
class Reparent:
    """Point a message at another run (or none)."""
    pick: int
    run_pick: int | None


@dataclass(frozen=True)
class RenameMessage:
    """Give a message a new id (its position among tied seqs and its range ids change)."""
    pick: int


@dataclass(frozen=True)
class BulkUpdate:
    """One UPDATE across every conversation of the example (messages with seq % m = 0)."""
    modulus: int
    column: str
    value: Any


@dataclass(frozen=True)
class RunStatus:
    pick: int
    status: str


@dataclass(frozen=True)
class SecondAssistant:
    pick: int
    status: str
    content: str


@dataclass(frozen=True)
class DeleteMessage:
    pick: int


@dataclass(frozen=True)
class DeleteRun:
    pick: int


@dataclass(frozen=True)
class MoveMessage:
    pick: int
    conversation: int


@dataclass(frozen=True)
class MoveRun:
    pick: int
    conversation: int
    with_messages: bool


@dataclass(frozen=True)
class ReuseRun:
    """A run of a picked run's id in another conversation (contract §3: each is its own),
    with its own user and assistant messages or none."""
    pick: int
    conversation: int
    with_messages: bool


@dataclass(frozen=True)
class AdoptForeign:
    """A run created in a message's conversation for the run id it names: a foreign
    message stops being foreign."""
    pick: int


@dataclass(frozen=True)
class DropRunRow:
    """A run deleted under its messages: they become foreign."""
    pick: int


@dataclass(frozen=True)
class Together:
    """Several writes in one transaction; checked after each, then committed or rolled back."""
    writes: tuple[Any, ...]
    rollback: bool


texts = st.one_of(
    st.sampled_from(["", " ", "\t", "\n", "\r\n", "\f", "\v", " \t\n\r\f\v ", "\u00a0",
                     " \u00a0 ", "\u3000", "\u200b", "x", "NAV 10.37", "你好 🎉"]),
    st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
            max_size=6),
)
contents = st.one_of(texts, st.builds(lambda n: f"answer {n}", st.integers(0, 999)))
picks = st.integers(0, 10_000)
conversation_picks = st.integers(0, 2)

single_writes = st.one_of(
    st.builds(Append, conversation_picks, st.sampled_from(RUN_STATUSES), contents, contents,
              st.booleans()),
    st.builds(BulkAppend, conversation_picks, st.integers(1, 12)),
    st.builds(InsertBefore, conversation_picks, picks, st.booleans(),
              st.sampled_from(RUN_STATUSES), contents, contents),
    st.builds(SetMessage, picks, st.just("content"), contents),
    st.builds(SetMessage, picks, st.just("status"), st.sampled_from(MESSAGE_STATUSES)),
    st.builds(SetMessage, picks, st.just("role"), st.sampled_from(ROLES)),
    st.builds(SetMessage, picks, st.just("seq"), st.integers(-40, 600)),
    st.builds(Reparent, picks, st.none() | picks),
    st.builds(RenameMessage, picks),
    st.builds(BulkUpdate, st.integers(2, 7), st.just("content"), contents),
    st.builds(BulkUpdate, st.integers(2, 7), st.just("status"),
              st.sampled_from(MESSAGE_STATUSES)),
    st.builds(RunStatus, picks, st.sampled_from(RUN_STATUSES)),
    st.builds(SecondAssistant, picks, st.sampled_from(MESSAGE_STATUSES), contents),
    st.builds(DeleteMessage, picks),
    st.builds(DeleteRun, picks),
    st.builds(MoveMessage, picks, conversation_picks),
    st.builds(MoveRun, picks, conversation_picks, st.booleans()),
    st.builds(ReuseRun, picks, conversation_picks, st.booleans()),
    st.builds(AdoptForeign, picks),
    st.builds(DropRunRow, picks),
)
writes = st.one_of(
    single_writes,
    st.builds(Together, st.lists(single_writes, min_size=2, max_size=4).map(tuple),
              st.booleans()),
)
initial_sizes = st.one_of(st.sampled_from([0, 9, 10, 29, 30, 31, 39, 40, 45]),
                          st.integers(0, MAX_INITIAL_PAIRS))


class Writer:
    """Applies writes to one example's conversations; picks index the rows in creation order."""

    def __init__(self, conn: Conn, source: Source, conversations: list[str]) -> None:
        self.conn = conn
        self.source = source
        self.conversations = conversations

    def raw(self) -> Raw:
        return self.source.read(self.conn, self.conversations)

    def conversation(self, pick: int) -> str:
        return self.conversations[pick % len(self.conversations)]

    def message(self, pick: int) -> RawMessage | None:
        messages = self.raw().messages
        return messages[pick % len(messages)] if messages else None

    def run(self, pick: int) -> RawRun | None:
        runs = self.raw().runs
        return runs[pick % len(runs)] if runs else None

    def next_seq(self, conversation_id: str) -> int:
        seqs = [m.seq for m in self.raw().messages if m.conversation_id == conversation_id]
        return max(seqs, default=0) + 10

    def settled_runs(self, conversation_id: str, count: int, first_seq: int) -> None:
        """count completed Runs, one INSERT per table (the statement-level bulk path)."""
        runs = [(self.source.new_run_id(), conversation_id, "completed") for _ in range(count)]
        self.source.insert_runs(self.conn, runs)
        self.source.insert_messages(self.conn, [
            NewMessage(conversation_id, run_id, role, "completed", f"{role} {i} {run_id}",
                       first_seq + 10 * i + offset)
            for i, (run_id, _, _) in enumerate(runs)
            for role, offset in (("user", 0), ("assistant", 5))])

    def run_with_messages(self, conversation_id: str, status: str, user: str, assistant: str,
                          seq: int, assistant_seq: int) -> None:
        run_id = self.source.new_run_id()
        self.source.insert_runs(self.conn, [(run_id, conversation_id, "running")])
        self.source.insert_messages(
            self.conn, [NewMessage(conversation_id, run_id, "user", "completed", user, seq)])
        (aid,) = self.source.insert_messages(
            self.conn, [NewMessage(conversation_id, run_id, "assistant", "streaming", assistant,
                                   assistant_seq)])
        self.source.update_message(self.conn, aid, "status", "completed")
        self.source.update_run(self.conn, run_id, "status", status)

    def apply(self, write: Any, check: Any) -> None:
        source, conn = self.source, self.conn
        if isinstance(write, Append):
            cid = self.conversation(write.conversation)
            seq = self.next_seq(cid)
            if write.one_transaction:
                with conn.transaction():
                    self.run_with_messages(cid, write.status, write.user, write.assistant,
                                           seq, seq + 1)
            else:
                self.run_with_messages(cid, write.status, write.user, write.assistant,
                                       seq, seq + 1)
        elif isinstance(write, BulkAppend):
            cid = self.conversation(write.conversation)
            self.settled_runs(cid, write.count, self.next_seq(cid))
        elif isinstance(write, InsertBefore):
            cid = self.conversation(write.conversation)
            others = [m for m in self.raw().messages if m.conversation_id == cid]
            seq = others[write.pick % len(others)].seq if others else 0
            if not write.tie:
                seq -= 1
            self.run_with_messages(cid, write.status, write.user, write.assistant, seq, seq)
        elif isinstance(write, SetMessage):
            if m := self.message(write.pick):
                source.update_message(conn, m.message_id, write.column, write.value)
        elif isinstance(write, Reparent):
            m = self.message(write.pick)
            run = None if write.run_pick is None else self.run(write.run_pick)
            if m:
                source.update_message(conn, m.message_id, "run_id",
                                      None if run is None else run.run_id)
        elif isinstance(write, RenameMessage):
            if m := self.message(write.pick):
                source.rename_message(conn, m.message_id)
        elif isinstance(write, BulkUpdate):
            source.bulk_update(conn, self.conversations, write.modulus, write.column,
                               write.value)
        elif isinstance(write, RunStatus):
            if run := self.run(write.pick):
                source.update_run(conn, run.run_id, "status", write.status)
        elif isinstance(write, SecondAssistant):
            if run := self.run(write.pick):
                seq = max((m.seq for m in self.raw().messages if m.run_id == run.run_id),
                          default=0)
                source.insert_messages(conn, [NewMessage(
                    run.conversation_id, run.run_id, "assistant", write.status, write.content,
                    seq + 1)])
        elif isinstance(write, DeleteMessage):
            if m := self.message(write.pick):
                source.delete_message(conn, m.message_id)
        elif isinstance(write, DeleteRun):
            if run := self.run(write.pick):
                with conn.transaction():
                    source.delete_run(conn, run.run_id)
        elif isinstance(write, MoveMessage):
            if m := self.message(write.pick):
                source.update_message(conn, m.message_id, "conversation_id",
                                      self.conversation(write.conversation))
        elif isinstance(write, MoveRun):
            # The sources address a run by its id alone: a reused id (ReuseRun) is rows in
            # two conversations, which one UPDATE would move into one (a key violation,
            # the source refusing the write, not what the test is about). Move only ids
            # that are one row.
            run = self.run(write.pick)
            if run and sum(r.run_id == run.run_id for r in self.raw().runs) == 1:
                target = self.conversation(write.conversation)
                with conn.transaction():
                    source.update_run(conn, run.run_id, "conversation_id", target)
                    if write.with_messages:
                        source.move_run_messages(conn, run.run_id, target)
        elif isinstance(write, ReuseRun):
            if run := self.run(write.pick):
                target = self.conversation(write.conversation)
                if source.add_run(conn, run.run_id, target) and write.with_messages:
                    seq = self.next_seq(target)
                    source.insert_messages(conn, [
                        NewMessage(target, run.run_id, "user", "completed", "again", seq),
                        NewMessage(target, run.run_id, "assistant", "completed", "reused",
                                   seq + 1)])
        elif isinstance(write, AdoptForeign):
            raw = self.raw()
            held = {(r.conversation_id, r.run_id) for r in raw.runs}
            if (m := self.message(write.pick)) and m.run_id is not None \
                    and (m.conversation_id, m.run_id) not in held:
                source.add_run(conn, m.run_id, m.conversation_id)
        elif isinstance(write, DropRunRow):
            if run := self.run(write.pick):
                source.delete_run_row(conn, run.run_id, run.conversation_id)
        elif isinstance(write, Together):
            before = self.raw()
            try:
                with conn.transaction(force_rollback=write.rollback):
                    for inner in write.writes:
                        self.apply(inner, check)
                        check()  # inside the transaction: the derived state reads its writes
            finally:
                if write.rollback:
                    assert self.raw() == before
        else:  # pragma: no cover - the strategies build nothing else
            raise AssertionError(write)


# ---------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------

def make_source(conn: Conn, kind: str) -> Source:
    """The reference tables and the documented host schema read the derived state; the
    host schema without tracking triggers is judged from the views on each call."""
    assert_c_collation(conn)
    # every check claims; the attempts stay running, so admission must not refuse
    conn.execute("UPDATE compaction.settings SET max_running = 10000")
    if kind == "reference":
        source: Source = ReferenceSource()
    else:
        attach_host(conn, tracked=kind == "host")
        source = HostSource()
    assert derived_state_in_use(conn) == (kind != "host-untracked")
    return source


@pytest.fixture(params=["reference", "host"])
def tracked_source(request: pytest.FixtureRequest, conn: Conn) -> Iterator[Source]:
    yield make_source(conn, request.param)
    assert derived_state_in_use(conn)


@pytest.fixture
def untracked_source(conn: Conn) -> Iterator[Source]:
    yield make_source(conn, "host-untracked")
    assert not derived_state_in_use(conn)


def claim_reason(conn: Conn, conversation_id: str, from_pair: int, ids: list[str],
                 digest: str) -> str:
    row = conn.execute(
        "SELECT reason FROM compaction.claim(%s, 'default', %s, %s, %s, 'test-model',"
        " 'conversation-compaction@3', 'prop')",
        (conversation_id, from_pair, ids, digest)).fetchone()
    assert row is not None
    return str(row[0])


def assert_claims_follow_the_source(conn: Conn, conversation_id: str,
                                    pairs: list[PairRow]) -> None:
    """claim compares with the current source: the first target's recomputed ids and hash
    are claimable (or already running from an earlier check), another hash is a
    source_mismatch, and a complete range among the newest 20 pairs is not_eligible."""
    targets = targets_of(pairs)
    if targets:
        start, _, ids, digest = targets[0]
        assert claim_reason(conn, conversation_id, start, ids, digest) in (
            "claimed", "already_running")
        assert claim_reason(conn, conversation_id, start, ids, "f" * 64) == "source_mismatch"
    newest = ranges_of(pairs)
    if newest:
        start = max(newest)
        if start + 30 > len(pairs):
            assert claim_reason(conn, conversation_id, start, *newest[start]) == "not_eligible"


_examples = itertools.count()
PROPERTY = settings(deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])
SIZES = st.lists(initial_sizes, min_size=2, max_size=3)
HISTORIES = st.lists(writes, min_size=1, max_size=12)


@settings(PROPERTY, max_examples=EXAMPLES or 30)
@given(sizes=SIZES, history=HISTORIES)
def test_derived_state_equals_recomputation_after_every_write(
    conn: Conn, tracked_source: Source, sizes: list[int], history: list[Any]
) -> None:
    run_history(conn, tracked_source, sizes, history)


@settings(PROPERTY, max_examples=EXAMPLES or 12)
@given(sizes=SIZES, history=HISTORIES)
def test_untracked_host_source_is_judged_exactly_from_the_views(
    conn: Conn, untracked_source: Source, sizes: list[int], history: list[Any]
) -> None:
    run_history(conn, untracked_source, sizes, history)


# ---------------------------------------------------------------------------------------
# Summary verdicts, recomputed independently
# ---------------------------------------------------------------------------------------

PROJECTABLE = {"conversation-compaction@1": False, "conversation-compaction@2": True,
               "conversation-compaction@3": True}
SummaryRow = tuple[int, str, int, list[str], str, str, Any]


def seed_summaries(conn: Conn, raw: Raw, conversations: Sequence[str]) -> None:
    """Summaries of every complete range as the history stands: @3, and for every other
    range an @2 (superseded by the @3), an @1 (never projectable) and an @3 of another
    scope; the first range also gets an @3 with a wrong hash (stale from the start). The
    writes that follow make some stale and, by moving pairs back, some current again."""
    for cid in conversations:
        for start, (ids, digest) in sorted(ranges_of(pairs_of(raw, cid)).items()):
            variants = [("default", "conversation-compaction@3", digest)]
            if start % 20 == 0:
                variants += [("default", "conversation-compaction@2", digest),
                             ("default", "conversation-compaction@1", digest),
                             ("other", "conversation-compaction@3", digest)]
            if start == 0:
                variants.append(("default", "conversation-compaction@3", "e" * 64))
            for scope, version, hash_ in variants:
                conn.execute(
                    "SELECT compaction.import_summary(%s, %s, %s, %s, %s, 'prop-model', %s,"
                    " 'a summary', '2026-11-01T00:00:00Z')",
                    (cid, scope, start, ids, hash_, version))


def expected_verdicts(pairs: Sequence[PairRow], summaries: Sequence[SummaryRow]
                      ) -> dict[int, tuple[str, int, str | None]]:
    """summary_id -> (scope, from_pair, reason), from the recomputed ranges (contract §9:
    version_not_projectable, stale_source, superseded; None for the one used)."""
    ranges = ranges_of(pairs)
    out: dict[int, tuple[str, int, str | None]] = {}
    valid: dict[tuple[str, int], list[SummaryRow]] = {}
    for row in summaries:
        summary_id, scope, from_pair, ids, digest, version, _ = row
        if not PROJECTABLE[version]:
            out[summary_id] = (scope, from_pair, "version_not_projectable")
        elif ranges.get(from_pair) != (list(ids), digest):
            out[summary_id] = (scope, from_pair, "stale_source")
        else:
            valid.setdefault((scope, from_pair), []).append(row)
    for (scope, from_pair), rows in valid.items():
        rows.sort(key=lambda r: (int(r[5].rsplit("@", 1)[1]), r[6], r[0]), reverse=True)
        out[rows[0][0]] = (scope, from_pair, None)
        for other in rows[1:]:
            out[other[0]] = (scope, from_pair, "superseded")
    return out


def assert_verdicts(conn: Conn, raw: Raw, conversations: Sequence[str], tracked: bool) -> None:
    """The stored verdicts (tracked: from the conversation's own rows) and a projection's
    reasons equal the recomputation."""
    for cid in conversations:
        summaries: list[SummaryRow] = conn.execute(
            "SELECT summary_id, scope, from_pair, source_message_ids, source_hash,"
            " prompt_version, completed_at FROM compaction.summaries"
            " WHERE conversation_id = %s", (cid,)).fetchall()
        expected = expected_verdicts(pairs_of(raw, cid), summaries)
        if tracked:
            # Kept against the ranges the conversation's own rows make (a
            # foreign message's effect is applied by the reads, which then judge from
            # the views).
            stored = {r[0]: (r[1], r[2], r[3]) for r in conn.execute(
                "SELECT summary_id, scope, from_pair, reason FROM compaction.summary_verdicts"
                " WHERE conversation_id = %s", (cid,))}
            assert stored == expected_verdicts(pairs_of(raw, cid, foreign=False),
                                               summaries), f"summary_verdicts({cid!r})"
        projection = project_history(conn, cid, budget_bytes=10_000_000)
        assert sorted((r.summary_id, r.reason) for r in projection.rejected_summaries) == sorted(
            (sid, reason) for sid, (scope, _, reason) in expected.items()
            if scope == "default" and reason is not None), f"project_history({cid!r})"


def run_history(conn: Conn, source: Source, sizes: list[int], history: list[Any]) -> None:
    """Initial history, then each write, checking everything after each."""
    conversations = source.conversation_ids(next(_examples), len(sizes))
    writer = Writer(conn, source, conversations)
    tracked = derived_state_in_use(conn)

    def check() -> None:
        assert derived_state_in_use(conn) == tracked
        raw = writer.raw()
        assert_matches(conn, raw, conversations, verified=tracked)
        assert_verdicts(conn, raw, conversations, tracked)
        for c in conversations:
            assert_claims_follow_the_source(conn, c, pairs_of(raw, c))
        most = max(len(pairs_of(raw, c)) for c in conversations)
        event("a conversation with targets" if most >= 30 else "no targets")

    # Every conversation's initial history in one statement per table (several
    # conversations in one statement).
    with conn.transaction():
        source.create_conversations(conn, conversations)
        runs: list[tuple[str, str, str]] = []
        messages: list[NewMessage] = []
        for cid, size in zip(conversations, sizes, strict=True):
            for i in range(size):
                run_id = source.new_run_id()
                runs.append((run_id, cid, "completed"))
                messages += [NewMessage(cid, run_id, "user", "completed", f"q{i}", 10 * i + 10),
                             NewMessage(cid, run_id, "assistant", "completed", f"a{i}",
                                        10 * i + 15)]
        if runs:
            source.insert_runs(conn, runs)
            source.insert_messages(conn, messages)
    seed_summaries(conn, writer.raw(), conversations)
    check()
    for write in history:
        event(type(write).__name__)
        writer.apply(write, check)
        check()
