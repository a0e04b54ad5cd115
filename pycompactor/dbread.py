"""The reads and reports of `pycompactor.db` that the worker does not make: audit views
and reports, projection preferences, setup and doctor probes (engine schema, SDK tables,
Citus, source lookups, index statistics) and the statements a projection runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, LiteralString

import psycopg
from psycopg import sql
from psycopg.rows import dict_row, tuple_row

from pycompactor.dbcall import Connection, _call, _row, _rows
from pycompactor.errors import (
    wrap_exceptions,
)
from pycompactor.models import (
    AuditReport,
)

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
    """(table, trigger) for each queue trigger on a table that Citus distributes: it
    writes the queue, placed apart from the conversation's shards, which a trigger on a
    shard may not, so every write to the table fails there (distribute_on_citus detaches
    the reference tables'; one made by hand remains). The change-tracking triggers run on
    the shards and are not listed. None where Citus is absent."""
    if not _citus_installed(conn):
        return []
    rows = _rows(conn, tuple_row,
                 "SELECT t.tgrelid::regclass::text, pg_catalog.quote_ident(t.tgname)"
                 " FROM pg_catalog.pg_trigger AS t"
                 " JOIN pg_catalog.pg_dist_partition AS p ON p.logicalrelid = t.tgrelid"
                 " WHERE NOT t.tgisinternal"
                 " AND t.tgfoid = pg_catalog.to_regprocedure('compaction.source_enqueue()')"
                 " ORDER BY 1, 2", {})
    return [(str(table), str(trigger)) for table, trigger in rows]


def untracked_source_tables(conn: Connection) -> list[str]:
    """The tables the source views read (through any depth of views) that lack an
    enabled-always change-tracking trigger for some event: what to attach the tracking to
    (compaction.attach_source_tracking) before a rebuild puts the derived state in use."""
    rows = _rows(conn, tuple_row,
                 "SELECT c.oid::regclass::text FROM pg_catalog.pg_class AS c"
                 " WHERE c.relkind IN ('r', 'p')"
                 " AND c.oid IN (SELECT d.refobjid FROM pg_catalog.pg_depend AS d"
                 "  WHERE d.classid = 'pg_catalog.pg_rewrite'::regclass"
                 "  AND d.refclassid = 'pg_catalog.pg_class'::regclass)"
                 " AND compaction.source_reads(c.oid)"
                 # every event tracked, as source_stamp asks (tgtype bits: 4 insert,
                 # 8 delete, 16 update, 32 truncate)
                 " AND NOT coalesce((SELECT pg_catalog.bit_or(t.tgtype::int) & 60 = 60"
                 "  FROM pg_catalog.pg_trigger AS t"
                 "  WHERE t.tgrelid = c.oid AND t.tgenabled = 'A'"
                 "  AND t.tgfoid"
                 "   = pg_catalog.to_regprocedure('compaction.track_source_changes()')), false)"
                 " ORDER BY 1", {})
    return [str(table) for (table,) in rows]


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
       -- Quoted as SQL needs it: advice prints it, --fix runs it.
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
