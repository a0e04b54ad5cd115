"""Connections and one typed method per stored function (results as frozen dataclasses).

SQL text for the engine's interface lives here and in sql/; nothing else in the package
builds SQL. The worker's calls (claim, complete, fail, heartbeat, reap, enqueue, dequeue,
ack, release and the reads it plans from) each run in their own short transaction that
first sets `lock_timeout` and `statement_timeout` transaction-locally
(`set_config(..., true)`, i.e. SET LOCAL): a lock held by a hung session costs a worker
one lock_timeout, never a hang, and no session state is left behind, so all of this
works through PgBouncer in transaction pooling mode. Each such call costs one network
round trip: the settings and the call travel in one pipeline that ends with a single
Sync, which (with no BEGIN) delimits the call's transaction (see `_call`).
"""

from __future__ import annotations

import os
import re
import urllib.parse
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Generic, LiteralString, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import RowFactory, class_row, dict_row, tuple_row
from psycopg.types.json import Jsonb

from pycompactor.errors import from_driver, wrap_exceptions
from pycompactor.models import (
    AckResult,
    AuditReport,
    ClaimResult,
    CompleteResult,
    FailResult,
    HeartbeatResult,
    Pair,
    QueuedConversation,
    RangeReply,
    RunVerdict,
    Target,
    WorkerTarget,
)

