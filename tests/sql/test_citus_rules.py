"""Static Citus conformance (DESIGN §11): the rules that let the engine run on Citus,
read from the catalog of a database migrated on plain PostgreSQL. `make test-citus`
proves them on a real cluster; this proves them on every `make test`, without Citus.

compaction.citus_tables() is the list distribute_on_citus() applies: the rules are
checked against it, and it against the catalog. Function bodies are read as text
(PL/pgSQL keeps no dependencies), statement by statement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

Conn = psycopg.Connection[Any]

# The change-tracking and queue triggers of the source tables: the documented exception
# (DESIGN §2, §11), detached by distribute_on_citus.
SOURCE_TRIGGER_FUNCTIONS = {"compaction.track_source_changes", "compaction.source_enqueue"}
# Derived-state maintenance (DESIGN §2) and its oracle: run by the source tables'
# tracking triggers and by repairs. On Citus the tracking triggers are detached and the
# derived state is not kept, so none of these runs there.
DERIVED_STATE = {
    "compaction.rederive", "compaction.rederive_runs", "compaction.rederive_general",
    "compaction.rederive_conversation", "compaction.rebuild_derived_state",
    "compaction.stamp_derived_state", "compaction.verify_conversation",
}
# Functions that work across conversations by design: each finds conversations with a
# plain read and then addresses one conversation per statement (rule: row locks).
FAN_OUT = {
    "compaction.reap",            # settles each conversation by reap_conversation
    "compaction.dequeue",         # leases each candidate by its own row
    "compaction.stale_summaries",  # audit: source_hash per range
    "compaction.rebuild_derived_state",  # batches of rederive_conversation
    "compaction.source_stamp",    # catalogs and source_tracking (a reference table)
    "compaction.derived_state_current",
    "compaction.derived_state_status",
    "compaction.stamp_derived_state",
    "compaction.distribute_on_citus",
}


ROW_LOCK = re.compile(
    r"\bFOR\s+(UPDATE|SHARE|NO\s+KEY\s+UPDATE|KEY\s+SHARE)\b|\bSKIP\s+LOCKED\b", re.IGNORECASE)


@dataclass(frozen=True)
class Function:
    name: str
    signature: str
    language: str
    args: list[str]
    body: str


def placements(conn: Conn) -> dict[str, str]:
    return dict(conn.execute(
        "SELECT table_name, placement FROM compaction.citus_tables()").fetchall())


def engine_functions(conn: Conn) -> list[Function]:
    rows = conn.execute("""
        SELECT p.pronamespace::regnamespace || '.' || p.proname, p.oid::regprocedure::text,
               l.lanname, coalesce(p.proargnames, '{}'), p.prosrc
        FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
        WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND l.lanname IN ('sql', 'plpgsql')
        ORDER BY 2
    """).fetchall()
    return [Function(n, s, lang, list(args), strip_comments(src))
            for n, s, lang, args, src in rows]


def strip_comments(source: str) -> str:
    """The code only: comments and string literals (error messages name tables) go."""
    return re.sub(r"'(?:[^']|'')*'", "''", re.sub(r"--[^\n]*", "", source))


def statements(body: str) -> list[str]:
    """The SQL statements of a body: split at semicolons and at LOOP, the conditions of IF
    and ELSIF dropped (PL/pgSQL evaluates those as expressions of their own)."""
    body = re.sub(r"\b(ELS)?IF\b.*?\bTHEN\b", ";", body, flags=re.IGNORECASE | re.DOTALL)
    return [s for s in re.split(r";|\bLOOP\b", body, flags=re.IGNORECASE) if s.strip()]


def mentions(text: str, name: str) -> bool:
    """Whether the text reads or writes the relation (a row type of the same name is no read)."""
    return re.search(rf"\b(FROM|JOIN|UPDATE|INTO|TABLE)\s+{re.escape(name)}(?!\w)", text,
                     re.IGNORECASE) is not None


def calls(text: str, functions: list[Function]) -> set[str]:
    return {f.name for f in functions if re.search(rf"{re.escape(f.name)}\s*\(", text)}


@pytest.fixture
def catalog(conn: Conn) -> tuple[dict[str, str], list[Function], set[str]]:
    placed = placements(conn)
    functions = engine_functions(conn)
    # Relations a body may read: the tables, and the views over them (the source views
    # read the source tables, the public views the engine's).
    views = {r[0] for r in conn.execute(
        "SELECT c.oid::regclass::text FROM pg_class AS c WHERE c.relkind = 'v'"
        " AND c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)"
    ).fetchall()}
    return placed, functions, views


def distributed(placed: dict[str, str], views: set[str]) -> set[str]:
    """Relations whose rows live on the shards: distributed tables and the views on them."""
    return {t for t, p in placed.items() if p == "distributed"} | views


def readers(functions: list[Function], relations: set[str]) -> set[str]:
    """Functions that read any of the relations, directly or through functions they call."""
    direct = {f.name for f in functions if any(mentions(f.body, r) for r in relations)}
    found = set(direct)
    while True:
        more = {f.name for f in functions
                if f.name not in found and calls(f.body, functions) & found}
        if not more:
            return found
        found |= more


def test_every_engine_table_has_a_placement(conn: Conn) -> None:
    placed = placements(conn)
    tables = dict(conn.execute("""
        SELECT c.oid::regclass::text,
               EXISTS (SELECT 1 FROM pg_attribute AS a WHERE a.attrelid = c.oid
                       AND a.attname = 'conversation_id' AND NOT a.attisdropped)
        FROM pg_class AS c
        WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND c.relkind IN ('r', 'p') AND c.relname <> 'alembic_version'
    """).fetchall())
    assert set(placed) == set(tables)
    # Per-conversation tables (they hold a conversation_id) are distributed; the global
    # ones are reference tables.
    assert {t: ("distributed" if per else "reference") for t, per in tables.items()} == placed
    steps = [r[0] for r in conn.execute(
        "SELECT placement FROM compaction.citus_tables() ORDER BY step").fetchall()]
    assert steps == sorted(steps, key=lambda p: p != "reference")


def test_conversation_id_leads_every_unique_index(conn: Conn) -> None:
    offenders = conn.execute("""
        SELECT i.indexrelid::regclass::text
        FROM pg_index AS i
        JOIN compaction.citus_tables() AS ct ON ct.table_name::regclass = i.indrelid
        WHERE ct.placement = 'distributed' AND i.indisunique
          AND (SELECT a.attname FROM pg_attribute AS a
               WHERE a.attrelid = i.indrelid AND a.attnum = i.indkey[0])
              IS DISTINCT FROM 'conversation_id'
    """).fetchall()
    assert offenders == []


def test_foreign_keys_lead_with_conversation_id_or_name_a_reference_table(conn: Conn) -> None:
    rows = conn.execute("""
        SELECT f.conname, src.placement, dst.placement,
               (SELECT a.attname FROM pg_attribute AS a
                WHERE a.attrelid = f.conrelid AND a.attnum = f.conkey[1]),
               (SELECT a.attname FROM pg_attribute AS a
                WHERE a.attrelid = f.confrelid AND a.attnum = f.confkey[1])
        FROM pg_constraint AS f
        JOIN compaction.citus_tables() AS src ON src.table_name::regclass = f.conrelid
        JOIN compaction.citus_tables() AS dst ON dst.table_name::regclass = f.confrelid
        WHERE f.contype = 'f'
        ORDER BY 1
    """).fetchall()
    assert rows, "no foreign keys found: the query is wrong"
    bad = [name for name, src, dst, first, ref_first in rows
           if (src, dst) == ("reference", "distributed")
           or (dst == "distributed" and (first, ref_first) != ("conversation_id",
                                                               "conversation_id"))]
    assert bad == []


def test_no_identity_columns_and_sequences_are_bigint(conn: Conn) -> None:
    rows = conn.execute("""
        SELECT a.attrelid::regclass::text || '.' || a.attname, a.attidentity,
               a.atttypid::regtype::text,
               pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%'
        FROM pg_attribute AS a
        JOIN compaction.citus_tables() AS ct ON ct.table_name::regclass = a.attrelid
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attnum > 0 AND NOT a.attisdropped
    """).fetchall()
    assert [c for c, identity, _, _ in rows if identity != ""] == []
    # Citus gives each node its own range of a sequence only when it is bigint.
    assert [c for c, _, kind, is_sequence in rows if is_sequence and kind != "bigint"] == []


def test_triggers_on_engine_tables_touch_only_their_own_row(
        conn: Conn, catalog: tuple[dict[str, str], list[Function], set[str]]) -> None:
    placed, functions, views = catalog
    relations = set(placed) | views
    touching = readers(functions, relations)
    triggers = conn.execute("""
        SELECT t.tgrelid::regclass::text, t.tgname,
               p.pronamespace::regnamespace || '.' || p.proname
        FROM pg_trigger AS t JOIN pg_proc AS p ON p.oid = t.tgfoid
        JOIN compaction.citus_tables() AS ct ON ct.table_name::regclass = t.tgrelid
        WHERE NOT t.tgisinternal
    """).fetchall()
    assert triggers, "no triggers found: the query is wrong"
    bad = [(table, name, fn) for table, name, fn in triggers
           if fn in touching and not (table.startswith("compaction_source.")
                                      and fn in SOURCE_TRIGGER_FUNCTIONS)]
    assert bad == []


def test_functions_on_per_conversation_rows_take_the_conversation(
        catalog: tuple[dict[str, str], list[Function], set[str]]) -> None:
    placed, functions, views = catalog
    touching = readers(functions, distributed(placed, views))
    bad = [f.signature for f in functions
           if f.name in touching and "p_conversation_id" not in f.args
           and f.name not in FAN_OUT and f.name not in SOURCE_TRIGGER_FUNCTIONS]
    assert bad == []


def test_row_locks_address_one_conversation(
        catalog: tuple[dict[str, str], list[Function], set[str]]) -> None:
    placed, functions, views = catalog
    shards = distributed(placed, views)
    bad = []
    for f in functions:
        for statement in statements(f.body):
            if not ROW_LOCK.search(statement):
                continue
            if any(mentions(statement, r) for r in shards) and not re.search(
                    r"conversation_id\s*=", statement):
                bad.append((f.signature, " ".join(statement.split())[:120]))
    assert bad == []


def test_no_sql_function_reads_shards(
        catalog: tuple[dict[str, str], list[Function], set[str]]) -> None:
    # Citus cannot plan a query with parameters inside a SQL-language function.
    placed, functions, views = catalog
    shards = distributed(placed, views)
    bad = [f.signature for f in functions
           if f.language == "sql" and any(mentions(f.body, r) for r in shards)]
    assert bad == []


def test_no_statement_nests_an_engine_reader_in_a_read_of_shards(
        catalog: tuple[dict[str, str], list[Function], set[str]]) -> None:
    # Citus pushes a function called inside a query on distributed tables down to the
    # shards, where a function that itself reads engine tables cannot run: such results
    # are taken into variables first, then passed in.
    placed, functions, views = catalog
    shards = distributed(placed, views)
    engine_readers = readers(functions, set(placed) | views)
    bad = []
    for f in functions:
        if f.name in DERIVED_STATE or f.name in SOURCE_TRIGGER_FUNCTIONS:
            continue
        for statement in statements(f.body):
            if not any(mentions(statement, r) for r in shards):
                continue
            nested = calls(statement, functions) & engine_readers
            if nested:
                bad.append((f.signature, sorted(nested)))
    assert bad == []
