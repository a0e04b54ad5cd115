"""The source contract check behind `pycompactor check-source`.

Verifies that compaction.source_runs / compaction.source_messages exist with the
contract's columns and types, samples conversations to show which runs are excluded
from pairing and why, and probes every lookup the engine and its tracking triggers make
through the views (runs by conversation, a run by its id, messages by run, a message by
its id) on the live data: each is run once (bounded by a timeout) and EXPLAINed twice,
as the planner plans it with the session's settings and the live statistics (what the
engine's calls get), and with sequential scans disabled (whether any index can serve it
at all). A lookup that no index can serve (a missing index, or a view that derives its
columns over the whole table, such as a window function), one the planner still answers
by reading a table whole, and an index it uses on a table with no statistics (a fresh
expression index before ANALYZE) are problems, each naming the statement that fixes it.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final

from psycopg import sql

from pycompactor import db
from pycompactor.errors import SchemaNotMigrated

#: The source contract (contract §2): view -> column -> type.
CONTRACT: dict[str, dict[str, str]] = {
    "source_runs": {"run_id": "text", "conversation_id": "text", "status": "text"},
    "source_messages": {
        "message_id": "text",
        "conversation_id": "text",
        "run_id": "text",
        "role": "text",
        "status": "text",
        "content": "text",
        "seq": "bigint",
    },
}


@dataclass(frozen=True, slots=True)
class ConversationSample:
    conversation_id: str
    runs: int
    pairs: int
    excluded: dict[str, int]


#: What `compaction.derived_state_status()` answers, as check-source explains it.
DERIVED_STATE_NOTES: dict[str, str] = {
    "in_use": "in use (the tables behind the views are tracked)",
    "not_rebuilt": "not in use: the views or their tracking triggers changed since the last"
                   " rebuild; run `pycompactor migrate` or CALL compaction.rebuild_derived_state()",
    "untracked": "not in use: some table behind the source views has no tracking triggers,"
                 " so every call judges from the views (exact, slower); attach them"
                 " (docs/integrating.md)",
}

#: On Citus the tracking triggers run on the shards as on one node; untracked,
#: check-source names the tables to attach them to (SourceReport.untracked).
DISTRIBUTED_UNTRACKED_NOTE = (
    "not in use on Citus: some table behind the source views has no tracking triggers,"
    " so every call judges from the views on the node that holds the conversation"
    " (exact, slower); attach them on the coordinator and rebuild (docs/operations.md,"
    " \"Scaling out with Citus\")")


@dataclass(frozen=True, slots=True)
class Lookup:
    """One lookup the engine makes through a source view, as check-source probes it."""

    name: str  # a key of db.SOURCE_LOOKUPS
    view: str
    column: str


#: The engine's lookups through the views, in probing order (db.SOURCE_LOOKUPS holds
#: their statements): a conversation's runs, a run by its id (what the tracking triggers
#: ask of every written run), a run's user and assistant messages, texts by message id.
LOOKUPS: Final = (
    Lookup("runs_by_conversation", "compaction.source_runs", "conversation_id"),
    Lookup("run_by_id", "compaction.source_runs", "run_id"),
    Lookup("messages_by_run", "compaction.source_messages", "run_id"),
    Lookup("message_by_id", "compaction.source_messages", "message_id"),
)

#: Asked by the tracking of a table without a run column on every insert (the message just
#: before the new ones, newest first by seq); probed only where such a table is tracked.
MESSAGE_BEFORE: Final = Lookup("message_before", "compaction.source_messages", "seq")

#: How long one probe may run before check-source calls it slow and moves on.
LOOKUP_TIMEOUT_MS: Final = 10_000

#: Below this many pages (1 MiB at the default 8 kB page) reading a table whole costs about
#: as much as an index probe, and planner statistics hardly matter: such a table is never
#: a problem unless no index could serve the lookup at all.
SMALL_TABLE_PAGES: Final = 128


@dataclass(frozen=True, slots=True)
class LookupReport:
    """A probed lookup: its time on the live data (None when it timed out), whether the
    planner serves it with an index, and if not which table it reads whole; the table
    whose statistics are missing, if any; the advice and the statement that fixes it."""

    lookup: str
    view: str
    column: str
    value: str
    milliseconds: float | None
    uses_index: bool
    unindexed_table: str | None = None
    advice: str | None = None
    unanalyzed_table: str | None = None
    fix: str | None = None
    # No index gives the order an ordered lookup asks for: it sorts what it reads (a whole
    # conversation of unindexed_table) to keep one row.
    sorts: bool = False

    def problem(self) -> str | None:
        if self.uses_index and self.unanalyzed_table is None:
            return None
        took = (f"timed out after {LOOKUP_TIMEOUT_MS / 1000:.0f} s"
                if self.milliseconds is None else f"took {self.milliseconds:.1f} ms")
        if self.sorts:
            return (f"{self.view}: the lookup by {self.column} ({self.lookup}) has no index in"
                    f" its order: it sorts a conversation of {self.unindexed_table} whole"
                    f" ({took} for {self.value!r}); {self.advice}")
        if self.uses_index:
            return (f"{self.view}: the lookup by {self.column} ({self.lookup}) relies on"
                    f" {self.unanalyzed_table}, which has no planner statistics ({took} for"
                    f" {self.value!r}); {self.advice}")
        return (f"{self.view}: the lookup by {self.column} ({self.lookup}) uses no index:"
                f" it reads {self.unindexed_table} whole ({took} for {self.value!r});"
                f" {self.advice}")


@dataclass(frozen=True, slots=True)
class SourceReport:
    problems: list[str] = field(default_factory=list)
    samples: list[ConversationSample] = field(default_factory=list)
    derived_state: str | None = None
    lookups: list[LookupReport] = field(default_factory=list)
    distributed: bool = False  # the engine's tables distributed by Citus
    # Statements that fix problems other than the lookups' (queue triggers on Citus).
    statements: list[str] = field(default_factory=list)
    # Tables behind the source views without tracking triggers (what to attach).
    untracked: list[str] = field(default_factory=list)

    @property
    def derived_state_note(self) -> str | None:
        if self.derived_state is None:
            return None
        note = DERIVED_STATE_NOTES.get(self.derived_state, self.derived_state)
        if self.distributed and self.derived_state == "untracked":
            note = DISTRIBUTED_UNTRACKED_NOTE
        if self.untracked and self.derived_state == "untracked":
            note += "; tables without them: " + ", ".join(self.untracked) + (
                " (SELECT compaction.attach_source_tracking('<table>', '<conversation"
                " column>', '<run column>'); for each, then CALL"
                " compaction.rebuild_derived_state();)")
        return note

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def fixes(self) -> list[str]:
        """The statements that fix the problems, in order, each once."""
        return list(dict.fromkeys([*self.statements,
                                   *(r.fix for r in self.lookups if r.fix is not None
                                     and r.problem() is not None)]))

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "derived_state": self.derived_state,
            "samples": [
                {
                    "conversation_id": s.conversation_id,
                    "runs": s.runs,
                    "pairs": s.pairs,
                    "excluded": dict(s.excluded),
                }
                for s in self.samples
            ],
            "lookups": [
                {
                    "lookup": r.lookup,
                    "view": r.view,
                    "column": r.column,
                    "milliseconds": r.milliseconds,
                    "uses_index": r.uses_index,
                    "unanalyzed_table": r.unanalyzed_table,
                    "advice": r.advice,
                    "fix": r.fix,
                }
                for r in self.lookups
            ],
            "fixes": self.fixes,
        }


def contract_problems(conn: db.Connection) -> list[str]:
    """One sentence per missing view, missing column or mistyped column."""
    problems: list[str] = []
    for view, columns in CONTRACT.items():
        found = db.view_columns(conn, f"compaction.{view}")
        if not found:
            problems.append(f"view compaction.{view} is missing")
            continue
        for column, expected in columns.items():
            actual = found.get(column)
            if actual is None:
                problems.append(f"compaction.{view}.{column} is missing (expected {expected})")
            elif actual != expected:
                problems.append(
                    f"compaction.{view}.{column} is {actual}, expected {expected}"
                    f" (cast it in the view: {column}::{expected})"
                )
    return problems


def unmapped_sdk_tables(conn: db.Connection) -> list[str]:
    """One sentence per table that looks like the Agents SDK's SQLAlchemySession
    messages table while the source views read the reference tables, which hold no run:
    the engine sees none of that history until the recipe re-points the views."""
    hints: list[str] = []
    found = db.unmapped_sdk_tables(conn)
    # Asked only then: the views read the reference tables, so this is one index probe.
    if not found or db.source_has_runs(conn):
        return hints
    for schema, table, sessions in found:
        command = "pycompactor install-recipe agents-sqlalchemy"
        if schema != "public":
            command += f" --schema {shlex.quote(schema)}"
        if table != "agent_messages":
            command += f" --messages-table {shlex.quote(table)}"
        if "agent_sessions" not in sessions and len(sessions) == 1:
            command += f" --sessions-table {shlex.quote(sessions[0])}"
        name = db.quoted_name(conn, schema, table)
        hints.append(f"{name} looks like the OpenAI Agents SDK's SQLAlchemySession"
                     " table, but the source views read the empty reference tables of"
                     f" compaction_source: run `{command}` (docs/agents.md)")
    return hints


def citus_tracking_problems(conn: db.Connection) -> tuple[list[str], list[str]]:
    """One sentence per table that Citus distributes and that still carries the engine's
    queue triggers (they write the queue, placed apart from the shards, which a trigger on
    a shard may not, so every write to that table fails there), and the statements that
    drop them (contract §11)."""
    by_table: dict[str, list[str]] = {}
    for table, trigger in db.tracking_on_citus(conn):
        by_table.setdefault(table, []).append(db.drop_trigger_statement(table, trigger))
    problems = [
        f"{table} is distributed by Citus but carries the engine's queue triggers, which"
        f" cannot run on its shards: every write to it fails there. Drop them: {' '.join(drops)}"
        " (docs/operations.md, \"Scaling out with Citus\")"
        for table, drops in by_table.items()
    ]
    return problems, [drop for drops in by_table.values() for drop in drops]


def check_source(
    conn: db.Connection, conversation_ids: list[str] | None = None, sample: int = 5
) -> SourceReport:
    if not db.engine_schema_present(conn):
        raise SchemaNotMigrated()  # every view would be missing; the fix is one command
    problems = contract_problems(conn)
    if problems:
        return SourceReport(problems=problems)
    problems, statements = citus_tracking_problems(conn)
    problems += unmapped_sdk_tables(conn)
    if problems:
        return SourceReport(problems=problems, derived_state=db.derived_state_status(conn),
                            distributed=db.engine_distributed(conn), statements=statements)
    ids = conversation_ids or db.conversations_after(conn, "", sample)
    # The lookups first: while one reads a table whole, judging a sample's runs through
    # it would cost that read once per run, so the samples are left out.
    lookups = check_lookups(conn, ids[0]) if ids else []
    problems = [p for r in lookups if (p := r.problem()) is not None]
    samples = []
    for conversation_id in ids if not problems else []:
        verdicts = db.explain_runs(conn, conversation_id)
        excluded = Counter(v.reason for v in verdicts if v.reason is not None)
        samples.append(
            ConversationSample(
                conversation_id=conversation_id,
                runs=len(verdicts),
                pairs=sum(1 for v in verdicts if v.eligible),
                excluded=dict(sorted(excluded.items())),
            )
        )
    derived_state = db.derived_state_status(conn)
    return SourceReport(problems=problems, samples=samples,
                        derived_state=derived_state, lookups=lookups,
                        distributed=db.engine_distributed(conn),
                        untracked=(db.untracked_source_tables(conn)
                                   if derived_state == "untracked" else []))


def check_lookups(conn: db.Connection, conversation_id: str) -> list[LookupReport]:
    """Probe the engine's lookups on one conversation's live data, each value taken from
    the previous lookup's rows (a run of the conversation, a message of that run)."""
    reports: list[LookupReport] = []
    value: str | None = conversation_id
    for lookup in LOOKUPS:
        if value is None:
            break  # nothing to look up: the conversation has no runs, or the run no messages
        report, first = _probe(conn, lookup, value)
        reports.append(report)
        value = first
    if db.tracked_by_message_id(conn):
        reports.append(_probe_order(conn, MESSAGE_BEFORE, conversation_id))
    return reports