Connection = psycopg.Connection[Any]
Row = TypeVar("Row")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Per-call limits: how long to wait for a lock, and for a whole statement."""

    lock: timedelta = timedelta(seconds=5)
    statement: timedelta = timedelta(seconds=60)

    def __post_init__(self) -> None:
        # 0 would mean "no limit" to PostgreSQL: refuse it rather than silently hang.
        if self.lock <= timedelta(0) or self.statement <= timedelta(0):
            raise ValueError("lock and statement timeouts must be positive")


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

    def __init__(self, conn: Connection, cursor: psycopg.Cursor[Row]) -> None:
        self._conn = conn
        self._cursor = cursor

    def execute(self, query: LiteralString | sql.Composed, params: Mapping[str, Any]) -> None:
        timeouts = timeouts_of(self._conn)
        # Pipeline mode: the set_config statement, then the call, then one Sync. The
        # server runs them in order (lock_timeout is in force before the call takes a
        # lock; a statement's timeout starts with that statement), and the Sync ends the
        # transaction they share unless the caller has one open: it commits if both
        # succeeded, else rolls back. Nothing waits for a result in between.
        with self._conn.pipeline(), self._conn.cursor() as setup:
            setup.execute(READ_ONLY_TIMEOUTS_SQL if self._conn.read_only else TIMEOUTS_SQL,
                          {"lock_ms": _ms(timeouts.lock),
                           "statement_ms": _ms(timeouts.statement)})
            self._cursor.execute(query, params)

    def fetchone(self) -> Row | None:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Row]:
        return self._cursor.fetchall()

    @property
    def description(self) -> list[psycopg.Column] | None:
        return self._cursor.description


@contextmanager
def _call(conn: Connection, row_factory: RowFactory[Row]) -> Iterator[_Call[Row]]:
    """A cursor-like object whose one `execute` runs in a transaction with its lock and
    statement timeouts set LOCAL, in one network round trip.

    On an autocommit connection (ours) the call gets its own transaction: the statements
    go in one pipeline without BEGIN, and the Sync that closes it commits them (or rolls
    them back on error), as the protocol defines for statements before a Sync outside a
    transaction block. A caller who manages transactions (autocommit off, or inside
    `conn.transaction()`) keeps them: the call joins that transaction, which the caller
    commits, and the settings last until it ends (still never beyond it).
    """
    with wrap_exceptions(), conn.cursor(row_factory=row_factory) as cur:
        yield _Call(conn, cur)


def resolve_dsn(dsn: str | None) -> str:
    """--dsn, else PYCOMPACTOR_DSN, else "" (libpq then reads PGHOST, PGDATABASE, ...)."""
    return dsn if dsn is not None else os.environ.get("PYCOMPACTOR_DSN", "")


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
    try:
        conn = psycopg.connect(
            conninfo, autocommit=autocommit, application_name="pycompactor",
            prepare_threshold=None,
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
    with _call(conn, class_row(Pair)) as cur:
        cur.execute(
            "SELECT pair_index, run_id, user_message_id, user_content,"
            " assistant_message_id, assistant_content"
            " FROM compaction.eligible_pairs(%(conversation_id)s::text)",
            {"conversation_id": conversation_id},
        )
        return cur.fetchall()


def plan_targets(conn: Connection, conversation_id: str) -> list[Target]:
    with _call(conn, class_row(Target)) as cur:
        cur.execute(
            "SELECT from_pair, to_pair, source_message_ids, source_hash"
            " FROM compaction.plan_targets(%(conversation_id)s::text)",
            {"conversation_id": conversation_id},
        )
        return cur.fetchall()


def worker_targets(conn: Connection, conversation_id: str, scope: str, model: str,
                   prompt_version: str) -> list[WorkerTarget]:
    """plan_targets, each with whether its identity already holds a completed summary."""
    with _call(conn, class_row(WorkerTarget)) as cur:
        cur.execute(
            "SELECT from_pair, to_pair, source_message_ids, source_hash, completed"
            " FROM compaction.worker_targets(%(conversation_id)s::text, %(scope)s::text,"
            " %(model)s::text, %(prompt_version)s::text)",
            {"conversation_id": conversation_id, "scope": scope, "model": model,
             "prompt_version": prompt_version},
        )
        return cur.fetchall()


def range_replies(conn: Connection, conversation_id: str, from_pair: int,
                  source_hash: str) -> list[RangeReply]:
    """The 10 assistant replies of a range, in pair order, only while its current source
    hash is `source_hash` (else none): the text a claimed attempt summarizes."""
    with _call(conn, class_row(RangeReply)) as cur:
        cur.execute(
            "SELECT pair_index, assistant_message_id, assistant_content"
            " FROM compaction.range_replies(%(conversation_id)s::text, %(from_pair)s::int,"
            " %(source_hash)s::text)",
            {"conversation_id": conversation_id, "from_pair": from_pair,
             "source_hash": source_hash},
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


#: The lease a claim or heartbeat grants unless told otherwise (the SQL default).
DEFAULT_LEASE = timedelta(minutes=5)


def claim(conn: Connection, conversation_id: str, scope: str, from_pair: int,
          source_message_ids: Sequence[str], source_hash: str, model: str,
          prompt_version: str, worker: str, *, lease: timedelta = DEFAULT_LEASE,
          now: datetime | None = None) -> ClaimResult:
    """Claim one attempt of an identity; refusals come back as reasons, never errors."""
    with _call(conn, class_row(ClaimResult)) as cur:
        cur.execute(
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
        )
        row = cur.fetchone()
        assert row is not None  # the function always returns exactly one row
        return row


def complete(conn: Connection, job_id: int, attempt: int, summary: str | None,
             finish_reason: str | None, tool_call_count: int, *,
             response_id: str | None = None, now: datetime | None = None,
             stats: Mapping[str, int] | None = None) -> CompleteResult:
    """Record attempt (job_id, attempt)'s result; fenced (lease_lost) and idempotent.

    `stats` is p_stats: any of input_tokens, output_tokens, figures_total, figures_kept
    (non-negative integers; the database refuses anything else with CP020).
    """
    with _call(conn, class_row(CompleteResult)) as cur:
        cur.execute(
            "SELECT ok, reason, summary_id FROM compaction.complete("
            "p_job_id => %(job_id)s::bigint, p_attempt => %(attempt)s::int,"
            " p_summary => %(summary)s::text, p_finish_reason => %(finish_reason)s::text,"
            " p_tool_call_count => %(tool_call_count)s::int,"
            " p_response_id => %(response_id)s::text, p_now => %(now)s::timestamptz,"
            " p_stats => %(stats)s::jsonb)",
            {"job_id": job_id, "attempt": attempt, "summary": summary,
             "finish_reason": finish_reason, "tool_call_count": tool_call_count,
             "response_id": response_id, "now": now,
             "stats": None if stats is None else Jsonb(dict(stats))},
        )
        row = cur.fetchone()
        assert row is not None
        return row


def fail(conn: Connection, job_id: int, attempt: int, reason: str, *,
         now: datetime | None = None) -> FailResult:
    """Record attempt (job_id, attempt) failed with the worker's reason; fenced."""
    with _call(conn, class_row(FailResult)) as cur:
        cur.execute(
            "SELECT ok, reason FROM compaction.fail("
            "p_job_id => %(job_id)s::bigint, p_attempt => %(attempt)s::int,"
            " p_reason => %(reason)s::text, p_now => %(now)s::timestamptz)",
            {"job_id": job_id, "attempt": attempt, "reason": reason, "now": now},
        )
        row = cur.fetchone()
        assert row is not None
        return row


def heartbeat(conn: Connection, job_id: int, attempt: int, *,
              lease: timedelta = DEFAULT_LEASE, now: datetime | None = None) -> HeartbeatResult:
    """Renew the lease of running attempt (job_id, attempt); ok=False when fenced off."""
    with _call(conn, class_row(HeartbeatResult)) as cur:
        cur.execute(
            "SELECT ok, lease_expires_at FROM compaction.heartbeat("
            "p_job_id => %(job_id)s::bigint, p_attempt => %(attempt)s::int,"
            " p_lease => %(lease)s::interval, p_now => %(now)s::timestamptz)",
            {"job_id": job_id, "attempt": attempt, "lease": lease, "now": now},
        )
        row = cur.fetchone()
        assert row is not None
        return row


