"""Writes to the reference history tables (schema `compaction_source`).

The engine never writes history; the package's own writers do, and only here: the
sample the demo loads, the demo's edit of an old message, and the Agents SDK session
(`PycompactorSession`). Each statement is a typed function that runs on the caller's
connection, inside the caller's transaction; engine calls live in `db`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row

Connection = psycopg.Connection[Any]


@dataclass(frozen=True, slots=True)
class MessageRow:
    """One reference message as written: seq orders it within its conversation."""

    message_id: str
    conversation_id: str
    run_id: str | None
    role: str
    status: str
    content: str
    seq: int


@dataclass(frozen=True, slots=True)
class LastMessage:
    """A conversation's newest message with its run's status (NULL without a run)."""

    message_id: str
    seq: int
    run_id: str | None
    role: str
    content: str
    run_status: str | None


def ensure_conversation(conn: Connection, conversation_id: str) -> None:
    conn.execute(
        "INSERT INTO compaction_source.conversations (conversation_id) VALUES (%(c)s)"
        " ON CONFLICT (conversation_id) DO NOTHING", {"c": conversation_id})


def lock_conversation(conn: Connection, conversation_id: str) -> bool:
    """Lock the conversation row to commit (writers of one session serialise, so seq
    stays dense); False when there is no such conversation."""
    return conn.execute(
        "SELECT 1 FROM compaction_source.conversations WHERE conversation_id = %(c)s"
        " FOR UPDATE", {"c": conversation_id}).fetchone() is not None


def last_message(conn: Connection, conversation_id: str) -> LastMessage | None:
    with conn.cursor(row_factory=class_row(LastMessage)) as cur:
        return cur.execute(
            "SELECT m.message_id, m.seq, m.run_id, m.role, m.content, r.status AS run_status"
            " FROM compaction_source.messages AS m"
            " LEFT JOIN compaction_source.runs AS r ON r.run_id = m.run_id"
            " WHERE m.conversation_id = %(c)s ORDER BY m.seq DESC LIMIT 1",
            {"c": conversation_id}).fetchone()


def insert_run(conn: Connection, run_id: str, conversation_id: str, status: str) -> None:
    conn.execute(
        "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
        " VALUES (%(run)s, %(c)s, %(status)s, now())",
        {"run": run_id, "c": conversation_id, "status": status})


def set_run_status(conn: Connection, run_id: str, status: str) -> None:
    """Only a real change is written (no trigger work for a status that stays)."""
    conn.execute(
        "UPDATE compaction_source.runs SET status = %(status)s"
        " WHERE run_id = %(run)s AND status IS DISTINCT FROM %(status)s",
        {"run": run_id, "status": status})


def insert_messages(conn: Connection, messages: Sequence[MessageRow]) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO compaction_source.messages"
            " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
            " VALUES (%(message_id)s, %(conversation_id)s, %(run_id)s, %(role)s, %(status)s,"
            " %(content)s, %(seq)s, now())",
            [{"message_id": m.message_id, "conversation_id": m.conversation_id,
              "run_id": m.run_id, "role": m.role, "status": m.status, "content": m.content,
              "seq": m.seq} for m in messages])


def set_role(conn: Connection, run_id: str, *, from_role: str, to_role: str,
             newest_only: bool = False) -> None:
    """Re-role a run's messages (all of them, or only its newest one of `from_role`)."""
    if newest_only:
        conn.execute(
            "UPDATE compaction_source.messages SET role = %(to)s WHERE message_id = ("
            " SELECT message_id FROM compaction_source.messages"
            " WHERE run_id = %(run)s AND role = %(from)s ORDER BY seq DESC LIMIT 1)",
            {"run": run_id, "from": from_role, "to": to_role})
    else:
        conn.execute(
            "UPDATE compaction_source.messages SET role = %(to)s"
            " WHERE run_id = %(run)s AND role = %(from)s",
            {"run": run_id, "from": from_role, "to": to_role})


def edit_message(conn: Connection, message_id: str, content: str) -> None:
    conn.execute("UPDATE compaction_source.messages SET content = %(content)s"
                 " WHERE message_id = %(id)s", {"id": message_id, "content": content})


def delete_message(conn: Connection, message_id: str) -> None:
    conn.execute("DELETE FROM compaction_source.messages WHERE message_id = %(id)s",
                 {"id": message_id})


def delete_run_if_empty(conn: Connection, run_id: str) -> None:
    conn.execute(
        "DELETE FROM compaction_source.runs AS r WHERE r.run_id = %(run)s AND NOT EXISTS ("
        " SELECT 1 FROM compaction_source.messages AS m WHERE m.run_id = r.run_id)",
        {"run": run_id})


def delete_conversation(conn: Connection, conversation_id: str) -> None:
    """The conversation's messages, runs and row (the engine's rows are erased apart:
    compaction.erase_conversation)."""
    for table in ("messages", "runs", "conversations"):
        conn.execute(psycopg.sql.SQL(
            "DELETE FROM compaction_source.{} WHERE conversation_id = %(c)s").format(
                psycopg.sql.Identifier(table)), {"c": conversation_id})