def _probe_order(conn: db.Connection, lookup: Lookup, value: str) -> LookupReport:
    """Probe an ordered lookup: as any lookup, and besides, a sort left in the plan with
    sorting disabled is one no index can spare. A table tracked by message id asks it on
    every insert, so a view whose seq no index orders sorts the conversation each time
    (the Agents SDK recipe's before its seq index: 12 ms an append at 740 items)."""
    probe = db.probe_lookup(conn, lookup.name, value, LOOKUP_TIMEOUT_MS, ordered=True)
    report = _judged(conn, lookup, value, probe)
    sort = next((n for n in _nodes(probe.index_plan) if n.get("Node Type") == "Sort"), None)
    if sort is None or not report.uses_index:
        return report
    first = _first_table(sort)
    scanned = None if first is None else db.quoted_name(conn, *first)
    keys = ", ".join(str(k) for k in sort.get("Sort Key", []))
    return replace(
        report, uses_index=False, sorts=True, unindexed_table=scanned,
        advice=(f"give {scanned} an index on the conversation column and the expression"
                f" behind {lookup.view}.{lookup.column} (the sort's key: {keys}), e.g. the"
                f" Agents SDK recipe's (session_id, (id::bigint)) for its m.id::bigint"
                f" (docs/integrating.md, tracking by message id)"))


