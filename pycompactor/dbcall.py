"""The call machinery under `pycompactor.db`: connections (DSN resolution, connect,
client encoding), the per-call timeouts and `_call`, which runs one stored function in
its own short transaction in one network round trip (see `pycompactor.db` for why).
"""

from __future__ import annotations

import os
import re
import urllib.parse
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Generic, LiteralString, TypeVar

import psycopg
from psycopg import pq, sql
from psycopg.rows import RowFactory

from pycompactor.errors import (
    ClientEncodingNotUtf8,
    DatabaseUnavailable,
    from_driver,
    wrap_exceptions,
)

Connection = psycopg.Connection[Any]
Row = TypeVar("Row")


#: The shortest and longest lock_timeout / statement_timeout PostgreSQL takes (whole
#: milliseconds; 0 turns the limit off).
MIN_TIMEOUT_MS: Final = 1
MAX_TIMEOUT_MS: Final = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Per-call limits: how long to wait for a lock, and for a whole statement."""

    lock: timedelta = timedelta(seconds=5)
    statement: timedelta = timedelta(seconds=60)

    def __post_init__(self) -> None:
        # 0 would mean "no limit" to PostgreSQL, and it counts whole milliseconds: refuse
        # what it would round to 0 (or cannot hold) rather than silently hang.
        for what in (self.lock, self.statement):
            if not timedelta(milliseconds=MIN_TIMEOUT_MS) <= what \
                    <= timedelta(milliseconds=MAX_TIMEOUT_MS):
                raise ValueError("lock and statement timeouts must be positive, from 1 ms "
                                 f"to {MAX_TIMEOUT_MS} ms")


DEFAULT_TIMEOUTS: Final = Timeouts()
#: Sent first in each call's transaction; is_local=true makes both settings end with it.
TIMEOUTS_SQL: Final = (
    "SELECT pg_catalog.set_config('lock_timeout', %(lock_ms)s::text, true),"
    " pg_catalog.set_config('statement_timeout', %(statement_ms)s::text, true)"
)
#: The same for a `read_only` connection: the call's transaction is READ ONLY too (what
#: psycopg's `BEGIN READ ONLY` would do; the pipeline sends no BEGIN).
READ_ONLY_TIMEOUTS_SQL: Final = (
    TIMEOUTS_SQL + ", pg_catalog.set_config('transaction_read_only', 'on', true)"
)
# The timeouts each connection opened by connect() was given (others get the defaults).
_timeouts: weakref.WeakKeyDictionary[Connection, Timeouts] = weakref.WeakKeyDictionary()


def timeouts_of(conn: Connection) -> Timeouts:
    return _timeouts.get(conn, DEFAULT_TIMEOUTS)


def _ms(value: timedelta) -> str:
    return str(max(1, round(value.total_seconds() * 1000)))


class _Call(Generic[Row]):
    """What `_call` yields: `execute` sends one engine call with its timeouts, in one
    round trip; the fetch methods then read the call's rows (already received)."""

    def __init__(self, conn: Connection, cursor: psycopg.Cursor[Row], inline: bool) -> None:
        self._conn = conn
        self._cursor = cursor
        self._inline = inline

    def execute(self, query: LiteralString | sql.Composed, params: Mapping[str, Any]) -> None:
        timeouts = timeouts_of(self._conn)
        setup = READ_ONLY_TIMEOUTS_SQL if self._conn.read_only else TIMEOUTS_SQL
        limits = {"lock_ms": _ms(timeouts.lock), "statement_ms": _ms(timeouts.statement)}
        if self._inline and self._conn.info.pipeline_status == _PIPELINE_OFF:
            # One simple-protocol query holding both statements, its values rendered by
            # psycopg's own quoting: the server runs them as one implicit transaction
            # (inside the caller's, if one is open), and it arms each statement's timeout
            # when that statement starts, so the call runs under the settings the first
            # statement made. psycopg's pipeline costs the client about 160 us of CPU a
            # call more than this: with the claim sent this way, a claim -> complete
            # cycle ran 29% faster at eight connections on two cores (docs/benchmarks.md,
            # "The driver's call as one query"). A caller's own pipeline cannot carry a
            # simple query: the pipeline form below serves it.
            text = psycopg.ClientCursor(self._conn).mogrify(
                sql.SQL("; ").join([sql.SQL(setup), _composable(query)]),
                {**params, **limits})
            # psycopg rendered the text from the two literal statements above and their
            # values; with no parameters it sends it as one simple query, never prepared.
            self._cursor.execute(text, prepare=False)
            self._cursor.nextset()
            return
        # Pipeline mode: the set_config statement, then the call, then one Sync. The
        # server runs them in order (lock_timeout is in force before the call takes a
        # lock; a statement's timeout starts with that statement), and the Sync ends the
        # transaction they share unless the caller has one open: it commits if both
        # succeeded, else rolls back. Nothing waits for a result in between.
        commits_at_sync = (self._conn.autocommit
                           and self._conn.info.transaction_status == _IDLE
                           and self._conn.info.pipeline_status == _PIPELINE_OFF)
        with self._conn.pipeline() as pipeline, self._conn.cursor() as setup_cursor:
            setup_cursor.execute(setup, limits)
            self._cursor.execute(query, params)
            if commits_at_sync:
                _expect_an_error_at_the_sync(pipeline)

    def fetchone(self) -> Row | None:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Row]:
        return self._cursor.fetchall()

    @property
    def description(self) -> list[psycopg.Column] | None:
        return self._cursor.description


