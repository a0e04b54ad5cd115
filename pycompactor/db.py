"""Connections and one typed method per stored function (results as frozen dataclasses).

SQL text for the engine's interface lives here and in sql/; nothing else in the package
builds SQL. The worker's calls (claim, complete, fail, heartbeat, reap, enqueue, dequeue,
ack, release and the reads it plans from) each run in their own short transaction that
first sets `lock_timeout` and `statement_timeout` transaction-locally
(`set_config(..., true)`, i.e. SET LOCAL): a lock held by a hung session costs a worker
one lock_timeout, never a hang, and no session state is left behind, so all of this
works through PgBouncer in transaction pooling mode. Each such call costs one network
round trip: the settings and the call travel in one pipeline that ends with a single
Sync, which (with no BEGIN) delimits the call's transaction, or, for the calls whose
arguments are ids, numbers and codes only, in one simple-protocol query (see `_call`).
"""

from __future__ import annotations

import os
import re
import time
import urllib.parse
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Generic, LiteralString, TypeVar

import psycopg
from psycopg import pq, sql
from psycopg.rows import RowFactory, class_row, dict_row, tuple_row
from psycopg.types.json import Jsonb

from pycompactor.errors import (
    ClientEncodingNotUtf8,
    DatabaseUnavailable,
    InvalidArgument,
    PermissionDenied,
    ReadOnlyServer,
    from_driver,
    wrap_exceptions,
)
from pycompactor.models import (
    AckResult,
    AuditReport,
    ClaimResult,
    CompleteResult,
    FailResult,
    HeartbeatResult,
    NextTarget,
    Pair,
    QueuedConversation,
    RangeClaim,
    RangeReply,
    RunVerdict,
    Target,
    WorkerTarget,
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
            # Whatever PGCLIENTENCODING or the DSN say (issue 62): under SJIS, BIG5, GBK or
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


def eligible_pairs(conn: Connection, conversation_id: str) -> list[Pair]:
    return _rows(
        conn, class_row(Pair),
        "SELECT pair_index, run_id, user_message_id, user_content,"
        " assistant_message_id, assistant_content"
        " FROM compaction.eligible_pairs(%(conversation_id)s::text)",
        {"conversation_id": conversation_id},
    )


def plan_targets(conn: Connection, conversation_id: str) -> list[Target]:
    return _rows(
        conn, class_row(Target),
        "SELECT from_pair, to_pair, source_message_ids, source_hash"
        " FROM compaction.plan_targets(%(conversation_id)s::text)",
        {"conversation_id": conversation_id},
        inline=True,
    )


def source_holds(conn: Connection, conversation_id: str) -> bool:
    """Whether compaction.source_runs has any run of the conversation (one index probe;
    a reader may ask): an id it lacks is unknown to the source, or mistyped."""
    return bool(_row(
        conn, tuple_row,
        "SELECT EXISTS (SELECT FROM compaction.source_runs AS r"
        " WHERE r.conversation_id = %(conversation_id)s::text)",
        {"conversation_id": conversation_id},
    )[0])


def summary_bindings(conn: Connection, conversation_id: str,
                     scope: str) -> list[tuple[int, bool, bool]]:
    """(from_pair, source_current, projectable) of every completed summary of a
    conversation and scope: compaction.projection_summaries, which a reader may run."""
    return _rows(
        conn, tuple_row,
        "SELECT from_pair, source_current, projectable"
        " FROM compaction.projection_summaries(%(conversation_id)s::text, %(scope)s::text)",
        {"conversation_id": conversation_id, "scope": scope},
    )


#: Whether this role may read the attempts (compaction.audit_jobs: the auditor, the owner,
#: a superuser); a reader may not, and asks without an error.
MAY_READ_ATTEMPTS_SQL: Final = (
    "SELECT pg_catalog.has_table_privilege('compaction.audit_jobs', 'SELECT')")


def may_read_attempts(conn: Connection) -> bool:
    return bool(_row(conn, tuple_row, MAY_READ_ATTEMPTS_SQL, {})[0])


def range_attempts(conn: Connection, conversation_id: str,
                   scope: str) -> list[tuple[int, str, int, str]]:
    """(from_pair, source_hash, attempt, state) of every attempt of a conversation and
    scope, from compaction.audit_jobs (metadata only; needs `may_read_attempts`)."""
    return _rows(
        conn, tuple_row,
        "SELECT a.from_pair, a.source_hash, a.attempt, a.state FROM compaction.audit_jobs AS a"
        " WHERE a.conversation_id = %(conversation_id)s::text AND a.scope = %(scope)s::text"
        " AND NOT a.imported",
        {"conversation_id": conversation_id, "scope": scope},
    )


def worker_targets(conn: Connection, conversation_id: str, scope: str, model: str,
                   prompt_version: str) -> list[WorkerTarget]:
    """plan_targets, each with whether its identity already holds a completed summary."""
    return _rows(
        conn, class_row(WorkerTarget),
        "SELECT from_pair, to_pair, source_message_ids, source_hash, completed"
        " FROM compaction.worker_targets(%(conversation_id)s::text, %(scope)s::text,"
        " %(model)s::text, %(prompt_version)s::text)",
        {"conversation_id": conversation_id, "scope": scope, "model": model,
         "prompt_version": prompt_version},
        inline=True,
    )


def range_replies(conn: Connection, conversation_id: str, from_pair: int,
                  source_hash: str) -> list[RangeReply]:
    """The 10 assistant replies of a range, in pair order, only while their texts hash to
    `source_hash` (else none): the text a claimed attempt summarizes. With the derived
    state in use, the range's current hash; judged from the views, the hash of the ids
    of the job claimed with `source_hash` (revision 0037), else the current range's."""
    return _rows(
        conn, class_row(RangeReply),
        "SELECT pair_index, assistant_message_id, assistant_content"
        " FROM compaction.range_replies(%(conversation_id)s::text, %(from_pair)s::int,"
        " %(source_hash)s::text)",
        {"conversation_id": conversation_id, "from_pair": from_pair,
         "source_hash": source_hash},
        inline=True,
    )


def source_hash(conn: Connection, conversation_id: str, from_pair: int) -> str | None:
    """The SQL twin of pycompactor.source_hash, for a range of a stored conversation."""
    digest: str | None = _row(
        conn, tuple_row,
        "SELECT compaction.source_hash(%(conversation_id)s::text, %(from_pair)s::int)",
        {"conversation_id": conversation_id, "from_pair": from_pair},
    )[0]
    return digest


def explain_runs(conn: Connection, conversation_id: str) -> list[RunVerdict]:
    return _rows(
        conn, class_row(RunVerdict),
        "SELECT run_id, run_status, eligible, reason"
        " FROM compaction.explain_runs(%(conversation_id)s::text)",
        {"conversation_id": conversation_id},
    )


#: The lease a claim or heartbeat grants unless told otherwise (the SQL default).
DEFAULT_LEASE = timedelta(minutes=5)


def claim(conn: Connection, conversation_id: str, scope: str, from_pair: int,
          source_message_ids: Sequence[str], source_hash: str, model: str,
          prompt_version: str, worker: str, *, lease: timedelta = DEFAULT_LEASE,
          now: datetime | None = None) -> ClaimResult:
    """Claim one attempt of an identity; refusals come back as reasons, never errors."""
    return _row(
        conn, class_row(ClaimResult),
        "SELECT claimed, reason, job_id, attempt, lease_expires_at"
        " FROM compaction.claim("
        "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
        " p_from_pair => %(from_pair)s::int,"
        " p_source_message_ids => %(source_message_ids)s::text[],"
        " p_source_hash => %(source_hash)s::text, p_model => %(model)s::text,"
        " p_prompt_version => %(prompt_version)s::text, p_worker => %(worker)s::text,"
        " p_lease => %(lease)s::interval, p_now => %(now)s::timestamptz)",
        {"conversation_id": conversation_id, "scope": scope, "from_pair": from_pair,
         "source_message_ids": list(source_message_ids), "source_hash": source_hash,
         "model": model, "prompt_version": prompt_version, "worker": worker,
         "lease": lease, "now": now},
        inline=True,
    )


#: The most ranges compaction.claim_targets takes in one call.
CLAIM_BATCH_LIMIT: Final = 100


def claim_targets(conn: Connection, conversation_id: str, scope: str,
                  ranges: Sequence[tuple[int, Sequence[str], str]], model: str,
                  prompt_version: str, worker: str, *, lease: timedelta = DEFAULT_LEASE,
                  now: datetime | None = None) -> list[RangeClaim]:
    """Claim several ranges of one conversation, each (from_pair, source ids, hash), in one
    call: one lock and one judgement of the conversation for all of them, each answered
    as `claim` would answer it, in the order given. The first admission_full ends the
    batch: the ranges after it get no answer."""
    # One rectangular array of ids: a shorter row is padded with NULLs, which the
    # database answers as claim would answer that row (invalid_source_ids).
    width = max((len(r[1]) for r in ranges), default=0)
    ids = [list(r[1]) + [None] * (width - len(r[1])) for r in ranges]
    return _rows(
        conn, class_row(RangeClaim),
        "SELECT from_pair, claimed, reason, job_id, attempt, lease_expires_at"
        " FROM compaction.claim_targets("
        "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
        " p_from_pairs => %(from_pairs)s::int[],"
        " p_source_message_ids => %(source_message_ids)s::text[],"
        " p_source_hashes => %(source_hashes)s::text[], p_model => %(model)s::text,"
        " p_prompt_version => %(prompt_version)s::text, p_worker => %(worker)s::text,"
        " p_lease => %(lease)s::interval, p_now => %(now)s::timestamptz)",
        {"conversation_id": conversation_id, "scope": scope,
         "from_pairs": [r[0] for r in ranges],
         "source_message_ids": ids,
         "source_hashes": [r[2] for r in ranges],
         "model": model, "prompt_version": prompt_version, "worker": worker,
         "lease": lease, "now": now},
        inline=True,
    )


def claim_next_targets(conn: Connection, conversation_id: str, scope: str, limit: int,
                       model: str, prompt_version: str, worker: str, *,
                       lease: timedelta = DEFAULT_LEASE,
                       now: datetime | None = None) -> list[NextTarget]:
    """worker_targets and the first claims in one call, under one judgement of the
    conversation: its targets in order, each with whether its identity holds a summary,
    and up to `limit` claims (0 to CLAIM_BATCH_LIMIT) among those that do not, each tried
    answered as `claim` would answer it. A range refused for itself gives its turn to the
    next; the first admission_full or prompt_version_closed ends the claims. A target not
    tried comes back with claimed None."""
    return _rows(
        conn, class_row(NextTarget),
        "SELECT from_pair, to_pair, source_message_ids, source_hash, completed, claimed,"
        " reason, job_id, attempt, lease_expires_at"
        " FROM compaction.claim_next_targets("
        "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
        " p_limit => %(limit)s::int, p_model => %(model)s::text,"
        " p_prompt_version => %(prompt_version)s::text, p_worker => %(worker)s::text,"
        " p_lease => %(lease)s::interval, p_now => %(now)s::timestamptz)",
        {"conversation_id": conversation_id, "scope": scope, "limit": limit, "model": model,
         "prompt_version": prompt_version, "worker": worker, "lease": lease, "now": now},
        inline=True,
    )


def complete(conn: Connection, job_id: int, attempt: int, summary: str | None,
             finish_reason: str | None, tool_call_count: int, *,
             response_id: str | None = None, now: datetime | None = None,
             stats: Mapping[str, int] | None = None,
             conversation_id: str | None = None) -> CompleteResult:
    """Record attempt (job_id, attempt)'s result; fenced (lease_lost) and idempotent.

    `stats` is p_stats: any of input_tokens, output_tokens, figures_total, figures_kept,
    figures_invented (non-negative integers below 2^31; anything else is InvalidArgument,
    CP020, here or from the database). `finish_reason` is a code and `response_id` an id
    of at most 200 bytes (else CP020). `conversation_id` must be the job's (else
    lease_lost); the worker always passes it. `now` is honoured only for a superuser or
    compaction_owner (else CP025).
    """
    if tool_call_count is not None:
        _check_count("p_tool_call_count", tool_call_count)
    if stats is not None:
        for key, value in stats.items():
            if key not in STATS_KEYS:
                raise InvalidArgument(f"p_stats: unknown key {key[:64]!r} "
                                      f"(known: {', '.join(STATS_KEYS)})")
            _check_count(f"p_stats: {key}", value)
    return _row(
        conn, class_row(CompleteResult),
        "SELECT ok, reason, summary_id FROM compaction.complete("
        "p_job_id => %(job_id)s::bigint, p_attempt => %(attempt)s::int,"
        " p_summary => %(summary)s::text, p_finish_reason => %(finish_reason)s::text,"
        " p_tool_call_count => %(tool_call_count)s::int,"
        " p_response_id => %(response_id)s::text, p_now => %(now)s::timestamptz,"
        " p_stats => %(stats)s::jsonb, p_conversation_id => %(conversation_id)s::text)",
        {"job_id": job_id, "attempt": attempt, "summary": summary,
         "finish_reason": finish_reason, "tool_call_count": tool_call_count,
         "response_id": response_id, "now": now,
         "stats": None if stats is None else Jsonb(dict(stats)),
         "conversation_id": conversation_id},
    )


#: The keys of complete's p_stats (contract §6).
STATS_KEYS: Final = ("input_tokens", "output_tokens", "figures_total", "figures_kept",
                     "figures_invented")


def _check_count(what: str, value: object) -> None:
    """A count the engine stores as int: refused before it is encoded (a huge Python int
    cannot even be written as JSON), as the database would refuse it (CP020)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        shown = type(value).__name__ if not isinstance(value, int) else (
            "negative" if value < 0 else f"{value.bit_length()} bits long")
        raise InvalidArgument(f"{what} must be a non-negative integer below 2^31, "
                              f"got {shown}")


def fail(conn: Connection, job_id: int, attempt: int, reason: str, *,
         now: datetime | None = None, conversation_id: str | None = None) -> FailResult:
    """Record attempt (job_id, attempt) failed with the worker's reason code; fenced."""
    return _row(
        conn, class_row(FailResult),
        "SELECT ok, reason FROM compaction.fail("
        "p_job_id => %(job_id)s::bigint, p_attempt => %(attempt)s::int,"
        " p_reason => %(reason)s::text, p_now => %(now)s::timestamptz,"
        " p_conversation_id => %(conversation_id)s::text)",
        {"job_id": job_id, "attempt": attempt, "reason": reason, "now": now,
         "conversation_id": conversation_id},
    )


def heartbeat(conn: Connection, job_id: int, attempt: int, *,
              lease: timedelta = DEFAULT_LEASE, now: datetime | None = None,
              conversation_id: str | None = None) -> HeartbeatResult:
    """Renew the lease of running attempt (job_id, attempt); ok=False when fenced off."""
    return _row(
        conn, class_row(HeartbeatResult),
        "SELECT ok, lease_expires_at FROM compaction.heartbeat("
        "p_job_id => %(job_id)s::bigint, p_attempt => %(attempt)s::int,"
        " p_lease => %(lease)s::interval, p_now => %(now)s::timestamptz,"
        " p_conversation_id => %(conversation_id)s::text)",
        {"job_id": job_id, "attempt": attempt, "lease": lease, "now": now,
         "conversation_id": conversation_id},
        inline=True,
    )


def reply_problem(conn: Connection, text: str | None, finish_reason: str | None,
                  tool_call_count: int) -> str | None:
    """What `complete` would answer for this reply: None (accepted) or not_stopped,
    tool_calls, empty, too_long. The database's rule, asked, never copied."""
    problem: str | None = _row(
        conn, tuple_row,
        "SELECT compaction.reply_problem(%(text)s::text, %(finish_reason)s::text,"
        " %(tool_call_count)s::int)",
        {"text": text, "finish_reason": finish_reason, "tool_call_count": tool_call_count},
    )[0]
    return problem


_WAL_INSERT_LSN_SQL: Final = "SELECT pg_catalog.pg_current_wal_insert_lsn()::text"
_REPLAYED_SQL: Final = ("SELECT NOT pg_catalog.pg_is_in_recovery()"
                        " OR pg_catalog.pg_last_wal_replay_lsn() >= %(lsn)s::pg_lsn")


def wal_insert_lsn(conn: Connection) -> str:
    """The server's current WAL insert position (a write's LSN, to wait for on a replica)."""
    lsn: str = _row(conn, tuple_row, _WAL_INSERT_LSN_SQL, {})[0]
    return lsn


def replayed(conn: Connection, lsn: str) -> bool:
    """True on a primary, or on a hot standby that has replayed up to `lsn`."""
    return bool(_row(conn, tuple_row, _REPLAYED_SQL, {"lsn": lsn})[0])


def summaries(conn: Connection, conversation_id: str) -> list[tuple[int, int, str]]:
    """(from_pair, summary_id, summary) of every completed summary of a conversation."""
    return _rows(conn, tuple_row,
                 "SELECT from_pair, summary_id, summary FROM compaction.summaries"
                 " WHERE conversation_id = %(conversation_id)s ORDER BY from_pair",
                 {"conversation_id": conversation_id})


#: What a worker calls, by signature: a schema older than this package lacks one of them.
WORKER_FUNCTIONS: Final = (
    "compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz)",
    "compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval,"
    " timestamptz)",
    "compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text)",
    "compaction.fail(bigint, int, text, timestamptz, text)",
    "compaction.heartbeat(bigint, int, interval, timestamptz, text)",
    "compaction.dequeue(text, int, interval)",
    "compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz)",
    "compaction.reply_problem(text, text, int)",
)


#: The worker's start-up check. A missing schema or function (an older revision) fails
#: the regprocedure lookup (SchemaNotMigrated); a role without the grants gets false.
WORKER_ACCESS_SQL: Final = (
    "SELECT bool_and(pg_catalog.has_function_privilege(f, 'EXECUTE')),"
    " pg_catalog.pg_is_in_recovery()"
    " FROM unnest(%(functions)s::text[]) AS f"
)


def check_worker_access(conn: Connection) -> None:
    """Raise PermissionDenied unless this role can run a worker, ReadOnlyServer on a
    standby (a worker pass with nothing to do would write nothing and never notice)."""
    granted, in_recovery = _row(conn, tuple_row, WORKER_ACCESS_SQL,
                                {"functions": list(WORKER_FUNCTIONS)})
    if in_recovery:
        raise ReadOnlyServer("the server is read-only (a hot standby in recovery); "
                             "point the worker at the primary")
    if granted is not True:
        raise PermissionDenied(
            "this role may not run a worker (no EXECUTE on the engine's worker functions); "
            "connect as a member of compaction_worker")


def reap(conn: Connection, *, now: datetime | None = None) -> int:
    """Fail (lease_expired) every running attempt whose lease ran out; returns how many."""
    return int(_row(conn, tuple_row, "SELECT compaction.reap(p_now => %(now)s::timestamptz)",
                    {"now": now}, inline=True)[0])


_ENQUEUE_SQL: Final = ("SELECT compaction.enqueue(p_conversation_id => %(conversation_id)s::text,"
                       " p_scope => %(scope)s::text)")


def enqueue(conn: Connection, conversation_id: str, scope: str = "default") -> None:
    """Mark a conversation as having new history (hosts that re-point the source views)."""
    _row(conn, tuple_row, _ENQUEUE_SQL, {"conversation_id": conversation_id, "scope": scope},
         inline=True)


#: Shortest and longest lease claim, heartbeat and dequeue grant (else CP023 / CP020).
LEASE_BOUNDS: Final = (timedelta(seconds=1), timedelta(days=1))
#: Most queue entries one dequeue leases (revision 0018; else CP020).
DEQUEUE_LIMIT: Final = 1000


def dequeue(conn: Connection, limit: int = 100, *, scope: str = "default",
            lease: timedelta = DEFAULT_LEASE) -> list[QueuedConversation]:
    """Lease up to `limit` visible entries of `scope`, oldest first (one statement).

    Leased entries stay queued, hidden from other workers until the lease ends; the
    caller acknowledges each once it has examined the conversation (`ack`), or gives it
    back unexamined (`release`). A lease that runs out makes the entry visible again.
    """
    return _rows(
        conn, class_row(QueuedConversation),
        "SELECT conversation_id, scope, enqueued_at, lease_token, lease_expires_at"
        " FROM compaction.dequeue(p_scope => %(scope)s::text, p_limit => %(limit)s::int,"
        " p_lease => %(lease)s::interval)",
        {"scope": scope, "limit": limit, "lease": lease},
        inline=True,
    )


def ack(conn: Connection, entry: QueuedConversation) -> AckResult:
    """The leased entry's conversation was examined: remove it, unless an enqueue landed
    during the lease (`requeued`: it waits again). ok=False `lease_lost` otherwise."""
    return _row(
        conn, class_row(AckResult),
        "SELECT ok, reason FROM compaction.ack("
        "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
        " p_lease_token => %(lease_token)s::uuid)",
        _lease_params(entry),
        inline=True,
    )


def release(conn: Connection, entry: QueuedConversation) -> AckResult:
    """Give a leased entry back unexamined: visible again in its original place."""
    return _row(
        conn, class_row(AckResult),
        "SELECT ok, reason FROM compaction.release("
        "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
        " p_lease_token => %(lease_token)s::uuid)",
        _lease_params(entry),
        inline=True,
    )


def _lease_params(entry: QueuedConversation) -> dict[str, object]:
    return {"conversation_id": entry.conversation_id, "scope": entry.scope,
            "lease_token": entry.lease_token}


def import_summary(conn: Connection, conversation_id: str, scope: str, from_pair: int,
                   source_message_ids: Sequence[str], source_hash: str, model: str,
                   prompt_version: str, summary: str, completed_at: datetime) -> int:
    """Record a summary made by an earlier system; returns its summary_id (CP00x on bad shape)."""
    return int(_row(
        conn, tuple_row,
        "SELECT compaction.import_summary("
        "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
        " p_from_pair => %(from_pair)s::int,"
        " p_source_message_ids => %(source_message_ids)s::text[],"
        " p_source_hash => %(source_hash)s::text, p_model => %(model)s::text,"
        " p_prompt_version => %(prompt_version)s::text, p_summary => %(summary)s::text,"
        " p_completed_at => %(completed_at)s::timestamptz)",
        {"conversation_id": conversation_id, "scope": scope, "from_pair": from_pair,
         "source_message_ids": list(source_message_ids), "source_hash": source_hash,
         "model": model, "prompt_version": prompt_version, "summary": summary,
         "completed_at": completed_at},
    )[0])


def erase_conversation(conn: Connection, conversation_id: str, reason: str) -> int:
    """Erase a conversation's engine rows (owner/admin only); returns summaries removed.

    `reason` is a code (^[a-z][a-z0-9_]{0,63}$, e.g. `gdpr_request`), never free text:
    the tombstone outlives the erased rows and the auditor reads it (CP024 otherwise).
    """
    # A transaction block (BEGIN): on Citus, the mark that lets the delete guards pass
    # reaches the nodes holding the rows only from inside one (docs/operations.md). A
    # caller without autocommit is in one already, and keeps its transaction.
    block: AbstractContextManager[Any] = (conn.transaction() if conn.autocommit
                                          else nullcontext())
    with wrap_exceptions(), block:
        return int(_row(
            conn, tuple_row,
            "SELECT compaction.erase_conversation(p_conversation_id => %(conversation_id)s::text,"
            " p_reason => %(reason)s::text)",
            {"conversation_id": conversation_id, "reason": reason},
        )[0])


#: Audit views by short name, with the order that puts the newest first (the queue:
#: one row per scope, by scope).
AUDIT_VIEWS: dict[str, tuple[str, str]] = {
    "jobs": ("audit_jobs", "created_at DESC, job_id DESC, attempt NULLS FIRST"),
    "stale": ("audit_stale_summaries", "completed_at DESC, summary_id DESC"),
    "exhausted": ("audit_exhausted", "exhausted_at DESC, job_id DESC"),
    # recorded_at, not event_id: ids are unique but unordered under Citus (contract §11).
    "events": ("audit_events", "recorded_at DESC, event_id DESC"),
    "queue": ("audit_queue", "scope"),
}
#: Views without a conversation_id column (a conversation filter does not apply).
AUDIT_VIEWS_PER_SCOPE: Final = frozenset({"queue"})
#: Reports that are not a view's rows but a summary of them (`audit_models`).
AUDIT_REPORTS: Final = ("models",)

# Per model, from compaction.audit_jobs (which the auditor may read) and the owner's
# projection preference (compaction.projection_models(), contract §9): what each
# model did, and where the preference ranks it. A model the preference names but no job
# used has a row of zeros, so a typo in the preference shows.
_AUDIT_MODELS_SQL: Final = """
WITH preference AS (
    SELECT p.model, p.position::int AS position
    FROM pg_catalog.unnest(compaction.projection_models()) WITH ORDINALITY AS p (model, position)
), done AS (
    SELECT j.model,
           count(DISTINCT (j.conversation_id, j.job_id))::int AS jobs,
           count(*) FILTER (WHERE j.state = 'completed')::int AS completed,
           count(*) FILTER (WHERE j.state = 'imported')::int AS imported,
           count(*) FILTER (WHERE j.state = 'failed')::int AS failed_attempts,
           count(*) FILTER (WHERE j.state = 'running')::int AS running,
           sum(j.input_tokens)::bigint AS input_tokens,
           sum(j.output_tokens)::bigint AS output_tokens,
           sum(j.figures_kept)::bigint AS figures_kept,
           sum(j.figures_total)::bigint AS figures_total
    FROM compaction.audit_jobs AS j
    WHERE %(conversation_id)s::text IS NULL OR j.conversation_id = %(conversation_id)s::text
    GROUP BY j.model
)
SELECT coalesce(d.model, p.model) AS model, p.position AS projection_preference,
       coalesce(d.jobs, 0) AS jobs, coalesce(d.completed, 0) AS completed,
       coalesce(d.imported, 0) AS imported,
       coalesce(d.failed_attempts, 0) AS failed_attempts, coalesce(d.running, 0) AS running,
       d.input_tokens, d.output_tokens, d.figures_kept, d.figures_total
FROM done AS d
FULL JOIN preference AS p ON p.model = d.model
ORDER BY p.position NULLS LAST, 1
"""


def projection_models(conn: Connection) -> list[str]:
    """The owner's model preference for projection (contract §9), in order;
    empty when none is set."""
    return [str(m) for m in _row(conn, tuple_row,
                                 "SELECT compaction.projection_models()", {})[0]]


def set_projection_models(conn: Connection, models: Sequence[str]) -> int:
    """Set the owner's model preference for projection (the owner only); returns how
    many conversations' verdicts were judged again."""
    return int(_row(conn, tuple_row,
                    "SELECT compaction.set_projection_models(%(models)s::text[])",
                    {"models": list(models)})[0])


def summary_verdicts_by_model(conn: Connection, conversation_id: str,
                              scope: str = "default") -> list[tuple[str, str | None]]:
    """(model, verdict) of each stored summary of a conversation and scope: the verdict
    is None for the one its range's projection uses, else version_not_projectable,
    stale_source or superseded (what `evaluate --database` counts per model). Two
    statements, each standing alone (docs/operations.md, Citus rules): the verdicts of
    compaction.projection_frame, then the summaries' models."""
    frame = _row(conn, tuple_row,
                 "SELECT summary_ids, summary_reasons FROM compaction.projection_frame("
                 "%(conversation_id)s::text, %(scope)s::text, 2147483640)",
                 {"conversation_id": conversation_id, "scope": scope})
    verdicts: dict[int, str | None] = dict(zip(frame[0], frame[1], strict=True))
    if not verdicts:
        return []
    models = _rows(conn, tuple_row,
                   "SELECT summary_id, model FROM compaction.summaries"
                   " WHERE conversation_id = %(conversation_id)s::text"
                   " AND summary_id = ANY (%(ids)s::bigint[])",
                   {"conversation_id": conversation_id, "ids": list(verdicts)})
    return sorted(((str(model), verdicts[summary_id]) for summary_id, model in models),
                  key=lambda pair: (pair[0], pair[1] or ""))


def audit_models(conn: Connection, *, conversation_id: str | None = None) -> AuditReport:
    """Per model: jobs, completed and imported summaries, failed and running attempts,
    reported tokens and figures, and its place in the projection preference (1 first;
    None when not named)."""
    with _call(conn, dict_row) as cur:
        cur.execute(_AUDIT_MODELS_SQL, {"conversation_id": conversation_id})
        rows = cur.fetchall()
        columns = [c.name for c in cur.description or []]
    return AuditReport(view="models", columns=columns, rows=rows)


def audit(conn: Connection, view: str, *, conversation_id: str | None = None,
          limit: int = 50) -> AuditReport:
    """Read one audit view (`jobs`, `stale`, `exhausted`, `events`, `queue`), newest first."""
    if view not in AUDIT_VIEWS:
        raise ValueError(f"unknown audit view {view!r}; choose from {', '.join(AUDIT_VIEWS)}")
    name, order = AUDIT_VIEWS[view]
    if view in AUDIT_VIEWS_PER_SCOPE:
        if conversation_id is not None:
            raise ValueError(f"the {view} view has one row per scope, not per conversation")
        where = sql.SQL("")
    else:
        where = sql.SQL(
            " WHERE %(conversation_id)s::text IS NULL"
            " OR conversation_id = %(conversation_id)s::text")
    query = sql.SQL(
        "SELECT * FROM compaction.{view}{where} ORDER BY {order} LIMIT %(limit)s::int"
    ).format(view=sql.Identifier(name), where=where, order=sql.SQL(order))
    params: dict[str, object] = {"limit": limit}
    if view not in AUDIT_VIEWS_PER_SCOPE:
        params["conversation_id"] = conversation_id
    with _call(conn, dict_row) as cur:
        cur.execute(query, params)
        rows = cur.fetchall()
        columns = [c.name for c in cur.description or []]
    return AuditReport(view=name, columns=columns, rows=rows)


def conversations_after(conn: Connection, after: str, limit: int) -> list[str]:
    """One page of the conversations of compaction.source_runs, in id order, after `after`.

    The worker's --sweep walks pages of these (keyset paging: each page is one short
    index range scan on the reference tables, never a scan of every message).
    """
    with _call(conn, tuple_row) as cur:
        cur.execute(
            "SELECT DISTINCT r.conversation_id FROM compaction.source_runs AS r"
            " WHERE r.conversation_id > %(after)s::text"
            " ORDER BY r.conversation_id LIMIT %(limit)s::int",
            {"after": after, "limit": limit},
        )
        return [str(row[0]) for row in cur.fetchall()]


def unqueued_targets(conn: Connection, scope: str, model: str, prompt_version: str,
                     limit: int) -> tuple[str, int] | None:
    """The first of the source's first `limit` conversations (in id order) that has
    targets without a completed summary for this identity, and how many: one statement,
    for the worker's idle hint (nothing queued, yet work waits)."""
    with _call(conn, tuple_row) as cur:
        cur.execute(
            "SELECT c.conversation_id, count(*)::int"
            " FROM (SELECT DISTINCT r.conversation_id FROM compaction.source_runs AS r"
            "       WHERE r.conversation_id IS NOT NULL"
            "       ORDER BY r.conversation_id LIMIT %(limit)s::int) AS c"
            " CROSS JOIN LATERAL compaction.worker_targets(c.conversation_id, %(scope)s::text,"
            "     %(model)s::text, %(prompt_version)s::text) AS t"
            " WHERE NOT t.completed"
            " GROUP BY c.conversation_id ORDER BY c.conversation_id LIMIT 1",
            {"limit": limit, "scope": scope, "model": model, "prompt_version": prompt_version},
        )
        row = cur.fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


# --- source checks (pycompactor check-source) -------------------------------------------


def view_columns(conn: Connection, view: str) -> dict[str, str]:
    """A view's columns and their types (format_type); empty when there is no such view."""
    return dict(_rows(
        conn, tuple_row,
        "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)"
        " FROM pg_catalog.pg_attribute AS a"
        " WHERE a.attrelid = pg_catalog.to_regclass(%(view)s) AND a.attnum > 0"
        " AND NOT a.attisdropped",
        {"view": view},
    ))


def engine_schema_present(conn: Connection) -> bool:
    """Whether the database has the compaction schema at all (else: migrate first)."""
    return bool(_row(conn, tuple_row,
                     "SELECT pg_catalog.to_regnamespace('compaction') IS NOT NULL", {})[0])


#: Tables shaped as the OpenAI Agents SDK's SQLAlchemySession creates its messages table
#: (a session_id and a message_data column), with the tables beside them that have a
#: session_id but no message_data (its sessions table) - when compaction.source_messages
#: still reads the reference table. The recipe's views read the messages table, so once
#: it is installed nothing is found. Catalog reads only, by name rather than regclass (a
#: reader has no USAGE on compaction_source): any role may run it.
SDK_TABLES_SQL: Final = """
WITH relation AS (
    SELECT c.oid, n.nspname, c.relname
    FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE (n.nspname, c.relname) IN (('compaction', 'source_messages'),
                                     ('compaction_source', 'messages'))
), unmapped AS (
    SELECT EXISTS (
               SELECT FROM pg_catalog.pg_depend AS d
               JOIN pg_catalog.pg_rewrite AS r
                 ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = r.oid
               JOIN relation AS v ON v.oid = r.ev_class AND v.nspname = 'compaction'
               JOIN relation AS t ON t.oid = d.refobjid AND t.nspname = 'compaction_source')
           AS yes
), tables AS (
    SELECT n.nspname AS schema_name, c.relname AS table_name,
           EXISTS (SELECT FROM pg_catalog.pg_attribute AS a
                   WHERE a.attrelid = c.oid AND a.attname = 'message_data'
                     AND NOT a.attisdropped) AS messages
    FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.relkind IN ('r', 'p')
      AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'compaction',
                            'compaction_source')
      AND EXISTS (SELECT FROM pg_catalog.pg_attribute AS a
                  WHERE a.attrelid = c.oid AND a.attname = 'session_id'
                    AND NOT a.attisdropped)
)
SELECT m.schema_name, m.table_name,
       ARRAY(SELECT s.table_name FROM tables AS s
             WHERE s.schema_name = m.schema_name AND NOT s.messages
             ORDER BY s.table_name)
FROM tables AS m, unmapped
WHERE m.messages AND unmapped.yes
ORDER BY m.schema_name, m.table_name
"""


def unmapped_sdk_tables(conn: Connection) -> list[tuple[str, str, list[str]]]:
    """(schema, messages table, candidate sessions tables) of each table that looks like
    the Agents SDK's messages table while the source views read the reference tables."""
    return _rows(conn, tuple_row, SDK_TABLES_SQL, {})


def tracked_by_message_id(conn: Connection) -> bool:
    """Whether some table carries an enabled tracking trigger that names its message id
    column (a table without a run column: the Agents SDK recipe's), whose inserts ask for
    the message just before the new ones."""
    return bool(_row(conn, tuple_row,
                     "SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger AS t"
                     " WHERE t.tgfoid = pg_catalog.to_regprocedure("
                     "'compaction.track_source_changes()') AND t.tgnargs = 3"
                     " AND t.tgenabled <> 'D')", {})[0])


def source_has_runs(conn: Connection) -> bool:
    """Whether compaction.source_runs has any row."""
    return bool(_row(conn, tuple_row,
                     "SELECT EXISTS (SELECT FROM compaction.source_runs)", {})[0])


def derived_state_status(conn: Connection) -> str:
    """in_use, not_rebuilt or untracked (compaction.derived_state_status())."""
    return str(_row(conn, tuple_row, "SELECT compaction.derived_state_status()", {})[0])


def _citus_installed(conn: Connection) -> bool:
    """Whether Citus's catalog exists here: asked first, by name, by every question put
    to it (pg_dist_partition exists only where the extension is installed)."""
    return bool(_row(conn, tuple_row,
                     "SELECT pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL",
                     {})[0])


def engine_distributed(conn: Connection) -> bool:
    """Whether Citus distributes the engine's tables (compaction.distribute_on_citus)."""
    if not _citus_installed(conn):
        return False
    return bool(_row(conn, tuple_row,
                     "SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition"
                     " WHERE logicalrelid = 'compaction.jobs'::regclass)", {})[0])


def tracking_on_citus(conn: Connection) -> list[tuple[str, str]]:
    """(table, trigger) for each change-tracking or queue trigger on a table that Citus
    distributes: a trigger that cannot run on the shards, so every write to the table
    fails there (revision 0042 refuses to attach one; a trigger made by hand, or kept by a
    table distributed after it was tracked, remains). None where Citus is absent."""
    if not _citus_installed(conn):
        return []
    rows = _rows(conn, tuple_row,
                 "SELECT t.tgrelid::regclass::text, pg_catalog.quote_ident(t.tgname)"
                 " FROM pg_catalog.pg_trigger AS t"
                 " JOIN pg_catalog.pg_dist_partition AS p ON p.logicalrelid = t.tgrelid"
                 " WHERE NOT t.tgisinternal AND t.tgfoid IN ("
                 "pg_catalog.to_regprocedure('compaction.track_source_changes()'),"
                 " pg_catalog.to_regprocedure('compaction.source_enqueue()'))"
                 " ORDER BY 1, 2", {})
    return [(str(table), str(trigger)) for table, trigger in rows]


#: The engine's lookups through the source views (sql/20_pairs.sql, the tracking in
#: sql/25_tracking.sql to sql/28_rebuild.sql, sql/60_projection.sql and
#: sql/61_projection_read.sql) by name, as check-source probes them: a conversation's
#: runs, a run by its id (the tracking triggers ask which conversation each written run
#: belongs to), a run's user and assistant messages, a text by message id. `{}` stands
#: for the looked-up value (a literal, so EXPLAIN shows the plan for it); each statement's
#: first column is the next lookup's value.
SOURCE_LOOKUPS: Final[dict[str, str]] = {
    "runs_by_conversation":
        "SELECT r.run_id, r.status FROM compaction.source_runs AS r"
        " WHERE r.conversation_id = {}",
    "run_by_id":
        "SELECT r.run_id, r.conversation_id, r.status FROM compaction.source_runs AS r"
        " WHERE r.run_id = {}",
    "messages_by_run":
        "SELECT m.message_id, m.role, m.status, pg_catalog.octet_length(m.content), m.seq"
        " FROM compaction.source_messages AS m"
        " WHERE m.run_id = {} AND m.role IN ('user', 'assistant')",
    "message_by_id":
        "SELECT m.content FROM compaction.source_messages AS m WHERE m.message_id = {}",
    # What the tracking asks on each insert into a table tracked by message id: the run
    # of the message just before the new ones (here: before none, the conversation's last).
    "message_before":
        "SELECT m.run_id FROM compaction.source_messages AS m"
        " WHERE m.conversation_id = {}"
        " AND (m.seq, m.message_id) < (9223372036854775807::bigint, '')"
        " ORDER BY m.seq DESC, m.message_id DESC LIMIT 1",
}


@dataclass(frozen=True, slots=True)
class LookupProbe:
    """One probed lookup: its wall time on this connection (None when it ran past the
    timeout), the first column of its first row, its plan under the session's own planner
    settings and statistics (what the engine's calls get), and its plan with sequential
    scans disabled, and sorts too for an ordered lookup (whether any index can serve it at
    all)."""

    milliseconds: float | None
    first: str | None
    plan: dict[str, Any]
    index_plan: dict[str, Any]


def probe_lookup(conn: Connection, lookup: str, value: str, timeout_ms: int, *,
                 ordered: bool = False) -> LookupProbe:
    """Run SOURCE_LOOKUPS[lookup] for `value` once (timed, bounded by `timeout_ms`), then
    EXPLAIN it as the planner plans it and again with sequential scans disabled, so a
    lookup no index serves shows a scan of the whole table. Read-only (fine on a hot
    standby) and rolled back, as a savepoint inside a caller's transaction, so the
    settings never outlive it."""
    query = sql.SQL(SOURCE_LOOKUPS[lookup]).format(sql.Literal(value))
    explain = sql.SQL("EXPLAIN (VERBOSE, FORMAT JSON) {}").format(query)
    own = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    milliseconds: float | None = None
    first: str | None = None
    with wrap_exceptions():
        try:
            with conn.transaction(force_rollback=True), conn.cursor() as cur:
                if own:
                    cur.execute("SET TRANSACTION READ ONLY")
                cur.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)",
                            (str(timeout_ms),))
                started = time.perf_counter()
                rows = cur.execute(query).fetchall()
                milliseconds = (time.perf_counter() - started) * 1000
                first = str(rows[0][0]) if rows else None
        except psycopg.errors.QueryCanceled:
            pass  # slow: judged from the plans alone, below
        with conn.transaction(force_rollback=True), conn.cursor() as cur:
            if own:
                cur.execute("SET TRANSACTION READ ONLY")
            plan = cur.execute(explain).fetchall()[0][0][0]["Plan"]
            cur.execute("SELECT pg_catalog.set_config('enable_seqscan', 'off', true)")
            if ordered:  # its order matters: a sort left in this plan no index can spare
                cur.execute("SELECT pg_catalog.set_config('enable_sort', 'off', true)")
            index_plan = cur.execute(explain).fetchall()[0][0][0]["Plan"]
    return LookupProbe(milliseconds, first, plan, index_plan)


