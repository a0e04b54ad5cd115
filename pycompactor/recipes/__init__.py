"""Shipped source recipes: re-pointing the source views at well-known agent tables.

A recipe owns the SQL that maps one existing storage layout onto the source contract
(contract §2): the two views, the indexes the engine's lookups through them need, and the
change-tracking triggers. Each is one SQL file next to this module, formatted here with
the host's schema and table names (identifiers only, through `psycopg.sql`) and run step
by step (each step starts at a `-- step:` line) so that no step holds the application's
writes for more than a few tens of milliseconds: its functions; its indexes, each built
CONCURRENTLY on its own, then ANALYZE; its views in one transaction; the tracking
triggers in another. Then the derived state is rebuilt (in batches of their own
transactions, resumable).

* `agents-sqlalchemy`: the OpenAI Agents SDK's `SQLAlchemySession` tables
  (`agent_sessions`, `agent_messages`), `install_agents_sqlalchemy`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg import sql

from pycompactor.errors import UsageError, wrap_exceptions

_HERE: Final = Path(__file__).resolve().parent

#: The recipes `pycompactor install-recipe NAME` knows.
RECIPES: Final = ("agents-sqlalchemy",)


@dataclass(frozen=True, slots=True)
class RecipeResult:
    """What an installation did: the table the views now read, and whether the derived
    state was rebuilt (False when asked not to; the engine then judges from the views)."""

    recipe: str
    messages_table: str
    rebuilt: bool


def _agents_sqlalchemy_names(schema: str, sessions_table: str,
                             messages_table: str) -> dict[str, sql.Composable]:
    prefix = f"pycompactor_{messages_table}"
    return {
        "schema": sql.Identifier(schema),
        "sessions": sql.Identifier(schema, sessions_table),
        "messages": sql.Identifier(schema, messages_table),
        "messages_literal": sql.Literal(sql.Identifier(schema, messages_table).as_string(None)),
        "role_fn": sql.Identifier(schema, f"{prefix}_role"),
        "parts_fn": sql.Identifier(schema, f"{prefix}_parts"),
        "content_fn": sql.Identifier(schema, f"{prefix}_content"),
        "runs_view": sql.Identifier(schema, f"{prefix}_runs"),
        "role_idx": sql.Identifier(f"{prefix}_role_idx"),
        "session_idx": sql.Identifier(f"{prefix}_session_id_idx"),
        "id_idx": sql.Identifier(f"{prefix}_id_text_idx"),
        "seq_idx": sql.Identifier(f"{prefix}_seq_idx"),
    }


def _template() -> str:
    return (_HERE / "agents_sqlalchemy.sql").read_text(encoding="utf-8")


def agents_sqlalchemy_sql(*, schema: str = "public", sessions_table: str = "agent_sessions",
                          messages_table: str = "agent_messages") -> sql.Composed:
    """The recipe's SQL for these names, whole (install_agents_sqlalchemy runs it step by
    step: its CREATE INDEX CONCURRENTLY statements refuse a transaction block)."""
    return sql.SQL(_template()).format(
        **_agents_sqlalchemy_names(schema, sessions_table, messages_table))


def agents_sqlalchemy_steps(*, schema: str = "public", sessions_table: str = "agent_sessions",
                            messages_table: str = "agent_messages",
                            ) -> list[tuple[str, list[sql.Composed]]]:
    """The recipe's steps for these names, in order: (name, statements). The `indexes`
    step runs statement by statement outside a transaction block; any other step is one
    transaction."""
    names = _agents_sqlalchemy_names(schema, sessions_table, messages_table)
    steps: list[tuple[str, list[sql.Composed]]] = []
    for number, part in enumerate(re.split(r"^-- step: ", _template(), flags=re.M)):
        name = "functions" if number == 0 else part.split(".", 1)[0]
        part = part if number == 0 else "-- step: " + part
        if name == "indexes":
            # No statement of this step holds a semicolon inside it.
            texts = [t for t in re.split(r";\s*\n", part)
                     if re.sub(r"^\s*--[^\n]*$", "", t, flags=re.M).strip()]
        else:
            texts = [part]
        steps.append((name, [sql.SQL(t).format(**names) for t in texts]))
    return steps


def install_agents_sqlalchemy(conn: psycopg.Connection[Any], *, schema: str = "public",
                              sessions_table: str = "agent_sessions",
                              messages_table: str = "agent_messages",
                              rebuild: bool = True) -> RecipeResult:
    """Point the source views at the Agents SDK's SQLAlchemySession tables.

    Creates three IMMUTABLE helper functions, a helper view of the runs and four indexes on
    the messages table (in `schema`, named `pycompactor_<messages_table>_*`), grants the
    engine's owner role read access, re-points `compaction.source_runs` /
    `compaction.source_messages`, and attaches the change-tracking triggers to the
    messages table (by message id); then (`rebuild`) derives the existing history once.
    Idempotent. Run it as a superuser, or as the tables' owner being a member of
    `compaction_owner` (docs/agents.md). `conn` must be in autocommit
    mode with no transaction open: the rebuild commits in batches.
    """
    with wrap_exceptions():
        if not conn.autocommit:
            raise UsageError("install_agents_sqlalchemy needs an autocommit connection")
        row = conn.execute(
            "SELECT pg_catalog.to_regclass(%s), pg_catalog.to_regclass(%s)",
            (sql.Identifier(schema, sessions_table).as_string(conn),
             sql.Identifier(schema, messages_table).as_string(conn))).fetchone()
        if row is None or row[1] is None:
            raise UsageError(f"no table {schema}.{messages_table}: create the SDK's tables"
                             " first (SQLAlchemySession(..., create_tables=True) or your"
                             " migrations)")
        if row[0] is None:
            raise UsageError(f"no table {schema}.{sessions_table}")
        for name, statements in agents_sqlalchemy_steps(
                schema=schema, sessions_table=sessions_table, messages_table=messages_table):
            if name == "indexes":
                _drop_invalid_indexes(conn, schema, messages_table)
                with _serial_builds(conn):
                    for statement in statements:
                        conn.execute(statement)  # autocommit: each its own transaction
                continue
            with conn.transaction():
                for statement in statements:
                    conn.execute(statement)
        rebuilt = False
        if rebuild:
            conn.execute("CALL compaction.rebuild_derived_state()")
            rebuilt = True
    return RecipeResult("agents-sqlalchemy", f"{schema}.{messages_table}", rebuilt)


@contextmanager
def _serial_builds(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """The index builds without parallel workers, which would take the cores the
    application runs on (`make bench-scale`, docs/operations.md: its p50 during the builds
    2.7-4.4 ms with two workers, 1.5-2.0 ms without); then the connection's own setting
    again, since it is the caller's."""
    row = conn.execute(
        "SELECT pg_catalog.current_setting('max_parallel_maintenance_workers')").fetchone()
    assert row is not None
    conn.execute("SELECT pg_catalog.set_config('max_parallel_maintenance_workers', '0', false)")
    try:
        yield
    finally:
        conn.execute("SELECT pg_catalog.set_config('max_parallel_maintenance_workers', %s,"
                     " false)", (row[0],))


def _drop_invalid_indexes(conn: psycopg.Connection[Any], schema: str,
                          messages_table: str) -> None:
    """A CREATE INDEX CONCURRENTLY that failed or was cancelled leaves an INVALID index of
    its name, which IF NOT EXISTS would keep: drop the recipe's (concurrently too) first."""
    for suffix in ("role_idx", "session_id_idx", "id_text_idx", "seq_idx"):
        index = sql.Identifier(schema, f"pycompactor_{messages_table}_{suffix}")
        row = conn.execute(
            "SELECT NOT i.indisvalid FROM pg_catalog.pg_index AS i"
            " WHERE i.indexrelid = pg_catalog.to_regclass(%s)",
            (index.as_string(conn),)).fetchone()
        if row is not None and row[0]:
            conn.execute(sql.SQL("DROP INDEX CONCURRENTLY {}").format(index))
