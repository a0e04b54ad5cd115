"""A Session for the OpenAI Agents SDK that keeps the SDK's own storage and projects reads.

This module owns `ProjectingSession`: a wrapper around any SDK `Session` (the SDK's
`SQLAlchemySession` first) for an agent that keeps its history where the SDK writes it.
The source views read those tables (for SQLAlchemySession: the shipped recipe,
`pycompactor install-recipe agents-sqlalchemy`, pycompactor/recipes), so nothing is
copied and existing history is compacted as it is.

* `add_items`, `pop_item` and `clear_session` go to the wrapped session unchanged (its
  transaction, its tables); then the session tells the engine, with
  `compaction.enqueue(session_id, scope)`, that the conversation has new history, since
  the SDK has no hook for it and a worker otherwise finds nothing queued.
* `get_items` returns `pycompactor.aproject_history(...)` under the session's byte
  budget, as SDK input items (`{"role": "user" | "assistant", "content": str}`): the
  newest pairs raw, older ranges as their 10 original user messages plus the summary,
  older history omitted once the budget is spent. Tool traffic is never replayed.

The database work is async psycopg on the caller's event loop (no thread hop): one
`psycopg.AsyncConnection` per event loop, opened on first use, autocommit; the
projection runs in its own read-only snapshot. docs/agents.md shows the setup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, cast

import psycopg

from pycompactor import db
from pycompactor.errors import wrap_exceptions
from pycompactor.projection import Projection, aproject_history, check_budget

if TYPE_CHECKING:
    from agents import TResponseInputItem
    from agents.memory import Session, SessionSettings

#: Default budget of the projected history (UTF-8 bytes + 16 per message).
DEFAULT_BUDGET_BYTES: Final = 64 * 1024


class ProjectingSession:
    """The SDK's `Session` protocol over a wrapped SDK session (see the module docstring).

    `session` is the wrapped session (its `session_id` is the conversation id); `dsn`
    the database the source views read; `budget_bytes` bounds what `get_items` returns;
    `scope` selects the summary lane. `connect` overrides how the session opens its
    connection (an async callable returning an autocommit `psycopg.AsyncConnection`;
    under PgBouncer transaction pooling open it with `prepare_threshold=None`).
    """

    def __init__(self, session: Session, *, dsn: str | None = None,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, scope: str = "default",
                 connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]] | None = None
                 ) -> None:
        if connect is None and dsn is None:
            raise ValueError("ProjectingSession needs dsn= or connect=")
        self.wrapped = session
        self.session_id: str = session.session_id
        self.budget_bytes = check_budget(budget_bytes)
        self.scope = scope
        self._connect = connect or (lambda: psycopg.AsyncConnection.connect(
            cast(str, dsn), autocommit=True, prepare_threshold=None,
            application_name="pycompactor-session"))
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The projection behind the last get_items() call (its manifest says what was
        #: raw, summarized or omitted, and which summaries were refused and why).
        self.last_projection: Projection | None = None

    @property
    def session_settings(self) -> SessionSettings | None:
        """The wrapped session's settings (the SDK reads its default limit here)."""
        return getattr(self.wrapped, "session_settings", None)

    @session_settings.setter
    def session_settings(self, value: SessionSettings | None) -> None:
        self.wrapped.session_settings = value

    # -- the Session protocol -----------------------------------------------------------

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The projected history, oldest first; with `limit`, only its newest items."""
        conn = await self._connection()
        projection = await aproject_history(conn, self.session_id,
                                            budget_bytes=self.budget_bytes, scope=self.scope)
        self.last_projection = projection
        items = [cast("TResponseInputItem", {"role": m["role"], "content": m["content"]})
                 for m in projection.messages]
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return items

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Write through to the wrapped session, then queue the conversation."""
        if not items:
            return
        await self.wrapped.add_items(items)
        await self._enqueue()

    async def pop_item(self) -> TResponseInputItem | None:
        item = await self.wrapped.pop_item()
        if item is not None:
            await self._enqueue()
        return item

    async def clear_session(self) -> None:
        """Clear the wrapped session. Its summaries stay in the engine (immutable) but are
        never projected again; erasure is `compaction.erase_conversation`."""
        await self.wrapped.clear_session()
        await self._enqueue()

    # -- lifecycle ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close this session's database connection (not the wrapped session)."""
        conn, self._conn, self._loop = self._conn, None, None
        if conn is not None:
            await conn.close()

    # -- the database side --------------------------------------------------------------

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None and (self._loop is not loop or conn.closed or conn.broken):
            # Opened on another event loop (the SDK may be driven by several over a
            # session's life) or lost: let it go without awaiting on a foreign loop.
            conn.pgconn.finish()
            conn = None
        if conn is None:
            with wrap_exceptions():
                conn = await self._connect()
            self._conn, self._loop = conn, loop
        return conn

    async def _enqueue(self) -> None:
        await db.aenqueue(await self._connection(), self.session_id, self.scope)


__all__ = ["DEFAULT_BUDGET_BYTES", "ProjectingSession"]