@dataclass(frozen=True, slots=True)
class IndexStatistics:
    """An index a lookup's plan uses, its table's size in pages, and whether the planner
    has statistics for the table and for the index's expressions (None: this login may not
    see them, so check-source does not judge)."""

    index: str
    table: str
    pages: int
    expressions: bool
    table_statistics: bool | None
    index_statistics: bool | None


#: pg_stats shows a table's (and an expression index's) statistics only to a login that
#: may read the table (own it, for an index): for any other the answer is NULL.
INDEX_STATISTICS_SQL: Final = """
SELECT i.indexrelid::regclass::text,
       -- Quoted as SQL needs it (issue 62): advice prints it, --fix runs it.
       pg_catalog.quote_ident(tn.nspname) || '.' || pg_catalog.quote_ident(t.relname),
       (pg_catalog.pg_relation_size(i.indrelid)
        / pg_catalog.current_setting('block_size')::int)::int,
       i.indexprs IS NOT NULL,
       CASE WHEN pg_catalog.has_table_privilege(i.indrelid, 'SELECT') THEN
           EXISTS (SELECT FROM pg_catalog.pg_stats AS s
                   WHERE s.schemaname = tn.nspname AND s.tablename = t.relname)
       END,
       CASE WHEN i.indexprs IS NULL THEN true
            WHEN pg_catalog.pg_has_role(t.relowner, 'USAGE') THEN
           EXISTS (SELECT FROM pg_catalog.pg_stats AS s
                   WHERE s.schemaname = tn.nspname AND s.tablename = ic.relname)
       END
FROM pg_catalog.pg_index AS i
JOIN pg_catalog.pg_class AS ic ON ic.oid = i.indexrelid
JOIN pg_catalog.pg_class AS t ON t.oid = i.indrelid
JOIN pg_catalog.pg_namespace AS tn ON tn.oid = t.relnamespace
WHERE ic.relname = ANY (%(names)s::text[])
  AND (%(tables)s::text[] IS NULL OR t.relname = ANY (%(tables)s::text[]))
ORDER BY 1
"""


