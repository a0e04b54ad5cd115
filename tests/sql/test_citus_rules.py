"""Static Citus conformance (contract §11): the rules that let the engine run on Citus,
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

Conn = psycopg.Connection[Any]

# The change-tracking and queue triggers of the source tables: the documented exception
# (contract §2, §11), detached by distribute_on_citus.
SOURCE_TRIGGER_FUNCTIONS = {"compaction.track_source_changes", "compaction.source_enqueue"}
# Derived-state maintenance (contract §2) and its oracle: run by the source tables'
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
    "compaction.reap",             # settles each conversation by reap_conversation
    "compaction.dequeue",          # leases each candidate by its own row
    "compaction.stale_summaries",  # audit: source_hash per range, on the coordinator
    "compaction.distribute_on_citus",  # the placement itself (DDL)
    "compaction.place_audit_views",    # the audit views' form (DDL)
    # audit: a view's rows with the owner's rights, on the coordinator
    "compaction.read_audit_jobs",
    "compaction.read_audit_exhausted",
    "compaction.read_audit_queue",
    "compaction.read_audit_events",
    # the owner's model preference: re-judges each conversation that has a verdict by
    # rederive_summary_verdicts, one conversation per statement
    "compaction.set_projection_models",
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


Catalog = tuple[dict[str, str], list[Function], set[str]]


def read_catalog(conn: Conn) -> Catalog:
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


# ---------------------------------------------------------------------------------------
# The rules, each returning what breaks it (empty: the rule holds)
# ---------------------------------------------------------------------------------------

def unplaced_tables(conn: Conn) -> list[str]:
    """Tables missing from citus_tables(), or placed against their kind: per-conversation
    tables (they hold a conversation_id) are distributed, the others reference tables."""
    placed = placements(conn)
    tables = dict(conn.execute("""
        SELECT c.oid::regclass::text,
               EXISTS (SELECT 1 FROM pg_attribute AS a WHERE a.attrelid = c.oid
                       AND a.attname = 'conversation_id' AND NOT a.attisdropped)
        FROM pg_class AS c
        WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND c.relkind IN ('r', 'p') AND c.relname <> 'alembic_version'
    """).fetchall())
    kinds = {t: ("distributed" if per else "reference") for t, per in tables.items()}
    return sorted(t for t in set(kinds) | set(placed) if kinds.get(t) != placed.get(t))


def unique_indexes_not_led_by_conversation(conn: Conn) -> list[str]:
    return [r[0] for r in conn.execute("""
        SELECT i.indexrelid::regclass::text
        FROM pg_index AS i
        JOIN compaction.citus_tables() AS ct ON ct.table_name::regclass = i.indrelid
        WHERE ct.placement = 'distributed' AND i.indisunique
          AND (SELECT a.attname FROM pg_attribute AS a
               WHERE a.attrelid = i.indrelid AND a.attnum = i.indkey[0])
              IS DISTINCT FROM 'conversation_id'
        ORDER BY 1
    """).fetchall()]


def foreign_keys_across_shards(conn: Conn) -> list[str]:
    """Keys into a distributed table must lead with conversation_id on both sides; a
    reference table never refers to a distributed one; keys into reference tables are
    fine (those are on every node)."""
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
    return [name for name, src, dst, first, ref_first in rows
            if (src, dst) == ("reference", "distributed")
            or (dst == "distributed"
                and (first, ref_first) != ("conversation_id", "conversation_id"))]


def node_bound_ids(conn: Conn) -> list[str]:
    """Identity columns (Citus refuses to distribute them), and sequence defaults that are
    not bigint (Citus gives each node its own range only of a bigint sequence)."""
    rows = conn.execute("""
        SELECT a.attrelid::regclass::text || '.' || a.attname, a.attidentity,
               a.atttypid::regtype::text,
               coalesce(pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%', false)
        FROM pg_attribute AS a
        JOIN compaction.citus_tables() AS ct ON ct.table_name::regclass = a.attrelid
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1
    """).fetchall()
    return [c for c, identity, kind, is_sequence in rows
            if identity != "" or (is_sequence and kind != "bigint")]


def triggers_reaching_other_rows(conn: Conn, catalog: Catalog) -> list[str]:
    placed, functions, views = catalog
    touching = readers(functions, set(placed) | views)
    triggers = conn.execute("""
        SELECT t.tgrelid::regclass::text, t.tgname,
               p.pronamespace::regnamespace || '.' || p.proname
        FROM pg_trigger AS t JOIN pg_proc AS p ON p.oid = t.tgfoid
        JOIN compaction.citus_tables() AS ct ON ct.table_name::regclass = t.tgrelid
        WHERE NOT t.tgisinternal
        ORDER BY 1, 2
    """).fetchall()
    assert triggers, "no triggers found: the query is wrong"
    return [f"{table}.{name}" for table, name, fn in triggers
            if fn in touching and not (table.startswith("compaction_source.")
                                       and fn in SOURCE_TRIGGER_FUNCTIONS)]


def functions_without_their_conversation(catalog: Catalog) -> list[str]:
    placed, functions, views = catalog
    touching = readers(functions, distributed(placed, views))
    return [f.signature for f in functions
            if f.name in touching and "p_conversation_id" not in f.args
            and f.name not in FAN_OUT | SOURCE_TRIGGER_FUNCTIONS | DERIVED_STATE]


def row_locks_across_conversations(catalog: Catalog) -> list[str]:
    placed, functions, views = catalog
    shards = distributed(placed, views)
    return [f.signature for f in functions for statement in statements(f.body)
            if ROW_LOCK.search(statement)
            and any(mentions(statement, r) for r in shards)
            # the operator spelled out, as SET-less functions do
            and not re.search(r"conversation_id\s*(=|OPERATOR\(pg_catalog\.=\))",
                              statement)]


def sql_functions_reading_shards(catalog: Catalog) -> list[str]:
    placed, functions, views = catalog
    shards = distributed(placed, views)
    return [f.signature for f in functions
            if f.language == "sql" and any(mentions(f.body, r) for r in shards)]


def nested_engine_readers(catalog: Catalog) -> list[str]:
    placed, functions, views = catalog
    shards = distributed(placed, views)
    engine_readers = readers(functions, set(placed) | views)
    return [f"{f.signature}: {', '.join(sorted(nested))}"
            for f in functions if f.name not in DERIVED_STATE | SOURCE_TRIGGER_FUNCTIONS
            for statement in statements(f.body)
            if any(mentions(statement, r) for r in shards)
            and (nested := calls(statement, functions) & engine_readers)]


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------

def test_every_engine_table_has_its_placement(conn: Conn) -> None:
    assert unplaced_tables(conn) == []
    steps = [r[0] for r in conn.execute(
        "SELECT placement FROM compaction.citus_tables() ORDER BY step").fetchall()]
    assert steps == sorted(steps, key=lambda p: p != "reference")


def test_conversation_id_leads_every_unique_index(conn: Conn) -> None:
    assert unique_indexes_not_led_by_conversation(conn) == []


def test_foreign_keys_lead_with_conversation_id_or_name_a_reference_table(conn: Conn) -> None:
    assert foreign_keys_across_shards(conn) == []


def test_no_identity_columns_and_sequences_are_bigint(conn: Conn) -> None:
    assert node_bound_ids(conn) == []


def test_triggers_on_engine_tables_touch_only_their_own_row(conn: Conn) -> None:
    assert triggers_reaching_other_rows(conn, read_catalog(conn)) == []


def test_functions_on_per_conversation_rows_take_the_conversation(conn: Conn) -> None:
    assert functions_without_their_conversation(read_catalog(conn)) == []


def test_row_locks_address_one_conversation(conn: Conn) -> None:
    assert row_locks_across_conversations(read_catalog(conn)) == []


def test_no_sql_function_reads_shards(conn: Conn) -> None:
    # Citus cannot plan a query with parameters inside a SQL-language function.
    assert sql_functions_reading_shards(read_catalog(conn)) == []


def test_no_statement_nests_an_engine_reader_in_a_read_of_shards(conn: Conn) -> None:
    # Citus pushes a function called inside a query on distributed tables down to the
    # shards, where a function that itself reads engine tables cannot run: such results
    # are taken into variables first, then passed in.
    assert nested_engine_readers(read_catalog(conn)) == []


def test_each_rule_catches_a_broken_copy(conn: Conn) -> None:
    """The rules can fail: one breakage per rule, in this test's own database."""
    conn.execute("""
        CREATE TABLE compaction.stray (id int PRIMARY KEY);
        CREATE UNIQUE INDEX bad_jobs_key ON compaction.jobs (job_id, conversation_id);
        ALTER TABLE compaction.attempts
            ADD CONSTRAINT bad_attempts_fkey FOREIGN KEY (job_id, conversation_id)
            REFERENCES compaction.jobs (job_id, conversation_id);
        ALTER TABLE compaction.queue ADD COLUMN bad_id int GENERATED ALWAYS AS IDENTITY;
        CREATE FUNCTION compaction.bad_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO compaction.event_log (conversation_id, kind, occurred_at)
            VALUES (NEW.conversation_id, 'claim', now());
            RETURN NULL;
        END $$;
        CREATE TRIGGER bad_trigger AFTER INSERT ON compaction.jobs
            FOR EACH ROW EXECUTE FUNCTION compaction.bad_trigger();
        CREATE FUNCTION compaction.bad_count(p_scope text) RETURNS bigint LANGUAGE sql AS $$
            SELECT count(*) FROM compaction.jobs AS j WHERE j.scope = p_scope
        $$;
        CREATE FUNCTION compaction.bad_lock(p_conversation_id text) RETURNS void
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM 1 FROM compaction.queue AS q WHERE q.scope = 'default'
            FOR UPDATE SKIP LOCKED;
            PERFORM 1 FROM compaction.jobs AS j
            JOIN compaction.indexed_pairs(p_conversation_id) AS i ON i.pair_index = j.from_pair
            WHERE j.conversation_id = p_conversation_id;
        END $$;
    """)
    catalog = read_catalog(conn)
    assert unplaced_tables(conn) == ["compaction.stray"]
    assert unique_indexes_not_led_by_conversation(conn) == ["compaction.bad_jobs_key"]
    assert foreign_keys_across_shards(conn) == ["bad_attempts_fkey"]
    assert node_bound_ids(conn) == ["compaction.queue.bad_id"]
    assert triggers_reaching_other_rows(conn, catalog) == ["compaction.jobs.bad_trigger"]
    assert functions_without_their_conversation(catalog) == [
        "compaction.bad_count(text)", "compaction.bad_trigger()"]
    assert row_locks_across_conversations(catalog) == ["compaction.bad_lock(text)"]
    assert sql_functions_reading_shards(catalog) == ["compaction.bad_count(text)"]
    assert nested_engine_readers(catalog) == ["compaction.bad_lock(text): compaction.indexed_pairs"]
