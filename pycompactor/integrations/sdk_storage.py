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
projection runs in its own read-only snapshot. With `read_dsn` (a hot standby),
`get_items` reads there once the standby has replayed this session's last write (a
bounded wait; else it reads the primary), and `enqueue` stays on the primary.
docs/agents.md shows the setup.
"""

from __future__ import annotations

import asyncio
import time
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
#: How long get_items waits for a replica to replay the session's own last write.
DEFAULT_READ_WAIT_SECONDS: Final = 5.0

Connect = Callable[[], Awaitable[psycopg.AsyncConnection[Any]]]


class _LoopConnection:
    """One autocommit async connection, opened on first use on the running event loop."""

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def get(self) -> psycopg.AsyncConnection[Any]:
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

    async def close(self) -> None:
        conn, self._conn, self._loop = self._conn, None, None
        if conn is not None:
            await conn.close()


def _connector(dsn: str, name: str) -> Connect:
    return lambda: psycopg.AsyncConnection.connect(
        dsn, autocommit=True, prepare_threshold=None, application_name=name)


class ProjectingSession:
    """The SDK's `Session` protocol over a wrapped SDK session (see the module docstring).

    `session` is the wrapped session (its `session_id` is the conversation id); `dsn`
    the database the source views read (the primary); `read_dsn` a hot standby of it for
    `get_items`; `budget_bytes` bounds what `get_items` returns; `scope` selects the
    summary lane. `connect` / `read_connect` override how the session opens those
    connections (async callables returning an autocommit `psycopg.AsyncConnection`;
    under PgBouncer transaction pooling open them with `prepare_threshold=None`).
    """

    def __init__(self, session: Session, *, dsn: str | None = None,
                 read_dsn: str | None = None,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, scope: str = "default",
                 connect: Connect | None = None, read_connect: Connect | None = None,
                 read_wait_seconds: float = DEFAULT_READ_WAIT_SECONDS) -> None:
        if connect is None and dsn is None:
            raise ValueError("ProjectingSession needs dsn= or connect=")
        self.wrapped = session
        self.session_id: str = session.session_id
        self.budget_bytes = check_budget(budget_bytes)
        self.scope = scope
        self.read_wait_seconds = read_wait_seconds
        self._primary = _LoopConnection(
            connect or _connector(cast(str, dsn), "pycompactor-session"))
        read = read_connect or (_connector(read_dsn, "pycompactor-session-read")
                                if read_dsn is not None else None)
        self._replica = _LoopConnection(read) if read is not None else None
        # The primary's WAL position after this session's last write (with a replica).
        self._written_lsn: str | None = None
        #: The projection behind the last get_items() call (its manifest says what was
        #: raw, summarized or omitted, and which summaries were refused and why).
        self.last_projection: Projection | None = None
        #: Where the last get_items() read: "primary", or "replica" once caught up.
        self.last_read_from = "primary"

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
        conn = await self._read_connection()
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
        """Close this session's database connections (not the wrapped session)."""
        await self._primary.close()
        if self._replica is not None:
            await self._replica.close()

    # -- the database side --------------------------------------------------------------

    async def _read_connection(self) -> psycopg.AsyncConnection[Any]:
        """The replica once it has replayed this session's last write, else the primary."""
        if self._replica is not None:
            replica = await self._replica.get()
            if self._written_lsn is None or await self._caught_up(replica, self._written_lsn):
                self.last_read_from = "replica"
                return replica
        self.last_read_from = "primary"
        return await self._primary.get()

    async def _caught_up(self, conn: psycopg.AsyncConnection[Any], lsn: str) -> bool:
        """Wait (bounded) until the replica has replayed `lsn`."""
        deadline = time.monotonic() + self.read_wait_seconds
        delay = 0.005
        while not await db.areplayed(conn, lsn):
            if time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)  # another server's replay: nothing to wait on
            delay = min(delay * 2, 0.1)
        return True

    async def _enqueue(self) -> None:
        conn = await self._primary.get()
        await db.aenqueue(conn, self.session_id, self.scope)
        if self._replica is not None:
            # After the wrapped session's commit and this one: what a read must see.
            self._written_lsn = await db.awal_insert_lsn(conn)


__all__ = ["DEFAULT_BUDGET_BYTES", "ProjectingSession"]