def index_statistics(conn: Connection, names: list[str],
                     tables: list[str] | None = None) -> list[IndexStatistics]:
    """The indexes of these names (on tables of these names, when given): their tables'
    sizes and whether the planner has their statistics."""
    return [IndexStatistics(str(r[0]), str(r[1]), int(r[2]), bool(r[3]), r[4], r[5])
            for r in _rows(conn, tuple_row, INDEX_STATISTICS_SQL,
                           {"names": names, "tables": tables})]


def table_pages(conn: Connection, schema: str | None, name: str) -> int:
    """A table's size now, in pages (its size on disk, not the planner's estimate); 0 when
    no table has that name. Found in the catalog by name, not through regclass, which
    needs USAGE on the table's schema (a reader has none on the host's schema). The
    names are the catalog's, unquoted (a schema may hold a dot)."""
    schema = schema or ""
    return int(_row(conn, tuple_row,
                    "SELECT coalesce(max((pg_catalog.pg_relation_size(c.oid)"
                    " / pg_catalog.current_setting('block_size')::int)::int), 0)"
                    " FROM pg_catalog.pg_class AS c"
                    " JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace"
                    " WHERE c.relname = %(name)s"
                    "   AND (n.nspname = %(schema)s"
                    "        OR (%(schema)s = '' AND pg_catalog.pg_table_is_visible(c.oid)))",
                    {"schema": schema, "name": name})[0])


