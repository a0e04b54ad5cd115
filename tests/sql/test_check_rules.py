"""The rules the tables' CHECK constraints call, and what a write pays for them.

PostgreSQL prepares a table's CHECK expressions again in every statement that writes the
table: it reads each one's stored form and plans it, and a LANGUAGE sql function it calls
is inlined there, its body parsed anew each time. So the rules a CHECK calls are PL/pgSQL
(compiled once per session), and the cheaper form of valid_source_hash
must answer exactly what its regular expression did.
"""

from __future__ import annotations

from typing import Any

import psycopg

Conn = psycopg.Connection[Any]

# Every function a CHECK constraint of the engine's tables calls, with its language.
CHECK_FUNCTIONS = """
SELECT DISTINCT c.conrelid::regclass::text AS table_name, c.conname,
       p.oid::regprocedure::text AS function, l.lanname
FROM pg_catalog.pg_constraint AS c
JOIN pg_catalog.pg_depend AS d
  ON d.classid = 'pg_catalog.pg_constraint'::regclass AND d.objid = c.oid
 AND d.refclassid = 'pg_catalog.pg_proc'::regclass
JOIN pg_catalog.pg_proc AS p ON p.oid = d.refobjid
JOIN pg_catalog.pg_language AS l ON l.oid = p.prolang
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.connamespace
WHERE c.contype = 'c' AND n.nspname IN ('compaction', 'compaction_source')
ORDER BY 1, 2, 3
"""


def test_no_check_constraint_calls_an_sql_function(conn: Conn) -> None:
    """An SQL function in a CHECK is parsed again by every statement that writes the
    table (summary_problem and valid_source_hash as SQL functions were 6.1% of a claim ->
    complete cycle's instructions)."""
    calls = conn.execute(CHECK_FUNCTIONS).fetchall()
    # The rules are there to be found: the catalog query sees the calls it judges.
    assert ("compaction.jobs", "jobs_rules",
            "compaction.job_rules_hold(integer,integer,text[],text,text,text,text)",
            "plpgsql") in calls
    assert ("compaction.job_summaries", "job_summaries_summary_valid",
            "compaction.summary_problem(text)", "plpgsql") in calls
    assert [row for row in calls if row[3] == "sql"] == []


# Strings around the edges of '^[0-9a-f]{64}$': lengths 63-65, characters just outside
# the set (upper case, 'g', '/', ':', '`'), multibyte characters (64 bytes in fewer
# characters, or 64 characters in more bytes), a newline the pattern's '$' must not
# accept, spaces, the empty string and NULL.
EDGE_CASES = """
SELECT v FROM (VALUES
    (NULL::text), (''), (repeat('a', 64)), (repeat('0', 64)), (repeat('f', 64)),
    (repeat('a', 63)), (repeat('a', 65)), (repeat('A', 64)), (repeat('a', 63) || 'g'),
    (repeat('a', 63) || '/'), (repeat('a', 63) || ':'), (repeat('a', 63) || '`'),
    ('G' || repeat('a', 63)), (repeat('a', 62) || 'é'), (repeat('a', 63) || 'é'),
    (repeat('a', 64) || E'\\n'), (repeat('a', 63) || E'\\n'), (' ' || repeat('a', 63)),
    (repeat('a', 63) || ' '), (repeat('a', 32) || ' ' || repeat('a', 31)),
    (encode(sha256('x'), 'hex')), (upper(encode(sha256('x'), 'hex')))
) AS t (v)
"""
# Random strings of 63 to 65 characters, each hexadecimal but for one in 200, drawn from
# the edges' alphabet: about a quarter are 64 hexadecimal characters. (`0 * g` ties the
# subquery to its row, so that it is evaluated for each.)
RANDOM_STRINGS = """
SELECT (SELECT string_agg(CASE WHEN random() < 0.995
                               THEN substr('0123456789abcdef', 1 + floor(random() * 16)::int, 1)
                               ELSE substr('Ag/:`é ' || E'\\n', 1 + floor(random() * 8)::int, 1)
                          END, '')
        FROM generate_series(1, 63 + floor(random() * 3)::int + 0 * g)) AS v
FROM generate_series(1, 4000) AS g
"""


def test_valid_source_hash_answers_what_its_pattern_did(conn: Conn) -> None:
    conn.execute("SELECT pg_catalog.setseed(0.32)")
    strings = [v for (v,) in conn.execute(EDGE_CASES).fetchall()]
    strings += [v for (v,) in conn.execute(RANDOM_STRINGS).fetchall()]
    rows = conn.execute(
        "SELECT v, compaction.valid_source_hash(v), v IS NOT NULL AND v ~ '^[0-9a-f]{64}$'"
        " FROM pg_catalog.unnest(%s::text[]) AS t (v)", (strings,)).fetchall()
    assert [r for r in rows if r[1] is not r[2]] == []
    # Both answers occur, so the comparison could have failed either way.
    accepted = sum(1 for r in rows if r[1])
    assert 500 < accepted < len(rows) - 500, accepted
