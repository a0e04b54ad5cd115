"""Connections and one typed method per stored function (results as frozen dataclasses).

SQL text for the engine's interface lives here and in sql/; nothing else in the package
builds SQL. Every call is a single statement, so these work through PgBouncer in
transaction pooling mode.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from psycopg.rows import class_row

from pycompactor.errors import wrap_exceptions
from pycompactor.models import Pair, RunVerdict, Target

Connection = psycopg.Connection[Any]


def resolve_dsn(dsn: str | None) -> str:
    """--dsn, else PYCOMPACTOR_DSN, else "" (libpq then reads PGHOST, PGDATABASE, ...)."""
    return dsn if dsn is not None else os.environ.get("PYCOMPACTOR_DSN", "")


def connect(dsn: str | None = None, *, autocommit: bool = True) -> Connection:
    """Open a connection; autocommit by default, as each engine call is one statement."""
    with wrap_exceptions():
        return psycopg.connect(
            resolve_dsn(dsn), autocommit=autocommit, application_name="pycompactor"
        )


def eligible_pairs(conn: Connection, conversation_id: str) -> list[Pair]:
    with wrap_exceptions(), conn.cursor(row_factory=class_row(Pair)) as cur:
        cur.execute(
            "SELECT pair_index, run_id, user_message_id, user_content,"
            " assistant_message_id, assistant_content"
            " FROM compaction.eligible_pairs(%(conversation_id)s::text)",
            {"conversation_id": conversation_id},
        )
        return cur.fetchall()


def plan_targets(conn: Connection, conversation_id: str) -> list[Target]:
    with wrap_exceptions(), conn.cursor(row_factory=class_row(Target)) as cur:
        cur.execute(
            "SELECT from_pair, to_pair, source_message_ids, source_hash"
            " FROM compaction.plan_targets(%(conversation_id)s::text)",
            {"conversation_id": conversation_id},
        )
        return cur.fetchall()


def source_hash(conn: Connection, conversation_id: str, from_pair: int) -> str | None:
    """The SQL twin of pycompactor.source_hash, for a range of a stored conversation."""
    with wrap_exceptions(), conn.cursor() as cur:
        cur.execute(
            "SELECT compaction.source_hash(%(conversation_id)s::text, %(from_pair)s::int)",
            {"conversation_id": conversation_id, "from_pair": from_pair},
        )
        row = cur.fetchone()
        return None if row is None else row[0]


def explain_runs(conn: Connection, conversation_id: str) -> list[RunVerdict]:
    with wrap_exceptions(), conn.cursor(row_factory=class_row(RunVerdict)) as cur:
        cur.execute(
            "SELECT run_id, run_status, eligible, reason"
            " FROM compaction.explain_runs(%(conversation_id)s::text)",
            {"conversation_id": conversation_id},
        )
        return cur.fetchall()