def quoted_name(conn: Connection, schema: str | None, name: str) -> str:
    """A catalog name (and its schema), quoted as SQL needs it, by the server's own
    quote_ident (keywords too): what check-source prints and --fix runs. A name from a
    plan is the host's, and may hold anything (`x; DROP TABLE public.pwn; --`, a dot)."""
    return str(_row(conn, tuple_row,
                    "SELECT coalesce(pg_catalog.quote_ident(%(schema)s::text) || '.', '')"
                    " || pg_catalog.quote_ident(%(name)s::text)",
                    {"schema": schema, "name": name})[0])


def drop_trigger_statement(table: str, trigger: str) -> str:
    """What check-source advises for a tracking trigger on a table Citus distributes;
    `table` and `trigger` quoted already (regclass and quote_ident print them so)."""
    return f"DROP TRIGGER {trigger} ON {table};"


def create_index_statement(table: str, expression: str) -> str:
    """What check-source advises for a lookup no index serves: built CONCURRENTLY, so the
    host's writes go on while it builds (it must run outside a transaction block).
    `table` is quoted already (quoted_name), `expression` as the server deparsed it."""
    return f"CREATE INDEX CONCURRENTLY ON {table} (({expression}));"


def analyze_statement(table: str) -> str:
    """What check-source advises for a table without planner statistics (it also takes
    the statistics of the table's expression indexes); `table` is quoted already."""
    return f"ANALYZE {table};"