def _probe(conn: db.Connection, lookup: Lookup, value: str) -> tuple[LookupReport, str | None]:
    """Probe one lookup (db.probe_lookup); returns the report and the first column of its
    first row (the next lookup's value)."""
    probe = db.probe_lookup(conn, lookup.name, value, LOOKUP_TIMEOUT_MS)
    return _judged(conn, lookup, value, probe), probe.first


def _judged(conn: db.Connection, lookup: Lookup, value: str,
            probe: db.LookupProbe) -> LookupReport:
    """A probed lookup's report: no index can serve it, the planner lacks statistics for
    the index that can, or prefers to read a large table whole; else fine."""
    report = LookupReport(lookup.name, lookup.view, lookup.column, value, probe.milliseconds,
                          True)
    whole = _whole_table_scan(probe.index_plan)
    if whole is not None:  # no index can serve it
        (schema, relation), node = whole
        table = db.quoted_name(conn, schema, relation)
        advice, fix = _advice(conn, lookup, table, node, value)
        return replace(report, uses_index=False, unindexed_table=table, advice=advice,
                       fix=fix)
    # An index can serve it: does the planner have what it needs to choose it?
    indexes = sorted({str(n["Index Name"]) for n in _nodes(probe.index_plan)
                      if "Index Name" in n})
    unanalyzed = [s for s in db.index_statistics(conn, indexes)
                  if s.pages >= SMALL_TABLE_PAGES
                  and (s.table_statistics is False or s.index_statistics is False)]
    if unanalyzed:
        stats = unanalyzed[0]
        what = ("its expression index " + stats.index if stats.table_statistics
                else "the table")
        report = replace(
            report, unanalyzed_table=stats.table, fix=db.analyze_statement(stats.table),
            advice=(f"without statistics on {what} the planner guesses how many rows match"
                    f" and may read the table whole; run ANALYZE {stats.table} (once the"
                    f" indexes exist: it also takes their expressions' statistics)"))
    whole = _whole_table_scan(probe.plan)
    if whole is not None and db.table_pages(conn, *whole[0]) >= SMALL_TABLE_PAGES:
        table = db.quoted_name(conn, *whole[0])
        if report.unanalyzed_table is not None:
            return replace(report, uses_index=False, unindexed_table=table)
        return replace(
            report, uses_index=False, unindexed_table=table,
            advice=(f"an index could serve it, but with the session's settings and the"
                    f" live statistics the planner prefers to read {table} whole; check"
                    f" enable_indexscan/random_page_cost and run ANALYZE {table}"),
            fix=db.analyze_statement(table))
    return report


