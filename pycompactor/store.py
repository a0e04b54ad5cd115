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


@dataclass(frozen=True, slots=True)
class RunRow:
    """One reference run as written."""

    run_id: str
    status: str


def insert_history(conn: Connection, conversation_id: str, runs: Sequence[RunRow],
                   messages: Sequence[MessageRow], *, batch_size: int = 1000) -> tuple[int, int]:
    """Write one conversation's runs and messages (`pycompactor import`), `batch_size`
    rows a statement, skipping every row whose id is already there (a re-import writes
    nothing twice); (runs written, messages written). The caller's transaction makes
    the conversation whole or absent."""
    ensure_conversation(conn, conversation_id)
    written_runs = written_messages = 0
    with conn.cursor() as cur:
        for start in range(0, len(runs), batch_size):
            batch = runs[start : start + batch_size]
            cur.execute(
                "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
                " SELECT u.run_id, %(c)s, u.status, now()"
                " FROM unnest(%(runs)s::text[], %(statuses)s::text[]) AS u (run_id, status)"
                " ON CONFLICT (conversation_id, run_id) DO NOTHING",
                {"c": conversation_id, "runs": [r.run_id for r in batch],
                 "statuses": [r.status for r in batch]})
            written_runs += max(cur.rowcount, 0)
        for start in range(0, len(messages), batch_size):
            rows = messages[start : start + batch_size]
            cur.execute(
                "INSERT INTO compaction_source.messages"
                " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
                " SELECT u.message_id, %(c)s, u.run_id, u.role, u.status, u.content, u.seq, now()"
                " FROM unnest(%(ids)s::text[], %(runs)s::text[], %(roles)s::text[],"
                " %(statuses)s::text[], %(contents)s::text[], %(seqs)s::bigint[])"
                " AS u (message_id, run_id, role, status, content, seq)"
                " ON CONFLICT (conversation_id, message_id) DO NOTHING",
                {"c": conversation_id, "ids": [m.message_id for m in rows],
                 "runs": [m.run_id for m in rows], "roles": [m.role for m in rows],
                 "statuses": [m.status for m in rows], "contents": [m.content for m in rows],
                 "seqs": [m.seq for m in rows]})
            written_messages += max(cur.rowcount, 0)
    return written_runs, written_messages


#: The reference tables, analyzed after an import so the planner knows their size (a
#: bulk load leaves them without statistics until autovacuum comes by; check-source
#: reports that).
REFERENCE_TABLES = ("compaction_source.conversations", "compaction_source.runs",
                    "compaction_source.messages")


def analyze_reference_tables(conn: Connection) -> None:
    conn.execute("ANALYZE compaction_source.conversations, compaction_source.runs,"
                 " compaction_source.messages")
