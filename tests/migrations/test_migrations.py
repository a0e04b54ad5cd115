"""The migrations build exactly what sql/ describes, and behave as an operator expects."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import schema
from pycompactor.errors import NotUtf8Database

NewDatabase = Callable[..., str]


def dump_schema(bindir: Path, dsn: str) -> str:
    """pg_dump of the engine's schemas (alembic's own version table left out)."""
    params = dict(item.split("=", 1) for item in dsn.split())
    result = subprocess.run(
        [str(bindir / "pg_dump"), "--schema-only", "--no-tablespaces",
         "--schema=compaction", "--schema=compaction_source",
         "--exclude-table=compaction.alembic_version",
         "-h", params["host"], "-p", params["port"], "-U", params["user"], params["dbname"]],
        capture_output=True, text=True, check=True,
    )
    # The header names the dump's origin; everything after it is the catalog.
    return "\n".join(line for line in result.stdout.splitlines()
                     if not line.startswith("-- Dumped from") and not line.startswith("\\"))


def version_row(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT version_num FROM compaction.alembic_version").fetchall()


def test_single_head() -> None:
    assert len(schema.heads()) == 1


def test_migrated_catalog_equals_sql_definition(
    pg_bindir: Path, new_database: NewDatabase
) -> None:
    from_sql = new_database()
    with psycopg.connect(from_sql) as conn:
        schema.apply_current_definition(conn)
    migrated = new_database()
    schema.upgrade(migrated)
    expected = dump_schema(pg_bindir, from_sql)
    assert "CREATE FUNCTION compaction.eligible_pairs" in expected
    assert dump_schema(pg_bindir, migrated) == expected, (
        "the migrated head differs from sql/: a released baseline or revision is frozen;"
        " add a revision (README.md, \"Changing the schema\")")


def test_downgrade_to_base_then_upgrade_round_trips(
    pg_bindir: Path, new_database: NewDatabase
) -> None:
    dsn = new_database()
    schema.upgrade(dsn)
    before = dump_schema(pg_bindir, dsn)
    schema.downgrade(dsn, "base")
    assert schema.current_revision(dsn) is None
    with psycopg.connect(dsn) as conn:
        leftovers = conn.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'compaction'::regnamespace"
            " AND c.relname NOT LIKE 'alembic_version%'"
                " AND c.relkind IN ('r', 'v', 'i', 'S')"
            " UNION ALL SELECT p.proname FROM pg_proc p"
            " WHERE p.pronamespace = 'compaction'::regnamespace"
        ).fetchall()
        assert leftovers == []
        assert conn.execute("SELECT to_regnamespace('compaction_source')").fetchone() == (None,)
    schema.upgrade(dsn)
    assert dump_schema(pg_bindir, dsn) == before
    assert schema.current_revision(dsn) == schema.heads()[0]


def test_each_revision_downgrades_one_step(pg_bindir: Path, new_database: NewDatabase) -> None:
    dsn = new_database()
    schema.upgrade(dsn)
    head_dump = dump_schema(pg_bindir, dsn)
    schema.downgrade(dsn, "-1")
    schema.upgrade(dsn)
    assert dump_schema(pg_bindir, dsn) == head_dump


def test_migrate_twice_is_a_noop(pg_bindir: Path, new_database: NewDatabase) -> None:
    dsn = new_database()
    schema.upgrade(dsn)
    first = dump_schema(pg_bindir, dsn)
    schema.upgrade(dsn)
    assert dump_schema(pg_bindir, dsn) == first
    assert version_row(dsn) == [(schema.heads()[0],)]


def test_version_table_lives_in_compaction_not_public(new_database: NewDatabase) -> None:
    dsn = new_database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A host application's own alembic history must be left alone.
        conn.execute("CREATE TABLE public.alembic_version (version_num varchar(32) PRIMARY KEY)")
        conn.execute("INSERT INTO public.alembic_version VALUES ('host_rev_42')")
    schema.upgrade(dsn)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT version_num FROM public.alembic_version").fetchall() == [
            ("host_rev_42",)
        ]
    assert version_row(dsn) == [(schema.heads()[0],)]


def test_engine_objects_belong_to_nologin_owner(conn: psycopg.Connection[Any]) -> None:
    owners = conn.execute(
        "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM pg_class c"
        " WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)"
        " AND c.relname NOT LIKE 'alembic_version%'"
        " UNION SELECT DISTINCT pg_get_userbyid(p.proowner) FROM pg_proc p"
        " WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)"
    ).fetchall()
    assert owners == [("compaction_owner",)]
    assert conn.execute(
        "SELECT rolcanlogin FROM pg_roles WHERE rolname = 'compaction_owner'"
    ).fetchone() == (False,)
    public_execute = conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p"
        " WHERE p.pronamespace = 'compaction'::regnamespace"
        " AND has_function_privilege('public', p.oid, 'EXECUTE')"
    ).fetchall()
    assert public_execute == []


def test_every_public_object_has_a_comment(conn: psycopg.Connection[Any]) -> None:
    uncommented = conn.execute(
        """
        SELECT c.oid::regclass::text FROM pg_class c
        WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND c.relkind IN ('r', 'v', 'p', 'm') AND c.relname <> 'alembic_version'
          AND obj_description(c.oid, 'pg_class') IS NULL
        UNION ALL
        SELECT p.oid::regprocedure::text FROM pg_proc p
        WHERE p.pronamespace = 'compaction'::regnamespace
          AND obj_description(p.oid, 'pg_proc') IS NULL
        ORDER BY 1
        """
    ).fetchall()
    assert uncommented == []


def test_non_utf8_database_is_refused(new_database: NewDatabase) -> None:
    dsn = new_database(encoding="LATIN1")
    with pytest.raises(NotUtf8Database, match="UTF8"):
        schema.upgrade(dsn)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('compaction.alembic_version')").fetchone() == (
            None,
        )


def test_cli_refuses_non_utf8_with_one_line(new_database: NewDatabase) -> None:
    dsn = new_database(encoding="SQL_ASCII")
    result = subprocess.run(
        [sys.executable, "-m", "pycompactor", "migrate", "--dsn", dsn],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "UTF8" in result.stderr
    assert "Traceback" not in result.stderr


def test_four_concurrent_migrate_processes(
    pg_bindir: Path, new_database: NewDatabase, server: PostgreSQLExecutor
) -> None:
    dsn = new_database()
    env = {**os.environ, "PYCOMPACTOR_DSN": dsn}
    procs = [
        subprocess.Popen([sys.executable, "-m", "pycompactor", "migrate"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outcomes = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    for proc in procs:
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()
    assert [code for code, _ in outcomes] == [0, 0, 0, 0], outcomes
    assert version_row(dsn) == [(schema.heads()[0],)]
    reference = new_database()
    schema.upgrade(reference)
    assert dump_schema(pg_bindir, dsn) == dump_schema(pg_bindir, reference)


def test_loader_sends_percent_and_colon_names_verbatim(
    conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    sql_file = tmp_path / "tricky.sql"
    sql_file.write_text(
        "CREATE TABLE public.tricky (t text);\n"
        "INSERT INTO public.tricky VALUES ('100% :name %s %(x)s');\n"
        "COMMENT ON TABLE public.tricky IS 'rate: 5%';\n",
        encoding="utf-8",
    )
    with conn.cursor() as cur:
        schema.execute_file(cur, sql_file)
    assert conn.execute("SELECT t FROM public.tricky").fetchone() == ("100% :name %s %(x)s",)
