"""Shipped source recipes: re-pointing the source views at well-known agent tables.

A recipe owns the SQL that maps one existing storage layout onto the source contract
(DESIGN §2): the two views, the indexes the engine's lookups through them need, and the
change-tracking triggers. Each is one SQL file next to this module, formatted here with
the host's schema and table names (identifiers only, through `psycopg.sql`) and run in
one transaction; then the derived state is rebuilt (in batches of its own transactions).

* `agents-sqlalchemy`: the OpenAI Agents SDK's `SQLAlchemySession` tables
  (`agent_sessions`, `agent_messages`), `install_agents_sqlalchemy`.
"""

from __future__ import annotations

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


def agents_sqlalchemy_sql(*, schema: str = "public", sessions_table: str = "agent_sessions",
                          messages_table: str = "agent_messages") -> sql.Composed:
    """The recipe's SQL for these names (what `install_agents_sqlalchemy` runs)."""
    template = (_HERE / "agents_sqlalchemy.sql").read_text(encoding="utf-8")
    prefix = f"pycompactor_{messages_table}"
    return sql.SQL(template).format(
        schema=sql.Identifier(schema),
        sessions=sql.Identifier(schema, sessions_table),
        messages=sql.Identifier(schema, messages_table),
        messages_literal=sql.Literal(
            sql.Identifier(schema, messages_table).as_string(None)),
        role_fn=sql.Identifier(schema, f"{prefix}_role"),
        content_fn=sql.Identifier(schema, f"{prefix}_content"),
        runs_view=sql.Identifier(schema, f"{prefix}_runs"),
        role_idx=sql.Identifier(f"{prefix}_role_idx"),
        session_idx=sql.Identifier(f"{prefix}_session_id_idx"),
        id_idx=sql.Identifier(f"{prefix}_id_text_idx"),
    )


def install_agents_sqlalchemy(conn: psycopg.Connection[Any], *, schema: str = "public",
                              sessions_table: str = "agent_sessions",
                              messages_table: str = "agent_messages",
                              rebuild: bool = True) -> RecipeResult:
    """Point the source views at the Agents SDK's SQLAlchemySession tables.

    Creates two IMMUTABLE helper functions, a helper view of the runs and three indexes on
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
        with conn.transaction():
            conn.execute(agents_sqlalchemy_sql(schema=schema, sessions_table=sessions_table,
                                               messages_table=messages_table))
        rebuilt = False
        if rebuild:
            conn.execute("CALL compaction.rebuild_derived_state()")
            rebuilt = True
    return RecipeResult("agents-sqlalchemy", f"{schema}.{messages_table}", rebuilt)


__all__ = ["RECIPES", "RecipeResult", "agents_sqlalchemy_sql", "install_agents_sqlalchemy"]
