"""Builders for source history in the reference tables (compaction_source)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg

from pycompactor.hashing import PairLike
from pycompactor.projection import message_cost

_ids = itertools.count()


@dataclass(frozen=True)
class SeededPair:
    run_id: str
    user_message_id: str
    assistant_message_id: str
    user_content: str
    assistant_content: str


def raw_cost(pairs: Iterable[PairLike]) -> int:
    """What the pairs cost in a projection as raw pairs (contract §9: UTF-8 bytes + 16 per
    message), the budget that takes exactly them."""
    return sum(message_cost(p.user_content) + message_cost(p.assistant_content) for p in pairs)


class History:
    """Writes conversations, runs and messages with increasing seq per conversation.

    With enqueue_writes (set by tests/citus, where the reference tables' queue triggers
    are detached), every write also calls compaction.enqueue, as a host does.
    """

    enqueue_writes = False

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._seq: dict[str, int] = defaultdict(int)

    def next_seq(self, conversation_id: str) -> int:
        self._seq[conversation_id] += 1
        return self._seq[conversation_id]

    def conversation(self, conversation_id: str) -> str:
        self.conn.execute(
            "INSERT INTO compaction_source.conversations VALUES (%s) ON CONFLICT DO NOTHING",
            (conversation_id,),
        )
        return conversation_id

    def run(self, conversation_id: str, status: str = "completed",
            run_id: str | None = None) -> str:
        self.conversation(conversation_id)
        run_id = run_id or f"{conversation_id}:r{next(_ids)}"
        self.conn.execute(
            "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
            " VALUES (%s, %s, %s, now())",
            (run_id, conversation_id, status),
        )
        self._enqueue(conversation_id)
        return run_id

    def _enqueue(self, conversation_id: str) -> None:
        if self.enqueue_writes:
            self.conn.execute("SELECT compaction.enqueue(%s)", (conversation_id,))

    def message(self, conversation_id: str, run_id: str | None, role: str, content: str,
                status: str = "completed", message_id: str | None = None,
                seq: int | None = None) -> str:
        message_id = message_id or f"{conversation_id}:m{next(_ids)}"
        self.conn.execute(
            "INSERT INTO compaction_source.messages"
            " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, now())",
            (message_id, conversation_id, run_id, role, status, content,
             seq if seq is not None else self.next_seq(conversation_id)),
        )
        self._enqueue(conversation_id)
        return message_id

    def pair(self, conversation_id: str, user: str | None = None, assistant: str | None = None,
             run_status: str = "completed", assistant_status: str = "completed") -> SeededPair:
        run_id = self.run(conversation_id, run_status)
        user = user if user is not None else f"question for {run_id}"
        assistant = assistant if assistant is not None else f"answer for {run_id}"
        uid = self.message(conversation_id, run_id, "user", user)
        aid = self.message(conversation_id, run_id, "assistant", assistant,
                           status=assistant_status)
        return SeededPair(run_id, uid, aid, user, assistant)

    def pairs(self, conversation_id: str, n: int, text: str = "") -> list[SeededPair]:
        """n pairs in bulk (COPY), for large conversations."""
        self.conversation(conversation_id)
        seeded = []
        runs: list[tuple[str, str, str]] = []
        messages: list[tuple[str, str, str, str, str, str, int]] = []
        for _ in range(n):
            k = next(_ids)
            run_id = f"{conversation_id}:r{k}"
            uid, aid = f"{conversation_id}:u{k}", f"{conversation_id}:a{k}"
            user, assistant = f"question {k} {text}", f"answer {k} {text}"
            runs.append((run_id, conversation_id, "completed"))
            messages.append((uid, conversation_id, run_id, "user", "completed", user,
                             self.next_seq(conversation_id)))
            messages.append((aid, conversation_id, run_id, "assistant", "completed", assistant,
                             self.next_seq(conversation_id)))
            seeded.append(SeededPair(run_id, uid, aid, user, assistant))
        with self.conn.cursor() as cur:
            with cur.copy("COPY compaction_source.runs (run_id, conversation_id, status)"
                          " FROM STDIN") as copy:
                for run in runs:
                    copy.write_row(run)
            with cur.copy("COPY compaction_source.messages (message_id, conversation_id, run_id,"
                          " role, status, content, seq) FROM STDIN") as copy:
                for message in messages:
                    copy.write_row(message)
        self._enqueue(conversation_id)
        return seeded