def _composable(query: LiteralString | sql.Composed) -> sql.Composable:
    return query if isinstance(query, sql.Composable) else sql.SQL(query)


_IDLE: Final = psycopg.pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = psycopg.pq.PipelineStatus.OFF


def _expect_an_error_at_the_sync(pipeline: psycopg.Pipeline) -> None:
    """Give psycopg's pipeline one more result slot than it asked for: room for an error
    the server may answer the closing Sync with.

    A transaction can fail at its commit after every statement in it succeeded: under
    SERIALIZABLE (40001, "during commit attempt"), or at a deferred constraint. With the
    implicit transaction our Sync ends, the server then answers the Sync with that error
    and then its ReadyForQuery, which libpq hands over as two results (the error, then
    PIPELINE_SYNC). psycopg (3.1 to 3.3, `BasePipeline._communicate_gen` and `_fetch_gen`)
    expects one result per queued Sync. Which way that goes wrong depends on timing: if
    both results arrive before psycopg polls after sending the Sync, it pops an empty
    deque and raises a bare `IndexError`, having dropped the server's error and its
    SQLSTATE; otherwise it raises the error but leaves the PIPELINE_SYNC unread, and the
    connection refuses every later call ("cannot exit pipeline mode while busy").

    One extra slot (a None entry, what psycopg queues for a Sync) matches the second
    result when there is one: the error is raised with its SQLSTATE, the PIPELINE_SYNC is
    consumed, and the connection is idle and usable, so the caller can retry the call.
    When the commit succeeds the slot finds nothing to match: psycopg stops fetching once
    libpq has no result left (no wait, no round trip) and drops the pipeline's queue with
    it. Only a pipeline this call opens and whose Sync commits gets the slot: a caller's
    open transaction is not committed at our Sync, and a caller's pipeline keeps its
    queue. No upstream report covers this yet (psycopg #296 is the nearest: the commit's
    result handled late in pipeline mode); drop the slot once psycopg pairs an error at a
    Sync with that Sync.
    """
    pipeline.result_queue.append(None)


def check_client_encoding(conn: Connection | psycopg.AsyncConnection[Any]) -> None:
    """Refuse a connection whose client_encoding is not UTF8 (ClientEncodingNotUtf8):
    every call's values are encoded by the client, and under SJIS, BIG5, GBK or GB18030
    a multibyte character can end in a byte the server then reads as a quote or a comma
    (`['ソ",INJ,ソ', 'z']` arrived as four elements). db.connect's connections are UTF8;
    a connection the caller opened is checked before each call."""
    if conn.info.encoding != "utf-8":
        found = conn.info.parameter_status("client_encoding")
        name = found if found is not None else conn.info.encoding
        raise ClientEncodingNotUtf8(
            "pycompactor's calls need a connection whose client_encoding is UTF8, this"
            f" one's is {name}: under it a text can change meaning on its way to the"
            " server; connect with client_encoding=UTF8 (or SET client_encoding = 'UTF8')")


@contextmanager
def _call(conn: Connection, row_factory: RowFactory[Row], *,
          inline: bool = False) -> Iterator[_Call[Row]]:
    """A cursor-like object whose one `execute` runs in a transaction with its lock and
    statement timeouts set LOCAL, in one network round trip.

    `inline` sends the settings and the call as one simple-protocol query, the values
    written into its text: for the worker's frequent calls, whose values are ids,
    numbers and codes. Any other call binds its values server-side (the pipeline form):
    the server logs the text of a statement that fails (log_min_error_statement), and a
    summary or a reply must never reach a log that erase_conversation cannot reach.

    On an autocommit connection (ours) the call gets its own transaction: the statements
    go in one pipeline without BEGIN, and the Sync that closes it commits them (or rolls
    them back on error), as the protocol defines for statements before a Sync outside a
    transaction block. A caller who manages transactions (autocommit off, or inside
    `conn.transaction()`) keeps them: the call joins that transaction, which the caller
    commits, and the settings last until it ends (still never beyond it).
    """
    check_client_encoding(conn)
    with wrap_exceptions(), conn.cursor(row_factory=row_factory) as cur:
        yield _Call(conn, cur, inline)


def _rows(conn: Connection, row_factory: RowFactory[Row], query: LiteralString,
          params: Mapping[str, Any], *, inline: bool = False) -> list[Row]:
    """Every row of one engine call (one transaction, one round trip, timeouts set)."""
    with _call(conn, row_factory, inline=inline) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def _row(conn: Connection, row_factory: RowFactory[Row], query: LiteralString,
         params: Mapping[str, Any], *, inline: bool = False) -> Row:
    """The one row an engine function always returns."""
    with _call(conn, row_factory, inline=inline) as cur:
        cur.execute(query, params)
        row = cur.fetchone()
    assert row is not None, query
    return row


