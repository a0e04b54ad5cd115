"""The worker's database connections: a small pool its threads share, and which database
errors a reconnect may cure.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Final

import psycopg

from pycompactor import db
from pycompactor.errors import (
    DatabaseTimeout,
    DatabaseUnavailable,
    PycompactorError,
    TransactionConflict,
)

# Connection-class SQLSTATEs (connection exception, rollback, resources, operator
# intervention): the database may be back soon, so the loop reconnects and retries.
_TRANSIENT_SQLSTATE_CLASSES: Final = frozenset({"08", "40", "53", "57"})
# Operator intervention that ends the session (admin/crash shutdown, cannot connect now,
# database dropped, idle session timeout); 57014, a cancelled statement, leaves it usable.
_SESSION_ENDED: Final = frozenset({"57P01", "57P02", "57P03", "57P04", "57P05"})


class Connections:
    """Idle autocommit connections shared by the worker's threads.

    A psycopg connection runs one statement at a time, so each thread takes its own from
    here for the duration of one call; broken ones are dropped and replaced on demand.
    """

    def __init__(self, connect: Callable[[], db.Connection]) -> None:
        self._connect = connect
        self._idle: list[db.Connection] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def get(self) -> Iterator[db.Connection]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        lost = False
        try:
            yield conn
        except BaseException as exc:
            lost = connection_lost(exc)
            raise
        finally:
            if lost or conn.closed or conn.broken:
                conn.close()
            else:
                with self._lock:
                    self._idle.append(conn)

    def close_all(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def connection_lost(exc: BaseException) -> bool:
    """True when the error says the server ended the session. libpq marks the connection
    bad only once it reads the socket's end; a FATAL read before that leaves it looking
    usable, and handed out again it would fail the next call too."""
    cause = exc.__cause__ if isinstance(exc, PycompactorError) else exc
    if isinstance(exc, DatabaseUnavailable):
        return True
    if not isinstance(cause, psycopg.Error):
        return False
    sqlstate = cause.sqlstate or ""
    return ((isinstance(cause, psycopg.OperationalError) and not sqlstate)
            or sqlstate[:2] == "08" or sqlstate in _SESSION_ENDED)


def is_transient(exc: BaseException) -> bool:
    """True for database trouble that a reconnect may cure (in loop mode we retry)."""
    if isinstance(exc, DatabaseUnavailable | DatabaseTimeout | TransactionConflict):
        # A timed-out lock or statement may well succeed on the next try; a call rolled
        # back for a concurrent transaction changed nothing and is sent again.
        return True
    cause = exc.__cause__ if isinstance(exc, PycompactorError) else exc
    if isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    return isinstance(cause, psycopg.Error) and (
        (cause.sqlstate or "")[:2] in _TRANSIENT_SQLSTATE_CLASSES
    )