def reap(conn: Connection, *, now: datetime | None = None) -> int:
    """Fail (lease_expired) every running attempt whose lease ran out; returns how many."""
    with _call(conn, tuple_row) as cur:
        cur.execute("SELECT compaction.reap(p_now => %(now)s::timestamptz)", {"now": now})
        row = cur.fetchone()
        assert row is not None
        return int(row[0])


def enqueue(conn: Connection, conversation_id: str, scope: str = "default") -> None:
    """Mark a conversation as having new history (hosts that re-point the source views)."""
    with _call(conn, tuple_row) as cur:
        cur.execute(
            "SELECT compaction.enqueue(p_conversation_id => %(conversation_id)s::text,"
            " p_scope => %(scope)s::text)",
            {"conversation_id": conversation_id, "scope": scope},
        )


#: Longest and shortest lease compaction.dequeue grants (as for claims).
QUEUE_LEASE_BOUNDS: Final = (timedelta(seconds=1), timedelta(days=1))


def dequeue(conn: Connection, limit: int = 100, *, scope: str = "default",
            lease: timedelta = DEFAULT_LEASE) -> list[QueuedConversation]:
    """Lease up to `limit` visible entries of `scope`, oldest first (one statement).

    Leased entries stay queued, hidden from other workers until the lease ends; the
    caller acknowledges each once it has examined the conversation (`ack`), or gives it
    back unexamined (`release`). A lease that runs out makes the entry visible again.
    """
    with _call(conn, class_row(QueuedConversation)) as cur:
        cur.execute(
            "SELECT conversation_id, scope, enqueued_at, lease_token, lease_expires_at"
            " FROM compaction.dequeue(p_scope => %(scope)s::text, p_limit => %(limit)s::int,"
            " p_lease => %(lease)s::interval)",
            {"scope": scope, "limit": limit, "lease": lease},
        )
        return cur.fetchall()


def ack(conn: Connection, entry: QueuedConversation) -> AckResult:
    """The leased entry's conversation was examined: remove it, unless an enqueue landed
    during the lease (`requeued`: it waits again). ok=False `lease_lost` otherwise."""
    with _call(conn, class_row(AckResult)) as cur:
        cur.execute(
            "SELECT ok, reason FROM compaction.ack("
            "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
            " p_lease_token => %(lease_token)s::uuid)",
            _lease_params(entry),
        )
        row = cur.fetchone()
        assert row is not None
        return row


def release(conn: Connection, entry: QueuedConversation) -> AckResult:
    """Give a leased entry back unexamined: visible again in its original place."""
    with _call(conn, class_row(AckResult)) as cur:
        cur.execute(
            "SELECT ok, reason FROM compaction.release("
            "p_conversation_id => %(conversation_id)s::text, p_scope => %(scope)s::text,"
            " p_lease_token => %(lease_token)s::uuid)",
            _lease_params(entry),
        )
        row = cur.fetchone()
        assert row is not None
        return row


def _lease_params(entry: QueuedConversation) -> dict[str, object]:
    return {"conversation_id": entry.conversation_id, "scope": entry.scope,
            "lease_token": entry.lease_token}


def import_summary(conn: Connection, conversation_id: str, scope: str, from_pair: int,
                   source_message_ids: Sequence[str], source_hash: str, model: str,
                   prompt_version: str, summary: str, completed_at: datetime) -> int:
    """Record a summary made by an earlier system; returns its summary_id (CP00x on bad shape)."""
    with wrap_exceptions(), conn.cursor() as cur:
        cur.execute(
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
        )
        row = cur.fetchone()
        assert row is not None
        return int(row[0])


def erase_conversation(conn: Connection, conversation_id: str, reason: str) -> int:
    """Erase a conversation's engine rows (owner/admin only); returns summaries removed."""
    with wrap_exceptions(), conn.cursor() as cur:
        cur.execute(
            "SELECT compaction.erase_conversation(p_conversation_id => %(conversation_id)s::text,"
            " p_reason => %(reason)s::text)",
            {"conversation_id": conversation_id, "reason": reason},
        )
        row = cur.fetchone()
        assert row is not None
        return int(row[0])


#: Audit views by short name, with the order that puts the newest first (the queue:
#: one row per scope, by scope).
AUDIT_VIEWS: dict[str, tuple[str, str]] = {
    "jobs": ("audit_jobs", "created_at DESC, job_id DESC, attempt NULLS FIRST"),
    "stale": ("audit_stale_summaries", "completed_at DESC, summary_id DESC"),
    "exhausted": ("audit_exhausted", "exhausted_at DESC, job_id DESC"),
    "events": ("audit_events", "event_id DESC"),
    "queue": ("audit_queue", "scope"),
}
#: Views without a conversation_id column (a conversation filter does not apply).
AUDIT_VIEWS_PER_SCOPE: Final = frozenset({"queue"})


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