# --- projection reads (pycompactor.projection runs them, sync or async) -----------------

#: One statement and its parameters, for either driver.
Query = tuple[LiteralString, dict[str, Any]]

#: The snapshot of a projection when the caller has no transaction: one read-only
#: repeatable-read transaction (fine on a hot standby; transaction-scoped, so fine under
#: PgBouncer transaction pooling).
PROJECTION_SNAPSHOT_SQL: Final = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


def projection_pairs_query(conversation_id: str) -> Query:
    """Rows (pair_index, user_message_id, assistant_message_id, user_bytes,
    assistant_bytes): every eligible pair's metadata, no text (what a projection reads
    from a schema before revision 0041 without its derived state)."""
    return ("SELECT pair_index, user_message_id, assistant_message_id, user_bytes,"
            " assistant_bytes FROM compaction.indexed_pairs(%(conversation_id)s::text)",
            {"conversation_id": conversation_id})


def projection_summaries_query(conversation_id: str, scope: str) -> Query:
    """Rows (summary_id, from_pair, to_pair, source_message_ids, source_hash,
    prompt_version, projectable, completed_at, summary_bytes, source_current,
    version_rank): every completed summary's metadata, no text (what a projection reads
    from a schema before revision 0041 without its derived state; such a schema has no
    model preference, revision 0048, so model_rank is not asked for)."""
    return ("SELECT summary_id, from_pair, to_pair, source_message_ids, source_hash,"
            " prompt_version, projectable, completed_at, summary_bytes, source_current,"
            " version_rank"
            " FROM compaction.projection_summaries(%(conversation_id)s::text,"
            " %(scope)s::text)",
            {"conversation_id": conversation_id, "scope": scope})