# Plan nodes that read a table: a Seq Scan reads it whole; an index scan without an Index
# Cond reads the whole index (what the planner does with seqscan off when no index fits).
_TABLE_SCANS: Final = frozenset({"Seq Scan", "Index Scan", "Index Only Scan"})


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


#: A table as a plan names it: (schema or None, relation), both unquoted, as the catalog
#: holds them (either may hold a dot, a quote or a semicolon). Quoted only to be printed.
PlanTable = tuple[str | None, str]


def _first_table(plan: dict[str, Any]) -> PlanTable | None:
    for node in _nodes(plan):
        relation = node.get("Relation Name")
        if relation is not None:
            schema = node.get("Schema")
            return (str(schema) if schema else None), str(relation)
    return None


def _whole_table_scan(plan: dict[str, Any]) -> tuple[PlanTable, dict[str, Any]] | None:
    for node in _nodes(plan):
        if node.get("Node Type") in _TABLE_SCANS and "Index Cond" not in node:
            relation = node.get("Relation Name")
            if relation is None:
                continue
            schema = node.get("Schema")
            return ((str(schema) if schema else None), str(relation)), node
    return None


def _advice(conn: db.Connection, lookup: Lookup, table: str, node: dict[str, Any],
            value: str) -> tuple[str, str | None]:
    """The index that would serve the lookup, and the statement that makes it: on the
    expression the scan filters by, when the filter compares it with the looked-up value;
    else the view reads the table whole before it filters (a window function or aggregate
    over it), which no index fixes."""
    literal = sql.Literal(value).as_string(None)
    # The comparison's left side: an expression with at most one level of parentheses
    # inside, e.g. "((m.id)::text = '2'::text)" gives "(m.id)::text".
    match = re.search(r"\(((?:[^()]|\([^()]*\))+?) = " + re.escape(literal),
                      str(node.get("Filter", "")))
    if match is not None:
        expression = match.group(1)
        alias = node.get("Alias")
        if alias:
            # The plan deparses the alias quoted as SQL needs it.
            expression = expression.replace(f"{db.quoted_name(conn, None, str(alias))}.", "")
        # CONCURRENTLY: the host's writes go on while it builds (outside a transaction
        # block); ANALYZE after it gives the planner the expression's statistics.
        fix = db.create_index_statement(table, expression)
        return (f"an index on {table} (({expression})) would serve it (the expression"
                f" behind {lookup.view}.{lookup.column}, as the view exposes it): {fix}"
                f" then ANALYZE {table};"), fix
    return (f"{lookup.view} computes {lookup.column} over every row of {table} before it"
            f" filters (a window function or aggregate over the table?); derive it with"
            f" LATERAL lookups through indexes instead (docs/integrating.md,"
            f" \"Fast views\")"), None
