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

This module holds the worker's calls (and their async forms); the call machinery and
connections live in `pycompactor.dbcall`, the audit, report, setup and projection reads
in `pycompactor.dbread`. Every name of those two is re-exported here (see `__all__`), so
callers keep importing from `pycompactor.db`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg.rows import class_row, tuple_row
from psycopg.types.json import Jsonb

from pycompactor.dbcall import (
    _IDLE,
    _KV_PASSWORD,
    _PIPELINE_OFF,
    _URI_PASSWORD,
    DEFAULT_TIMEOUTS,
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS,
    READ_ONLY_TIMEOUTS_SQL,
    TIMEOUTS_SQL,
    Connection,
    Row,
    Timeouts,
    _Call,
    _call,
    _composable,
    _expect_an_error_at_the_sync,
    _malformed_dsn,
    _ms,
    _row,
    _rows,
    _timeouts,
    check_client_encoding,
    connect,
    describe_target,
    dsn_passwords,
    resolve_dsn,
    timeouts_of,
)
from pycompactor.dbread import (
    _AUDIT_MODELS_SQL,
    AUDIT_REPORTS,
    AUDIT_VIEWS,
    AUDIT_VIEWS_PER_SCOPE,
    INDEX_STATISTICS_SQL,
    PROJECTION_ABORT_SQL,
    PROJECTION_BEGIN_SQL,
    PROJECTION_END_SQL,
    PROJECTION_SNAPSHOT_SQL,
    SDK_TABLES_SQL,
    SOURCE_LOOKUPS,
    IndexStatistics,
    LookupProbe,
    Query,
    _citus_installed,
    analyze_statement,
    audit,
    audit_models,
    conversations_after,
    create_index_statement,
    derived_state_status,
    drop_trigger_statement,
    engine_distributed,
    engine_schema_present,
    index_statistics,
    probe_lookup,
    projection_frame_query,
    projection_models,
    projection_read_query,
    projection_texts_query,
    quoted_name,
    set_projection_models,
    source_has_runs,
    summary_verdicts_by_model,
    table_pages,
    tracked_by_message_id,
    tracking_on_citus,
    unmapped_sdk_tables,
    unqueued_targets,
    untracked_source_tables,
    view_columns,
)
from pycompactor.errors import (
    InvalidArgument,
    PermissionDenied,
    ReadOnlyServer,
    wrap_exceptions,
)
from pycompactor.models import (
    AckResult,
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

#: Every name this module offers: its own calls and, re-exported so that `pycompactor.db`
#: stays the one place to import them from, the call machinery of `pycompactor.dbcall`
#: and the reads and reports of `pycompactor.dbread`.
__all__ = [
    "AUDIT_REPORTS",
    "AUDIT_VIEWS",
    "AUDIT_VIEWS_PER_SCOPE",
    "CLAIM_BATCH_LIMIT",
    "DEFAULT_LEASE",
    "DEFAULT_TIMEOUTS",
    "DEQUEUE_LIMIT",
    "INDEX_STATISTICS_SQL",
    "LEASE_BOUNDS",
    "MAX_TIMEOUT_MS",
    "MAY_READ_ATTEMPTS_SQL",
    "MIN_TIMEOUT_MS",
    "PROJECTION_ABORT_SQL",
    "PROJECTION_BEGIN_SQL",
    "PROJECTION_END_SQL",
    "PROJECTION_SNAPSHOT_SQL",
    "READ_ONLY_TIMEOUTS_SQL",
    "SDK_TABLES_SQL",
    "SOURCE_LOOKUPS",
    "STATS_KEYS",
    "TIMEOUTS_SQL",
    "WORKER_ACCESS_SQL",
    "WORKER_FUNCTIONS",
    "_AUDIT_MODELS_SQL",
    "_ENQUEUE_SQL",
    "_IDLE",
    "_KV_PASSWORD",
    "_PIPELINE_OFF",
    "_REPLAYED_SQL",
    "_URI_PASSWORD",
    "_WAL_INSERT_LSN_SQL",
    "Connection",
    "IndexStatistics",
    "LookupProbe",
    "Query",
    "Row",
    "Timeouts",
    "_Call",
    "_call",
    "_check_count",
    "_citus_installed",
    "_composable",
    "_expect_an_error_at_the_sync",
    "_lease_params",
    "_malformed_dsn",
    "_ms",
    "_row",
    "_rows",
    "_timeouts",
    "ack",
    "aenqueue",
    "analyze_statement",
    "areplayed",
    "audit",
    "audit_models",
    "awal_insert_lsn",
    "check_client_encoding",
    "check_worker_access",
    "claim",
    "claim_next_targets",
    "claim_targets",
    "complete",
    "connect",
    "conversations_after",
    "create_index_statement",
    "dequeue",
    "derived_state_status",
    "describe_target",
    "drop_trigger_statement",
    "dsn_passwords",
    "eligible_pairs",
    "engine_distributed",
    "engine_schema_present",
    "enqueue",
    "erase_conversation",
    "explain_runs",
    "fail",
    "heartbeat",
    "import_summary",
    "index_statistics",
    "may_read_attempts",
    "plan_targets",
    "probe_lookup",
    "projection_frame_query",
    "projection_models",
    "projection_read_query",
    "projection_texts_query",
    "quoted_name",
    "range_attempts",
    "range_replies",
    "reap",
    "release",
    "replayed",
    "reply_problem",
    "resolve_dsn",
    "set_projection_models",
    "source_has_runs",
    "source_hash",
    "source_holds",
    "summaries",
    "summary_bindings",
    "summary_verdicts_by_model",
    "table_pages",
    "timeouts_of",
    "tracked_by_message_id",
    "tracking_on_citus",
    "unmapped_sdk_tables",
    "unqueued_targets",
    "untracked_source_tables",
    "view_columns",
    "wal_insert_lsn",
    "worker_targets",
]

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
    state in use, the range's current hash; judged from the views, and on Citus, the
    hash of the ids of the job claimed with `source_hash`, else the current range's."""
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
#: Most queue entries one dequeue leases (else CP020).
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