#: With the first read of a projection on an autocommit connection, in the same pipeline:
#: the snapshot without a round trip of its own (ended by PROJECTION_END_SQL, sent with
#: the texts).
PROJECTION_BEGIN_SQL: Final = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
PROJECTION_END_SQL: Final = "COMMIT"
#: Ends that snapshot when a read failed.
PROJECTION_ABORT_SQL: Final = "ROLLBACK"


def projection_frame_query(conversation_id: str, scope: str, pairs: int) -> Query:
    """One row (derived, pair_count, first_pair, user_message_ids, assistant_message_ids,
    user_bytes, assistant_bytes, summary_ids, summary_from_pairs, summary_reasons,
    summary_bytes): the newest `pairs` pairs' metadata and every summary's verdict, while
    the derived state is in use (derived is false otherwise)."""
    return ("SELECT derived, pair_count, first_pair, user_message_ids, assistant_message_ids,"
            " user_bytes, assistant_bytes, summary_ids, summary_from_pairs, summary_reasons,"
            " summary_bytes FROM compaction.projection_frame(%(conversation_id)s::text,"
            " %(scope)s::text, %(pairs)s::int)",
            {"conversation_id": conversation_id, "scope": scope, "pairs": pairs})


def projection_read_query(conversation_id: str, scope: str, pairs: int, budget: int,
                          marker_bytes: int) -> Query:
    """Rows of compaction.projection_read: first projection_frame's row (its 11 columns,
    then message_id, summary_id, content NULL), then one (11 NULLs, message_id,
    summary_id, content) per text the engine's walk of that frame includes under
    `budget` bytes. The frame covers the newest `pairs` pairs, or more when the walk
    needed older ones (the statement reads them itself); no text rows when the derived
    state is not in use."""
    return ("SELECT derived, pair_count, first_pair, user_message_ids, assistant_message_ids,"
            " user_bytes, assistant_bytes, summary_ids, summary_from_pairs, summary_reasons,"
            " summary_bytes, message_id, summary_id, content"
            " FROM compaction.projection_read(%(conversation_id)s::text, %(scope)s::text,"
            " %(pairs)s::int, %(budget)s::bigint, %(marker_bytes)s::int)",
            {"conversation_id": conversation_id, "scope": scope, "pairs": pairs,
             "budget": budget, "marker_bytes": marker_bytes})