def resolve_dsn(dsn: str | None) -> str:
    """--dsn, else PYCOMPACTOR_DSN, else "" (libpq then reads PGHOST, PGDATABASE, ...)."""
    return dsn if dsn is not None else os.environ.get("PYCOMPACTOR_DSN", "")


def describe_target(dsn: str | None) -> str | None:
    """Which database a DSN reaches, as libpq resolves it (the DSN, else the PG*
    variables, else libpq's defaults: the local socket, port 5432, the database named
    after the user): `database "agent" on db.internal, port 5432`. None when the DSN
    cannot be parsed. Never names the user or the password."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(resolve_dsn(dsn))
    except psycopg.Error:
        return None
    defaults = {o.keyword.decode(): o.val.decode() for o in pq.Conninfo.get_defaults()
                if o.val}

    def setting(key: str) -> str:
        value = given.get(key)
        return str(value) if value not in (None, "") else defaults.get(key, "")

    host = setting("host") or setting("hostaddr")
    dbname = setting("dbname") or setting("user")
    if host.startswith("/"):
        place = f"the local socket in {host}"
    elif host:
        place = host
    elif setting("service"):
        place = f"service {setting('service')!r}"
    else:
        place = "the default local socket"
    target = f'database "{dbname}" on {place}, port {setting("port") or "5432"}'
    if not given and not any(os.environ.get(f"PG{name}")
                             for name in ("HOST", "HOSTADDR", "PORT", "DATABASE", "SERVICE")):
        # The case that surprises: nothing the user set chose this database.
        target += ", libpq's defaults: no --dsn, PYCOMPACTOR_DSN or PG* variable names one"
    return target


def _malformed_dsn(conninfo: str) -> DatabaseUnavailable | None:
    """The error for a DSN libpq cannot parse (None when it parses): what to write."""
    try:
        psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "unparsable"
        for secret in dsn_passwords(conninfo):  # libpq quotes what it could not parse
            reason = reason.replace(secret, "***")
        return DatabaseUnavailable(
            f"invalid connection string ({reason}); give key=value pairs (host=db"
            " dbname=agent) or a URI (postgresql://user@db/agent) in --dsn or PYCOMPACTOR_DSN")
    return None


def connect(dsn: str | None = None, *, autocommit: bool = True,
            timeouts: Timeouts = DEFAULT_TIMEOUTS, read_only: bool = False) -> Connection:
    """Open a connection; autocommit by default, as each engine call is its own transaction.

    Server-side prepared statements are off (prepare_threshold=None): under PgBouncer's
    transaction pooling a statement prepared on one server connection is unknown to the
    next one the pooler hands out. `read_only` makes every transaction psycopg opens
    `BEGIN READ ONLY` (the read path: plan, project, audit; fine on a hot standby); it is
    a client-side setting, so nothing is left on the server session.
    """
    conninfo = resolve_dsn(dsn)
    malformed = _malformed_dsn(conninfo)
    if malformed is not None:
        # Not `from exc`: libpq quotes the part it could not parse, password and all.
        raise malformed
    try:
        conn = psycopg.connect(
            conninfo, autocommit=autocommit, application_name="pycompactor",
            prepare_threshold=None,
            # Whatever PGCLIENTENCODING or the DSN say: under SJIS, BIG5, GBK or
            # GB18030 a text's bytes could be read back as other characters (an array
            # element split in two), and JOHAB has no Python codec psycopg can use.
            client_encoding="UTF8",
        )
    except psycopg.Error as exc:
        error = from_driver(exc)
        message = str(error)
        secrets = dsn_passwords(conninfo)
        if any(secret in message for secret in secrets):
            # libpq quotes the offending part of a malformed DSN, password and all: say
            # it without the password, and drop the driver's message (--debug prints it).
            for secret in secrets:
                message = message.replace(secret, "***")
            raise type(error)(message) from None
        raise error from exc
    _timeouts[conn] = timeouts
    if read_only:
        conn.read_only = True
    return conn


# The password of a key=value DSN (quoted or not) and of a URI's userinfo, found without
# parsing the whole DSN: a DSN that libpq cannot parse still must not leak its password.
_KV_PASSWORD = re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'?|[^\s']+)")
_URI_PASSWORD = re.compile(r"^[a-z]+://[^:/@?#]*:([^@/?#]*)@", re.IGNORECASE)


def dsn_passwords(dsn: str) -> list[str]:
    """Every form of the DSN's password that an error message could quote (raw and
    decoded), longest first; [] when it has none. Never raises."""
    found: list[str] = []
    for match in (_KV_PASSWORD.search(dsn), _URI_PASSWORD.search(dsn)):
        if match is not None and match.group(1):
            raw = match.group(1)
            found += [raw, raw.strip("'"), urllib.parse.unquote(raw)]
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)
