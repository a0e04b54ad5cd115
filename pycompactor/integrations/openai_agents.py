"""A Session for the OpenAI Agents SDK that stores turns as runs and replays projected history.

This module owns the mapping between the SDK's session items and pycompactor's source
contract (the reference tables in `compaction_source`):

* Each **turn** is a run. A user message opens a new run (`status = 'in_progress'`) and is
  stored as its `user` message. The turn's final assistant message is stored as the run's
  one `assistant` message, and the run becomes `completed` (a settled run: a pair). The
  SDK saves a turn in batches (the input first; then, per model call, the items it
  produced), so an assistant message is final when it ends its batch; an assistant
  message followed by more of the turn's work (a tool call) is kept with role
  `assistant_interim`, and a later assistant message of the same run demotes an earlier
  one the same way, so a run never has two `assistant` messages.
* **Non-message items** (function and tool calls and their outputs, reasoning, handoffs,
  ...) are stored in the run as role `sdk_item` with the item's JSON as content, and
  system/developer messages keep their role. None of them is part of a pair (contract §3
  ignores other roles), so none is summarized or replayed: the next turn sees the pairs'
  user messages and final answers (or their summary), not earlier tool traffic. A turn
  without a final assistant message (failed, interrupted) stays `in_progress` and is not
  replayed either.
* `get_items()` returns `pycompactor.project_history(...)` under the session's byte
  budget as SDK input items (`{"role": "user" | "assistant", "content": str}`): the newest
  history raw, older ranges as their 10 original user messages plus one assistant message
  carrying the summary (marker line first), older history omitted when the budget ends.
  The manifest of the last call is kept in `last_projection`.
* Writes to the reference tables enqueue the conversation for the worker (their
  triggers, scope `default`); for another scope the session calls `compaction.enqueue`.
* **Reads on a replica**: with `read_dsn` (or `read_connect`), `get_items()` projects
  from that connection (a hot standby, say) in a read-only transaction, while writes go
  to `dsn`. Read-your-writes: after its own write the session notes the primary's WAL
  position and `get_items()` waits (up to `read_wait_seconds`) until the replica has
  replayed it, else reads that once from the primary, so a turn never misses the turn
  before it.

Only message text is stored: input images and files in a user message are not kept
(their text parts are). The database work is synchronous psycopg in a worker thread, one
operation at a time per session. docs/agents.md shows the setup.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import psycopg

from pycompactor import db, store
from pycompactor.errors import wrap_exceptions
from pycompactor.projection import Projection, check_budget, project_history

if TYPE_CHECKING:
    from agents import TResponseInputItem
    from agents.memory import SessionSettings

#: Default budget of the projected history (UTF-8 bytes + 16 per message).
DEFAULT_BUDGET_BYTES: Final = 64 * 1024
#: How long get_items waits for a replica to replay the session's own last write.
DEFAULT_READ_WAIT_SECONDS: Final = 5.0
#: Role of a stored non-message item (tool calls, their outputs, reasoning, ...).
ITEM_ROLE: Final = "sdk_item"
#: Role of an assistant message that was not the turn's final answer.
INTERIM_ROLE: Final = "assistant_interim"
IN_PROGRESS: Final = "in_progress"
COMPLETED: Final = "completed"

def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    if isinstance(content, Sequence):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text", part.get("refusal"))
                if isinstance(text, str):
                    parts.append(text)
    return "\n".join(parts)


def _role_of(item: Mapping[str, Any]) -> str | None:
    """The role of a message item (easy or typed form), None for any other item."""
    role = item.get("role")
    if isinstance(role, str) and item.get("type", "message") == "message":
        return role
    return None


class PycompactorSession:
    """The SDK's `Session` protocol over pycompactor (see the module docstring).

    `session_id` is the conversation id. `budget_bytes` bounds the history `get_items`
    returns; `scope` selects the summary lane. `connect` overrides how the session opens
    its database connection (default: `pycompactor.db.connect(dsn)`, autocommit).
    """

    session_settings: SessionSettings | None = None

    def __init__(self, session_id: str, *, dsn: str | None = None,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, scope: str = "default",
                 connect: Callable[[], psycopg.Connection[Any]] | None = None,
                 session_settings: SessionSettings | None = None,
                 read_dsn: str | None = None,
                 read_connect: Callable[[], psycopg.Connection[Any]] | None = None,
                 read_wait_seconds: float = DEFAULT_READ_WAIT_SECONDS) -> None:
        if not session_id:
            raise ValueError("a session needs a non-empty session_id (the conversation id)")
        self.session_id = session_id
        self.budget_bytes = check_budget(budget_bytes)
        self.scope = scope
        self.session_settings = session_settings
        self._connect = connect or (lambda: db.connect(dsn))
        self._conn: psycopg.Connection[Any] | None = None
        if read_connect is None and read_dsn is not None:
            read_connect = lambda: db.connect(read_dsn, read_only=True)  # noqa: E731
        self._read_connect = read_connect
        self._read_conn: psycopg.Connection[Any] | None = None
        self.read_wait_seconds = read_wait_seconds
        #: The primary's WAL insert position after this session's last write (read
        #: connection only): get_items waits for the replica to replay it.
        self._written_lsn: str | None = None
        #: Where the last get_items() read: "primary", or "replica" (the read connection).
        self.last_read_from: str | None = None
        # One database operation at a time (the SDK may call from several event loops
        # over a session's life, so a thread lock rather than an asyncio one).
        self._lock = threading.Lock()
        #: The projection behind the last get_items() call (its manifest says what was
        #: raw, summarized or omitted, and which summaries were refused and why).
        self.last_projection: Projection | None = None

    # -- the Session protocol -----------------------------------------------------------

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The projected history, oldest first; with `limit`, only its newest items."""
        items: list[TResponseInputItem] = await asyncio.to_thread(self._read)
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return items

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        if items:
            await asyncio.to_thread(self._locked, self._add_items, list(items))

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove and return the newest stored item (a message or a non-message item)."""
        item: TResponseInputItem | None = await asyncio.to_thread(self._locked,
                                                                  self._pop_item)
        return item

    async def clear_session(self) -> None:
        """Delete the conversation's runs and messages from the source tables.

        Its summaries stay in the engine (they are immutable) but can never be projected
        again, their source being gone; erasure of the engine rows is
        `compaction.erase_conversation` (docs/security.md).
        """
        await asyncio.to_thread(self._locked, self._clear)

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            for conn in (self._conn, self._read_conn):
                if conn is not None:
                    conn.close()
            self._conn = self._read_conn = None

    def __enter__(self) -> PycompactorSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the database side (in a worker thread) -----------------------------------------

    def _locked(self, operation: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            conn = self._primary()
            result = operation(conn, *args)
            if self._read_connect is not None:
                # A write: the replica must replay it before this session reads there.
                self._written_lsn = db.wal_insert_lsn(conn)
            return result

    def _primary(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._connect()
        return self._conn

    def _read(self) -> list[TResponseInputItem]:
        """get_items on the read connection when there is one, else on the primary."""
        if self._read_connect is None:
            self.last_read_from = "primary"
            items: list[TResponseInputItem] = self._locked(self._get_items)
            return items
        with self._lock:
            if self._read_conn is None or self._read_conn.closed or self._read_conn.broken:
                self._read_conn = self._read_connect()
            if self._written_lsn is not None and not self._caught_up(self._read_conn,
                                                                     self._written_lsn):
                self.last_read_from = "primary"  # the replica lags our own write
                return self._get_items(self._primary())
            self.last_read_from = "replica"
            return self._get_items(self._read_conn)

    def _caught_up(self, conn: psycopg.Connection[Any], lsn: str) -> bool:
        """Wait (bounded) until a replica has replayed `lsn`; True at once on a primary."""
        deadline = time.monotonic() + self.read_wait_seconds
        delay = 0.005
        while True:
            if db.replayed(conn, lsn):
                return True
            if time.monotonic() + delay > deadline:
                return False
            time.sleep(delay)  # replay progress of another server: nothing to wait on
            delay = min(delay * 2, 0.1)

    def _get_items(self, conn: psycopg.Connection[Any]) -> list[TResponseInputItem]:
        projection = project_history(conn, self.session_id, budget_bytes=self.budget_bytes,
                                     scope=self.scope)
        self.last_projection = projection
        return [cast("TResponseInputItem", {"role": m["role"], "content": m["content"]})
                for m in projection.messages]

    def _add_items(self, conn: psycopg.Connection[Any],
                   items: list[TResponseInputItem]) -> None:
        session = self.session_id
        with wrap_exceptions(), conn.transaction():
            # The conversation row is locked first, so concurrent writers of one session
            # serialise and seq stays dense.
            store.ensure_conversation(conn, session)
            store.lock_conversation(conn, session)
            last = store.last_message(conn, session)
            seq = last.seq if last else 0
            run_id = last.run_id if last else None
            for position, raw in enumerate(items):
                item = cast(Mapping[str, Any], raw)
                role = _role_of(item)
                final = position == len(items) - 1
                seq += 1
                message_id = f"{session}/{uuid.uuid4().hex}"
                if role == "user":
                    run_id = f"{session}/run-{uuid.uuid4().hex}"
                    store.insert_run(conn, run_id, session, IN_PROGRESS)
                    message = store.MessageRow(message_id, session, run_id, "user", COMPLETED,
                                               _text_of(item.get("content")), seq)
                elif role == "assistant":
                    if run_id is None:  # an answer with no question (e.g. seeded history)
                        run_id = f"{session}/run-{uuid.uuid4().hex}"
                        store.insert_run(conn, run_id, session, IN_PROGRESS)
                    store.set_role(conn, run_id, from_role="assistant", to_role=INTERIM_ROLE)
                    message = store.MessageRow(
                        message_id, session, run_id, "assistant" if final else INTERIM_ROLE,
                        item.get("status") or COMPLETED, _text_of(item.get("content")), seq)
                else:
                    message = store.MessageRow(
                        message_id, session, run_id, role or ITEM_ROLE, COMPLETED,
                        _text_of(item.get("content")) if role
                        else json.dumps(item, ensure_ascii=False, default=str), seq)
                store.insert_messages(conn, [message])
                if run_id is not None and role != "user":
                    # Settled exactly when the turn's last saved item is its completed answer.
                    settled = role == "assistant" and final and message.status == COMPLETED
                    store.set_run_status(conn, run_id, COMPLETED if settled else IN_PROGRESS)
            if self.scope != "default":
                # The reference tables' triggers enqueue the default scope only.
                db.enqueue(conn, session, self.scope)

    def _pop_item(self, conn: psycopg.Connection[Any]) -> TResponseInputItem | None:
        with wrap_exceptions(), conn.transaction():
            if not store.lock_conversation(conn, self.session_id):
                return None
            last = store.last_message(conn, self.session_id)
            if last is None:
                return None
            store.delete_message(conn, last.message_id)
            if last.run_id is not None:
                if last.role == "assistant":
                    # The turn is no longer answered: an earlier answer of it (if any) is
                    # the newest again, but the run is unsettled until a new one arrives.
                    store.set_role(conn, last.run_id, from_role=INTERIM_ROLE,
                                   to_role="assistant", newest_only=True)
                    store.set_run_status(conn, last.run_id, IN_PROGRESS)
                store.delete_run_if_empty(conn, last.run_id)
        if last.role == ITEM_ROLE:
            return cast("TResponseInputItem", json.loads(last.content))
        return cast("TResponseInputItem", {"role": last.role if last.role != INTERIM_ROLE
                                           else "assistant", "content": last.content})

    def _clear(self, conn: psycopg.Connection[Any]) -> None:
        with wrap_exceptions(), conn.transaction():
            store.delete_conversation(conn, self.session_id)


__all__ = ["DEFAULT_BUDGET_BYTES", "PycompactorSession"]