def projection_texts_query(conversation_id: str, message_ids: Sequence[str],
                           summary_ids: Sequence[int]) -> Query:
    """Rows (message_id, summary_id, content): the texts a plan includes."""
    return ("SELECT message_id, summary_id, content FROM compaction.projection_texts("
            "%(conversation_id)s::text, %(message_ids)s::text[], %(summary_ids)s::bigint[])",
            {"conversation_id": conversation_id, "message_ids": list(message_ids),
             "summary_ids": list(summary_ids)})


# --- async callers (the SDK session wrappers) --------------------------------------------

async def aenqueue(conn: psycopg.AsyncConnection[Any], conversation_id: str,
                   scope: str = "default") -> None:
    """`enqueue` on an async connection (its own statement, in the caller's transaction
    if there is one)."""
    with wrap_exceptions():
        await conn.execute(_ENQUEUE_SQL, {"conversation_id": conversation_id, "scope": scope})


async def awal_insert_lsn(conn: psycopg.AsyncConnection[Any]) -> str:
    """`wal_insert_lsn` on an async connection."""
    with wrap_exceptions():
        cur = await conn.execute(_WAL_INSERT_LSN_SQL)
        row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def areplayed(conn: psycopg.AsyncConnection[Any], lsn: str) -> bool:
    """`replayed` on an async connection."""
    with wrap_exceptions():
        cur = await conn.execute(_REPLAYED_SQL, {"lsn": lsn})
        row = await cur.fetchone()
    return bool(row and row[0])
